"""The bootstrap protocol against untrusted peers, and end-to-end integrity, on a live ``KVSender``
(NIXL over UCX on 127.0.0.1, one process).

* Every message a peer sends is checked against its schema (:mod:`sparsekv.srt.disaggregation.messages`):
  the listed inputs that once killed a connection thread or were coerced (deep nesting, a non-string
  agent, a bad engine descriptor, ``"room": 1.9``, ``"room": "abc"``) get one refusal each, and the
  connection (and every other) goes on; a fuzz test sends random, malformed and truncated frames to
  the live bootstrap port, then a real decode still gets its room and no thread died.
* A shared secret: a peer that does not present it cannot claim a room (it once could, and the real
  decode then got "room N is already success").
* Integrity: bytes that differ from what the prefill hashed fail the room, naming the regions.
"""

from __future__ import annotations

import ctypes
import json
import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pd_sender_receiver import dsv4_pool, room_indices  # the same pools and rooms as the transfer tests

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.bootstrap import MAX_MESSAGE_BYTES, Channel, b64
from sparsekv.srt.disaggregation.integrity import region_digest
from sparsekv.srt.disaggregation.manifest import Manifest, ManifestMismatchError, Region
from sparsekv.srt.disaggregation.messages import ProtocolError, proof_matches, secret_proof
from sparsekv.srt.disaggregation.nixl_backend import NixlBackend
from sparsekv.srt.disaggregation.protocol import Transfer
from sparsekv.srt.disaggregation.receiver import KVReceiver
from sparsekv.srt.disaggregation.sender import KVSender
from sparsekv.srt.disaggregation.state_routing import kv_args_of
from sparsekv.testing import components
from sparsekv.testing.pd_session import fill_regions
from sparsekv.testing.profiles import scaled_examples

needs_nixl = components.needs_engine("nixl")
SECRET = "s3cret-of-this-deployment"


@pytest.fixture(scope="module")
def deployment():
    """A sender with a secret; the decode's kv_args and a NIXL agent for raw peers; thread deaths."""
    died: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda args: died.append(args.exc_value)
    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    fill_regions(prefill, seed=1)
    fill_regions(decode, seed=2)
    sender = KVSender(prefill, NixlBackend(net_devices="lo"), timeout_s=10, secret=SECRET, max_connections=8)
    raw_agent = NixlBackend(net_devices="lo")
    raw_agent.register(decode.regions())
    yield sender, decode, raw_agent, died
    raw_agent.close()
    sender.close()
    threading.excepthook = hook


def _hello(decode, backend: NixlBackend, **fields) -> dict:
    return {"op": "hello", "agent": b64(backend.descriptor()), "manifest": Manifest.of(decode).to_dict(),
            "session": "raw", "nonce": NONCE, **fields}


NONCE = "0123456789abcdef" * 2


def _answer_challenge(ch: Channel, secret: str = SECRET) -> dict:
    """Answer the prefill's challenge to a :func:`_hello` with ``secret``'s proof; the reply to it."""
    challenge = ch.recv(10)
    assert challenge["op"] == "challenge", challenge
    assert proof_matches(SECRET, "prefill", NONCE, challenge["nonce"], "raw", challenge["proof"])
    ch.send({"op": "proof", "proof": secret_proof(secret, "decode", NONCE, challenge["nonce"], "raw")})
    return ch.recv(10)


def _raw(sender) -> Channel:
    return Channel.connect(sender.address, 5)


def _send_frame(ch: Channel, payload: bytes) -> None:
    ch.sock.sendall(struct.pack(">I", len(payload)) + payload)


def _welcomed(sender, decode, agent) -> Channel:
    ch = _raw(sender)
    ch.send(_hello(decode, agent))
    assert _answer_challenge(ch)["op"] == "welcome"
    return ch


def _real_room_arrives(sender, decode, room: int, declare: bool = True) -> None:
    src_kv, src_states, dst_kv, dst_states = room_indices(1)
    if declare:
        sender.add_request(room, src_kv, src_states)
    receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=10, secret=SECRET)
    try:
        receiver.request(room, dst_kv, dst_states)
        receiver.wait(room)
    finally:
        receiver.close()


HELLO_CASES = {
    "deep nesting": lambda d, a: b'{"op": "hello", "manifest": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "non-string agent": lambda d, a: json.dumps(_hello(d, a, agent=12)).encode(),
    "bad engine descriptor": lambda d, a: json.dumps(_hello(d, a, agent=b64(b"not an agent"))).encode(),
    "no challenge": lambda d, a: json.dumps({k: v for k, v in _hello(d, a).items() if k != "nonce"}).encode(),
    "a short nonce": lambda d, a: json.dumps(_hello(d, a, nonce="abc")).encode(),
    "a list": lambda d, a: b"[1, 2]",
    "not utf-8": lambda d, a: b"\xff\xfe{",
}


@needs_nixl
@pytest.mark.parametrize("case", HELLO_CASES)
def test_a_bad_hello_gets_one_refusal_and_the_port_keeps_serving(deployment, case):
    sender, decode, agent, died = deployment
    ch = _raw(sender)
    try:
        _send_frame(ch, HELLO_CASES[case](decode, agent))
        reply = ch.recv(10)
        if reply["op"] == "challenge":  # a well-formed hello: what is wrong is checked after the proof
            ch.send({"op": "proof", "proof": secret_proof(SECRET, "decode", NONCE, reply["nonce"], "raw")})
            reply = ch.recv(10)
        assert reply["op"] == "refused" and reply["error"].startswith("sparsekv:"), reply
        with pytest.raises(ConnectionError):
            ch.recv(10)  # then closed: nothing else is sent
    finally:
        ch.close()
    assert died == []


@needs_nixl
@pytest.mark.parametrize("proof", ["wrong secret", "the prefill's own proof", "not hex"])
def test_a_decode_that_cannot_prove_the_secret_is_refused(deployment, proof):
    sender, decode, agent, died = deployment
    ch = _raw(sender)
    try:
        ch.send(_hello(decode, agent))
        challenge = ch.recv(10)
        answer = {"wrong secret": secret_proof(SECRET + "x", "decode", NONCE, challenge["nonce"], "raw"),
                  "the prefill's own proof": challenge["proof"], "not hex": "z" * 64}[proof]
        ch.send({"op": "proof", "proof": answer})
        reply = ch.recv(10)
        assert reply["op"] == "refused" and "secret" in reply["error"] or "`proof`" in reply["error"], reply
        with pytest.raises(ConnectionError):
            ch.recv(10)
    finally:
        ch.close()
    assert died == []


TRANSFER_CASES = [
    ({"op": "transfer", "room": 1.9, "kv_indices": [1], "state_indices": [[0], [0]]}, "`room`"),
    ({"op": "transfer", "room": "abc", "kv_indices": [1], "state_indices": [[0], [0]]}, "`room`"),
    ({"op": "transfer", "room": True, "kv_indices": [1], "state_indices": [[0], [0]]}, "`room`"),
    ({"op": "transfer", "room": 2**63, "kv_indices": [1], "state_indices": [[0], [0]]}, "`room`"),
    ({"op": "transfer", "room": 900, "kv_indices": [1.5], "state_indices": [[0], [0]]}, "`kv_indices[0]`"),
    ({"op": "transfer", "room": 900, "kv_indices": [1], "state_indices": {"a": 1}}, "`state_indices`"),
    ({"op": "transfer", "room": 900, "kv_indices": [1], "kv_group_indices": [], "state_indices": []},
     "`kv_group_indices`"),
    ({"op": 7}, "unknown bootstrap op 7"),
    ({"op": "launch"}, "unknown bootstrap op"),
]


@needs_nixl
def test_a_bad_transfer_message_gets_one_refusal_and_the_connection_goes_on(deployment):
    sender, decode, agent, died = deployment
    ch = _welcomed(sender, decode, agent)
    try:
        sender.add_request(1, *room_indices(1)[:2])
        for message, field in TRANSFER_CASES:
            ch.send(message)
            reply = ch.recv(10)
            assert reply.get("ok") is not True and field in reply["error"], (message, reply)
            assert reply["op"] == "refused" or reply["room"] == 900
        _send_frame(ch, b"[" * 50_000)  # a whole frame that is no JSON object: refused, stream still in step
        assert "not JSON" in ch.recv(10)["error"]
        # Room 1 was never claimed by `"room": 1.9` (it once became room 1): the real decode gets it.
        assert sender.status(1).value == "pending"
    finally:
        ch.close()
    _real_room_arrives(sender, decode, 1, declare=False)
    assert died == []


@needs_nixl
def test_a_peer_without_the_secret_cannot_claim_a_room(deployment):
    sender, decode, agent, died = deployment
    sender.add_request(2, *room_indices(1)[:2])
    with pytest.raises(ManifestMismatchError, match="secret"):
        KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=10)
    with pytest.raises(ManifestMismatchError, match="secret"):
        KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=10, secret="guess")
    assert sender.status(2).value == "pending"
    _real_room_arrives(sender, decode, 2, declare=False)
    assert sender.status(2).value == "success"


@needs_nixl
def test_connections_beyond_the_bound_are_refused(deployment):
    sender, *_ = deployment
    held = [_raw(sender) for _ in range(sender.max_connections)]
    try:
        extra = _raw(sender)
        reply = extra.recv(10)
        assert reply["op"] == "refused" and "at most 8" in reply["error"]
        extra.close()
    finally:
        for ch in held:
            ch.close()


bad_values = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8),
                       st.integers(max_value=-1), st.integers(min_value=2**63, max_value=2**70),
                       st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                              max_size=2))
fuzz_message = st.fixed_dictionaries({"op": st.sampled_from(["transfer", "hello", "status", "goodbye"])},
                                     optional={"room": bad_values, "kv_indices": bad_values,
                                               "state_indices": bad_values, "kv_group_indices": bad_values})
frames = st.one_of(
    fuzz_message.map(lambda m: json.dumps(m).encode()),
    st.binary(max_size=64),
    st.recursive(st.integers() | st.text(max_size=4), lambda c: st.lists(c, max_size=3), max_leaves=20)
    .map(lambda v: json.dumps(v).encode()),
)


@needs_nixl
@settings(deadline=None)
@given(frames=st.lists(frames, min_size=1, max_size=6), truncate=st.booleans())
def test_fuzzed_frames_never_kill_a_connection_thread(deployment, frames, truncate):
    sender, decode, agent, died = deployment
    ch = _welcomed(sender, decode, agent)
    try:
        for frame in frames:
            _send_frame(ch, frame)
            reply = ch.recv(10)  # exactly one answer, never a success
            assert reply["op"] in ("refused", "status") and reply.get("ok") is not True, reply
        if truncate:  # a frame cut short, then the peer goes away
            ch.sock.sendall(struct.pack(">I", 1000) + b'{"op": "tra')
    finally:
        ch.close()
    assert died == []


@needs_nixl
def test_after_the_fuzzing_a_real_decode_is_still_served(deployment):
    sender, decode, agent, died = deployment
    _real_room_arrives(sender, decode, 3)
    assert died == [] and sender.status(3).value == "success"


@needs_nixl
def test_an_oversized_frame_ends_only_its_connection(deployment):
    sender, decode, agent, died = deployment
    ch = _welcomed(sender, decode, agent)
    try:
        ch.sock.sendall(struct.pack(">I", MAX_MESSAGE_BYTES + 1))
        assert "exceeds" in ch.recv(10)["error"]
        with pytest.raises(ConnectionError):
            ch.recv(10)
    finally:
        ch.close()
    _real_room_arrives(sender, decode, 4)
    assert died == []


def test_a_transfer_decodes_to_exact_types_or_names_the_field():
    ok = Transfer.from_wire({"room": 5, "kv_indices": [1, 2], "state_indices": [[3]],
                             "kv_group_indices": {"c4_kv": [9]}})
    assert ok.room == 5 and ok.kv_indices == [1, 2] and ok.kv_group_indices == {"c4_kv": [9]}
    for bad, field in (({"room": 1.0, "kv_indices": []}, "room"), ({"room": 1, "kv_indices": [True]}, "kv_indices"),
                       ({"room": 1, "kv_indices": [], "state_indices": [["x"]]}, "state_indices")):
        with pytest.raises(ProtocolError, match=f"`{field}"):
            Transfer.from_wire(bad)


class CorruptingBackend(NixlBackend):
    """Flips one source byte of every write just before posting it: the bytes sent then differ from
    what the prefill hashed, as when a write lands in the wrong place or a stale page is sent."""

    def write(self, peer, rows, **kwargs):
        first = ctypes.c_uint8.from_address(int(rows[0, 0]))
        first.value ^= 0xFF
        return super().write(peer, rows, **kwargs)


@needs_nixl
@pytest.mark.parametrize("completion", ["status", "notifications"])
@pytest.mark.parametrize("checksums", [True, False])
def test_bytes_that_differ_from_what_was_sent_fail_the_room(checksums, completion):
    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    fill_regions(prefill, seed=1)
    fill_regions(decode, seed=2)
    sender = KVSender(prefill, CorruptingBackend(net_devices="lo"), timeout_s=10)
    try:
        receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=10,
                              checksums=checksums, completion=completion)
        try:
            src_kv, src_states, dst_kv, dst_states = room_indices(1)
            sender.add_request(1, src_kv, src_states)
            receiver.request(1, dst_kv, dst_states)
            if checksums:
                with pytest.raises(TransferError, match="arrived with other bytes than were sent"):
                    receiver.wait(1)
            else:
                receiver.wait(1)  # without the check the engine's success is all there is
        finally:
            receiver.close()
    finally:
        sender.close()


def test_region_digest_is_the_hash_of_the_items_in_index_order():
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, 6 * 10, dtype=np.uint8)
    region = Region("r", 10, data.nbytes, "DRAM", data.ctypes.data)
    assert region_digest(region, [4, 0, 4]) == xxhash.xxh3_64_intdigest(data.reshape(6, 10)[[4, 0, 4]].tobytes())
    with pytest.raises(IndexError, match="'r'"):
        region_digest(region, [6])
    assert len({region_digest(region, idx) for idx in ([0, 1], [1, 0], [0], [])}) == 4


_DIGEST_ITEMS = 12


@settings(max_examples=scaled_examples(30), deadline=None)
@given(st.sampled_from([10, 40 << 10]),  # short items: gathered first; long runs of 40 KiB items: hashed in place
       st.lists(st.one_of(st.integers(0, _DIGEST_ITEMS - 1),
                          st.tuples(st.integers(0, _DIGEST_ITEMS - 1), st.integers(1, 6))), max_size=8))
def test_region_digest_of_runs_and_scattered_items_hashes_their_concatenation(item_len, picks):
    import xxhash

    idx = []
    for pick in picks:  # single items and runs of consecutive items, in any order, repeats allowed
        first, n = (pick, 1) if isinstance(pick, int) else pick
        idx += list(range(first, min(first + n, _DIGEST_ITEMS)))
    data = np.random.default_rng(len(idx)).integers(0, 256, _DIGEST_ITEMS * item_len, dtype=np.uint8)
    region = Region("r", item_len, data.nbytes, "DRAM", data.ctypes.data)
    expected = xxhash.xxh3_64_intdigest(data.reshape(_DIGEST_ITEMS, item_len)[idx].tobytes())
    assert region_digest(region, idx) == expected

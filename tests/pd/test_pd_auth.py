"""Mutual authentication by challenge and response: the shared secret never crosses the wire.

The decode reaches the prefill's bootstrap port through a relay on loopback that records every byte
either way (the bootstrap connection is the only one that carries anything derived from the
secret: the engines never see it). A room arrives through it, and neither the secret nor any
encoding of it is among the recorded bytes. A proof recorded there is good for its own pair of
nonces only: replayed on a new connection it is refused. A prefill that cannot prove the secret is
refused by the decode (NIXL over UCX on 127.0.0.1).
"""

from __future__ import annotations

import base64
import json
import socket
import struct
import threading

import pytest
from test_pd_sender_receiver import dsv4_pool, needs_nixl, room_indices

from sparsekv.srt.disaggregation.bootstrap import Channel, listen
from sparsekv.srt.disaggregation.manifest import ManifestMismatchError
from sparsekv.srt.disaggregation.nixl_backend import NixlBackend
from sparsekv.srt.disaggregation.receiver import KVReceiver
from sparsekv.srt.disaggregation.sender import KVSender
from sparsekv.srt.disaggregation.state_routing import kv_args_of
from sparsekv.testing.pd_session import fill_regions

pytestmark = needs_nixl
SECRET = "the-deployment-secret-0f3a9c"
#: Loopback, another address than the sender's: the relay listens on the sender's port number there,
#: so the port every notification names is the port the decode connected to.
RELAY_HOST = "127.0.0.2"


class Relay:
    """Forwards one TCP connection to ``target`` and records every byte of it, both ways."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.recorded = bytearray()
        self._lock = threading.Lock()
        self._listener = listen(RELAY_HOST, target[1])
        self.address = self._listener.getsockname()
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        server = socket.create_connection(self.target, timeout=10)
        for a, b in ((client, server), (server, client)):
            t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.recorded += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def frames(self) -> list[dict]:
        """The recorded JSON messages (both directions interleave: parsed from each frame start)."""
        found, data = [], bytes(self.recorded)
        for start in range(len(data) - 4):
            (size,) = struct.unpack(">I", data[start : start + 4])
            if 2 <= size <= len(data) - start - 4 and data[start + 4 : start + 5] == b"{":
                try:
                    found.append(json.loads(data[start + 4 : start + 4 + size]))
                except ValueError:
                    continue
        return found

    def close(self) -> None:
        self._listener.close()
        for t in self._threads:
            t.join(10)


@pytest.fixture
def deployment():
    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    fill_regions(prefill, seed=1)
    fill_regions(decode, seed=2)
    sender = KVSender(prefill, NixlBackend(net_devices="lo"), timeout_s=10, secret=SECRET)
    yield sender, decode
    sender.close()


def test_the_secret_never_crosses_the_wire_and_a_recorded_proof_cannot_be_replayed(deployment):
    sender, decode = deployment
    relay = Relay(sender.address)
    try:
        receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [relay.address], timeout_s=10, secret=SECRET)
        try:
            src_kv, src_states, dst_kv, dst_states = room_indices(1)
            sender.add_request(1, src_kv, src_states)
            receiver.request(1, dst_kv, dst_states)
            receiver.wait(1)
        finally:
            receiver.close()
    finally:
        relay.close()
    recorded = bytes(relay.recorded)
    ops = [m["op"] for m in relay.frames()]
    assert ops[:4] == ["hello", "challenge", "proof", "welcome"] and "status" in ops  # all of it went through
    for form in (SECRET.encode(), SECRET.encode().hex().encode(), base64.b64encode(SECRET.encode()),
                 json.dumps(SECRET).encode()):
        assert form not in recorded

    # Replay: the recorded hello and proof, sent again, meet a fresh challenge and are refused.
    hello, proof = (next(m for m in relay.frames() if m["op"] == op) for op in ("hello", "proof"))
    ch = Channel.connect(sender.address, 10)
    try:
        ch.send(hello)
        assert ch.recv(10)["op"] == "challenge"
        ch.send(proof)
        reply = ch.recv(10)
        assert reply["op"] == "refused" and "did not prove" in reply["error"]
    finally:
        ch.close()


@pytest.mark.parametrize("secret", [None, "another-secret"])
def test_a_prefill_that_cannot_prove_the_secret_is_refused_by_the_decode(secret):
    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    sender = KVSender(prefill, NixlBackend(net_devices="lo"), timeout_s=10, secret=secret)
    try:
        with pytest.raises(ManifestMismatchError, match="did not prove it holds this deployment's secret"):
            KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=10, secret=SECRET)
    finally:
        sender.close()

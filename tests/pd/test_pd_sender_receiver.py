"""``KVSender`` / ``KVReceiver`` in one process, two NIXL agents over UCX on 127.0.0.1: rooms
requested all at once (the sender plans the next room while the previous one's writes run)
arrive byte for byte, and nothing else changes; a room asked for twice is refused the second
time. The room planner, reused across rooms, plans exactly what a fresh one plans. Skipped, with
the reason, only where NIXL cannot be imported (the planner test always runs)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.manifest import Manifest
from sparsekv.srt.disaggregation.nixl_backend import NixlBackend
from sparsekv.srt.disaggregation.planning import RoomPlanner, plan_room
from sparsekv.srt.disaggregation.protocol import Notification
from sparsekv.srt.disaggregation.receiver import KVReceiver
from sparsekv.srt.disaggregation.sender import KVSender
from sparsekv.srt.disaggregation.state_routing import kv_args_of
from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
from sparsekv.srt.model_executor.model_spec import ServerSpec, dsv4_preset
from sparsekv.srt.model_executor.pool_planner import plan_pipeline
from sparsekv.testing import components
from sparsekv.testing.pd_session import fill_regions, region_array
from sparsekv.testing.profiles import scaled_examples

needs_nixl = components.needs_engine("nixl")  # the only reason the transfer tests may skip (CI: fail)
ROOMS = 6


def dsv4_pool() -> DeepSeekV4TokenToKVPool:
    model = dsv4_preset("dsv4-flash", num_hidden_layers=6)
    rank = plan_pipeline(model, ServerSpec(max_running_requests=2), 16 << 20, 1).ranks[0]
    return DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device="cpu")


def room_indices(room: int) -> tuple[list[int], list[list[int]], list[int], list[list[int]]]:
    """Source and destination KV pages and state slots of a room; rooms never share a destination."""
    src_kv, dst_kv = [2 * room + 1, 2 * room + 2], [40 - 3 * room, 41 - 3 * room]
    return src_kv, [[room], [room % 4]], dst_kv, [[5 - room % 6], [4 - room % 4]]


def regions(args) -> list[tuple[str, np.ndarray, int]]:
    """``(component/label, bytes, item_len)`` of every region."""
    out = [(f"0/{lb}", region_array(p, n), i) for lb, p, n, i in
           zip(args.kv_labels, args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)]
    for c in range(len(args.state_types)):
        out += [(f"{c + 1}/{lb}", region_array(p, n), i) for lb, p, n, i in
                zip(args.state_labels[c], args.state_data_ptrs[c], args.state_data_lens[c], args.state_item_lens[c])]
    return out


@pytest.fixture
def linked(request):
    """A sender and a receiver connected over NIXL, their pools filled with different random bytes
    (``@pytest.mark.parametrize("linked", [{"history": 3}], indirect=True)`` bounds both histories,
    ``{"completion": ...}`` says how the receiver learns a success)."""
    options = getattr(request, "param", {})
    history, completion = options.get("history", 4096), options.get("completion", "status")
    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    fill_regions(prefill, seed=1)
    fill_regions(decode, seed=2)
    sender = KVSender(prefill, NixlBackend(net_devices="lo"), timeout_s=20, max_batch_rows=3, max_inflight=2,
                      history=history)
    try:
        receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=20, history=history,
                              completion=completion)
    except BaseException:
        sender.close()
        raise
    yield sender, receiver
    receiver.close()
    sender.close()


@needs_nixl
@pytest.mark.parametrize("linked", [{"completion": "status"}, {"completion": "notifications"}], indirect=True,
                         ids=["status", "notifications"])
def test_rooms_requested_at_once_arrive_byte_for_byte(linked):
    sender, receiver = linked
    source = {label: arr.copy() for label, arr, _ in regions(sender.kv_args)}
    expected = {label: arr.copy() for label, arr, _ in regions(receiver.kv_args)}
    for room in range(ROOMS):
        src_kv, src_states, dst_kv, dst_states = room_indices(room)
        sender.add_request(room, src_kv, src_states)
        for label, _, item in regions(receiver.kv_args):
            c = int(label.split("/")[0])
            src, dst = (src_kv, dst_kv) if c == 0 else (src_states[c - 1], dst_states[c - 1])
            for s, d in zip(src, dst):
                expected[label][d * item : (d + 1) * item] = source[label][s * item : (s + 1) * item]
    for room in range(ROOMS):  # all in flight before the first wait
        receiver.request(room, *room_indices(room)[2:])
    for room in range(ROOMS):
        receiver.wait(room)
    for label, arr, _ in regions(receiver.kv_args):
        assert np.array_equal(arr, expected[label]), label
    # With notifications the decode can see the last write land before the sender's poster does;
    # the sender's figures are those of a room it has finished.
    assert all(sender.wait(room).value == "success" for room in range(ROOMS))
    assert all(sender.stats(room)[0] > 0 for room in range(ROOMS))


@needs_nixl
@pytest.mark.parametrize("linked", [{"completion": "status"}, {"completion": "notifications"}], indirect=True,
                         ids=["status", "notifications"])
def test_a_room_asked_for_twice_is_refused_the_second_time(linked):
    sender, receiver = linked
    src_kv, src_states, dst_kv, dst_states = room_indices(1)
    sender.add_request(7, src_kv, src_states)
    receiver.request(7, dst_kv, dst_states)
    receiver.wait(7)
    arrived = {label: arr.copy() for label, arr, _ in regions(receiver.kv_args)}
    receiver.request(7, dst_kv, dst_states)
    # With notifications the decode can learn of the last write before the sender's poster has
    # seen it land: the room is then still live on this connection, and refused as such.
    with pytest.raises(TransferError, match="room 7 is already (success|asked for on this connection)"):
        receiver.wait(7)
    assert all(np.array_equal(arr, arrived[label]) for label, arr, _ in regions(receiver.kv_args))


@needs_nixl
@pytest.mark.parametrize("linked", [{"history": 3}], indirect=True)
def test_finished_rooms_beyond_the_history_are_forgotten(linked):
    sender, receiver = linked
    src_kv, src_states, dst_kv, dst_states = room_indices(1)
    for room in range(8):
        sender.add_request(room, src_kv, src_states)
        receiver.request(room, dst_kv, dst_states)
        receiver.wait(room)
    assert [sender.status(r).value for r in range(4, 8)] == ["pending"] + ["success"] * 3  # 4: forgotten
    with pytest.raises(KeyError):
        sender.stats(4)
    assert sender.stats(7)[0] > 0
    sender.add_request(0, src_kv, src_states)  # a forgotten id may be declared again
    assert [receiver.poll(r)[0].value for r in (4, 7)] == ["pending", "success"]
    receiver.request(0, dst_kv, dst_states)
    receiver.wait(0)


def test_a_history_below_one_is_refused():
    with pytest.raises(ValueError, match="history"):  # checked before the backend is touched
        KVReceiver(_ARGS, None, [], history=0)
    with pytest.raises(ValueError, match="history"):
        KVSender(_ARGS, None, history=0)
    with pytest.raises(ValueError, match="completion"):
        KVReceiver(_ARGS, None, [], completion="psychic")


_ARGS = kv_args_of(dsv4_pool())
_MANIFEST = Manifest.of(_ARGS)
_PLANNER = RoomPlanner(_MANIFEST, _MANIFEST, _ARGS)  # one planner for every example, as a connection keeps it
pages = st.lists(st.integers(0, 57), min_size=1, max_size=12, unique=True)


@settings(max_examples=scaled_examples(25), deadline=None)
@given(pages, pages, st.booleans(), st.booleans())
def test_a_reused_planner_plans_what_a_fresh_one_does(src_kv, dst_kv, own_c4_pages, coalesce):
    n = min(len(src_kv), len(dst_kv))
    src_kv, dst_kv = src_kv[:n], dst_kv[:n]
    request = {"kv_indices": dst_kv, "state_indices": [[3], [2]]}
    if own_c4_pages:  # HiSparse: the C4 KV group has destinations of its own
        request["kv_group_indices"] = {"c4_kv": dst_kv[::-1]}
    fresh = plan_room(_MANIFEST, _MANIFEST, _ARGS, src_kv, [[1], [0]], request, coalesce=coalesce)
    reused = _PLANNER.plan(src_kv, [[1], [0]], request, coalesce=coalesce)
    assert fresh.keys() == reused.keys()
    for kinds in fresh:
        assert np.array_equal(np.concatenate(fresh[kinds]), np.concatenate(reused[kinds]))


@needs_nixl
def test_an_on_done_that_raises_never_costs_the_connection(linked):
    # on_done is the scheduler's code: one that raises is logged, and every room still gets its
    # status (a success, a refusal), and the connection serves the next room. It once killed the
    # thread that raised, and the decode saw the connection end or a room never answer.
    sender, receiver = linked
    calls = []

    def on_done(room: int, ok: bool) -> None:
        calls.append((room, ok))
        raise RuntimeError("a scheduler bug")

    src_kv, src_states, dst_kv, dst_states = room_indices(1)
    for room in (1, 2, 3):
        sender.add_request(room, src_kv, src_states, on_done=on_done)
    receiver.request(1, dst_kv, dst_states)
    receiver.wait(1)
    receiver.request(2, dst_kv, [dst_states[0] + [6], dst_states[1]])  # one SWA destination too many
    with pytest.raises(TransferError, match="room 2 refused before any write.*index length mismatch"):
        receiver.wait(2)
    receiver.request(3, dst_kv, dst_states)
    receiver.wait(3)
    assert calls == [(1, True), (2, False), (3, True)]


@needs_nixl
def test_finished_connections_are_forgotten(linked):
    # Each decode connection once left its channel and thread behind until the next one arrived.
    sender, receiver = linked
    src_kv, src_states, dst_kv, dst_states = room_indices(1)
    for room in (11, 12, 13):
        other = KVReceiver(receiver.kv_args, NixlBackend(net_devices="lo"), [sender.address], timeout_s=20)
        try:
            sender.add_request(room, src_kv, src_states)
            other.request(room, dst_kv, dst_states)
            other.wait(room)
            assert sender.connections == 2
        finally:
            other.close()
    with sender._cond:  # each connection's thread forgets it as it ends (bye, then the socket closes)
        assert sender._cond.wait_for(lambda: len(sender._connections) == 1, timeout=20), sender._connections
    assert sender.connections == 1  # the fixture's receiver, still served


@needs_nixl
def test_ucx_settings_reach_the_agent_not_the_environment(monkeypatch):
    for key in ("UCX_NET_DEVICES", "UCX_TLS"):
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    backend = NixlBackend(net_devices="lo", tls="tcp")  # through the UCX backend's engine_config
    backend.close()
    assert dict(os.environ) == before
    with pytest.raises(ValueError, match="`net_devices`.*UCX_NET_DEVICES"):
        NixlBackend(net_devices="lo,eth0")  # engine_config cannot carry a list: refused before any agent


class _SettledNixl(NixlBackend):
    """A NIXL endpoint whose writes have landed by the time ``write`` returns, and which records
    each (room, batch) it posts in ``events``."""

    def __init__(self, events: list, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events = events

    def write(self, peer, rows, *, src_kind, dst_kind, notif=b""):
        handle = super().write(peer, rows, src_kind=src_kind, dst_kind=dst_kind, notif=notif)
        while handle.status() == "PROC":
            time.sleep(1e-4)
        notification = Notification.decode(notif)
        self.events.append(("posted", notification.room, notification.batch))
        return handle


@needs_nixl
def test_a_landed_batch_is_reported_before_the_next_one_is_posted():
    # The poster once posted up to max_inflight batches before it looked at the oldest, so a room
    # whose bytes had landed was reported only after the copies behind it (the decode then hashed
    # bytes long gone from the cache, and waited longer).
    events = []
    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    sender = KVSender(prefill, _SettledNixl(events, net_devices="lo"), timeout_s=20, max_batch_rows=3, max_inflight=4,
                      progress=lambda room, done, batches: events.append(("landed", room, done - 1)))
    try:
        receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], timeout_s=20)
        try:
            for room in range(3):
                src_kv, src_states, dst_kv, dst_states = room_indices(room)
                sender.add_request(room, src_kv, src_states)
            for room in range(3):
                receiver.request(room, *room_indices(room)[2:])
            for room in range(3):
                receiver.wait(room)
        finally:
            receiver.close()
    finally:
        sender.close()
    posted = [e[1:] for e in events if e[0] == "posted"]
    assert len(posted) > 3  # several batches per room (3 rows each)
    assert events == [(kind, *batch) for batch in posted for kind in ("posted", "landed")]

"""Giving a room up, and a prefill that holds nothing back, on a live ``KVSender`` / ``KVReceiver`` pair
(NIXL over UCX on 127.0.0.1, one process).

* The late-write probe: a decode gives a room up (its wait times out, it cancels mid-transfer, it
  closes), waits until :meth:`KVReceiver.released`, reuses the destinations (writes a marker),
  and only then does the prefill declare or go on with the room: the marker survives. (The
  prefill once declared such a room later and wrote it over the reused pages, and reported
  success.)
* A room asked for before it is declared waits aside: the rooms asked for after it arrive
  meanwhile (it once held every later room of its connection for ``source_s``).
* A connection that holds no room is closed after ``idle_s`` (idle connections once filled
  ``max_connections`` and denied every real decode); a decode whose idle connection was closed
  connects again for its next room.
* A closed decode leaves no socket behind, even while its owner keeps the closed object (NIXL
  frees an agent's UCX worker, listener and connections only with the agent object, which a
  closed backend once kept: a decode process gained 42 sockets over 150 reconnects).

Short deadlines keep each test's wall time small; nothing here asserts a duration.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time

import numpy as np
import pytest
from test_pd_sender_receiver import dsv4_pool, needs_nixl, regions, room_indices

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.bootstrap import Channel, b64
from sparsekv.srt.disaggregation.deadlines import Deadlines
from sparsekv.srt.disaggregation.manifest import Manifest
from sparsekv.srt.disaggregation.nixl_backend import NixlBackend
from sparsekv.srt.disaggregation.protocol import Notification
from sparsekv.srt.disaggregation.receiver import KVReceiver
from sparsekv.srt.disaggregation.room import RoomStatus
from sparsekv.srt.disaggregation.state_routing import kv_args_of
from sparsekv.testing.pd_session import fill_regions

pytestmark = needs_nixl
MARKER = 0xA5
#: Every wait long enough for a loaded CI machine; the source wait longer than any test waits for a room.
DEADLINES = Deadlines(handshake_s=10, message_s=10, source_s=60, write_s=10, arrival_s=20, idle_s=60,
                      quarantine_s=1, close_s=10)


def _pair(**sender_kwargs):
    from sparsekv.srt.disaggregation.sender import KVSender

    prefill, decode = kv_args_of(dsv4_pool()), kv_args_of(dsv4_pool())
    fill_regions(prefill, seed=1)
    fill_regions(decode, seed=2)
    backend = sender_kwargs.pop("backend", None) or NixlBackend(net_devices="lo")
    sender = KVSender(prefill, backend, deadlines=sender_kwargs.pop("deadlines", DEADLINES), **sender_kwargs)
    return sender, decode


def _receiver(sender, decode) -> KVReceiver:
    return KVReceiver(decode, NixlBackend(net_devices="lo"), [sender.address], deadlines=DEADLINES)


@contextlib.contextmanager
def _connected(**sender_kwargs):
    """``(sender, receiver, decode kv args)`` of a connected pair (:func:`_pair`); both closed after."""
    sender, decode = _pair(**sender_kwargs)
    try:
        receiver = _receiver(sender, decode)
        try:
            yield sender, receiver, decode
        finally:
            receiver.close()
    finally:
        sender.close()


def _mark(decode, room: int) -> dict[str, np.ndarray]:
    """Write the marker into every destination item of ``room`` (the decode reused them); a copy of
    every region as it then is."""
    _, _, dst_kv, dst_states = room_indices(room)
    for label, arr, item in regions(decode):
        c = int(label.split("/")[0])
        for d in dst_kv if c == 0 else dst_states[c - 1]:
            arr[d * item : (d + 1) * item] = MARKER
    return {label: arr.copy() for label, arr, _ in regions(decode)}


def _unchanged(decode, snapshot: dict[str, np.ndarray], but_room: int | None = None) -> list[str]:
    """The regions that differ from ``snapshot`` outside room ``but_room``'s destinations."""
    changed = []
    skip = room_indices(but_room)[2:] if but_room is not None else ([], [[]] * 2)
    for label, arr, item in regions(decode):
        c = int(label.split("/")[0])
        expected = snapshot[label].copy()
        for d in skip[0] if c == 0 else skip[1][c - 1]:
            expected[d * item : (d + 1) * item] = arr[d * item : (d + 1) * item]
        if not np.array_equal(arr, expected):
            changed.append(label)
    return changed


def _another_room_arrives(sender, receiver, room: int, like: int | None = None, wait: bool = True) -> None:
    """A room requested after the given-up one arrives: every message before it was handled (its
    pages those of :func:`room_indices` of ``like``, default ``room``; ``wait=False``: only asked for)."""
    src_kv, src_states, dst_kv, dst_states = room_indices(room if like is None else like)
    sender.add_request(room, src_kv, src_states)
    receiver.request(room, dst_kv, dst_states)
    if wait:
        receiver.wait(room)


def test_a_room_given_up_before_it_is_declared_is_never_written():
    with _connected() as (sender, receiver, decode):
        src_kv, src_states, dst_kv, dst_states = room_indices(1)
        receiver.request(1, dst_kv, dst_states)
        with pytest.raises(TransferError, match="did not arrive within"):
            receiver.wait(1, timeout_s=0.2)  # the prefill has not declared it: the decode gives up
        assert receiver.wait_released(1)  # the prefill confirmed: nothing of room 1 will be written
        snapshot = _mark(decode, 1)  # the decode reuses the pages
        sender.add_request(1, src_kv, src_states)  # then the prefill declares it
        _another_room_arrives(sender, receiver, 2)
        assert _unchanged(decode, snapshot, but_room=2) == []  # the marker survives
        assert sender.status(1) == RoomStatus.PENDING  # nobody asks for it any more


def test_a_room_pending_when_the_decode_closes_is_never_written():
    sender, decode = _pair()
    try:
        receiver = _receiver(sender, decode)
        src_kv, src_states, dst_kv, dst_states = room_indices(1)
        receiver.request(1, dst_kv, dst_states)
        receiver.close()  # gives room 1 up and waits until the prefill confirmed it
        snapshot = _mark(decode, 1)
        sender.add_request(1, src_kv, src_states)
        other = _receiver(sender, decode)
        try:
            _another_room_arrives(sender, other, 2)
        finally:
            other.close()
        assert _unchanged(decode, snapshot, but_room=2) == []
        assert sender.status(1) == RoomStatus.PENDING
    finally:
        sender.close()


class _GatedNixl(NixlBackend):
    """Holds the post of ``room``'s batch ``batch`` until ``release()`` says go; counts its posts."""

    def __init__(self, room: int, batch: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.room, self.batch = room, batch
        self.reached, self.go = threading.Event(), threading.Event()
        self.posted: list[int] = []

    def write(self, peer, rows, *, src_kind, dst_kind, notif=b""):
        notification = Notification.decode(notif)
        if notification.room == self.room:
            if notification.batch == self.batch:
                self.reached.set()
                assert self.go.wait(20)
            self.posted.append(notification.batch)
        return super().write(peer, rows, src_kind=src_kind, dst_kind=dst_kind, notif=notif)


def test_a_room_given_up_mid_transfer_posts_no_further_batch():
    gated = _GatedNixl(room=1, batch=1, net_devices="lo")
    # One row per batch, one batch in flight: room 1 takes many batches, posted one by one.
    with _connected(backend=gated, max_batch_rows=1, max_inflight=1) as (sender, receiver, decode):
        try:
            src_kv, src_states, dst_kv, dst_states = room_indices(1)
            sender.add_request(1, src_kv, src_states)
            receiver.request(1, dst_kv, dst_states)
            assert gated.reached.wait(20)  # batch 0 landed, batch 1 is about to be posted
            receiver.cancel(1, "the request was aborted")
            with sender._cond:  # the prefill read the cancel before batch 1 goes out
                assert sender._cond.wait_for(lambda: any(1 in c.cancels for c in sender._connections.values()), 20)
            gated.go.set()
            assert receiver.wait_released(1)
            snapshot = _mark(decode, 1)
            _another_room_arrives(sender, receiver, 2)
            assert _unchanged(decode, snapshot, but_room=2) == []
            assert gated.posted == [0, 1]  # batch 1 was past the check; no batch after it
            assert sender.status(1) == RoomStatus.FAILED and "gave the room up" in sender.error(1)
            assert receiver.poll(1) == (RoomStatus.FAILED, "gave up: the request was aborted")
        finally:
            gated.go.set()


def test_a_given_up_room_cannot_be_asked_for_again_until_released():
    with _connected() as (sender, receiver, _):
        src_kv, src_states, dst_kv, dst_states = room_indices(1)
        receiver.request(1, dst_kv, dst_states)
        with pytest.raises(ValueError, match="room 1 is still in transfer"):
            receiver.request(1, dst_kv, dst_states)
        receiver.cancel(1)
        assert receiver.wait_released(1)
        sender.add_request(1, src_kv, src_states)
        receiver.request(1, dst_kv, dst_states)  # released: a new transfer of room 1
        receiver.wait(1)


def test_a_room_asked_for_before_it_is_declared_does_not_delay_the_rooms_behind_it():
    with _connected() as (sender, receiver, _):
        receiver.request(1, *room_indices(1)[2:])  # never declared
        for room in (2, 3):
            _another_room_arrives(sender, receiver, room)
        assert receiver.poll(1) == (RoomStatus.PENDING, "")  # still waiting aside, not failed first


def _hello(decode, agent: NixlBackend) -> dict:
    return {"op": "hello", "agent": b64(agent.descriptor()), "manifest": Manifest.of(decode).to_dict(),
            "session": "idle"}


def test_idle_connections_are_closed_and_a_decode_connects_again():
    idle = Deadlines(**{**DEADLINES.__dict__, "idle_s": 0.3})
    sender, decode = _pair(deadlines=idle, max_connections=2)
    agent = NixlBackend(net_devices="lo")
    agent.register(decode.regions())
    try:
        held = []
        for _ in range(2):  # every slot taken by a welcomed peer that asks for nothing
            ch = Channel.connect(sender.address, 10)
            ch.send(_hello(decode, agent))
            assert ch.recv(10)["op"] == "welcome"
            held.append(ch)
        for ch in held:
            assert ch.recv(10) == {"op": "bye"}  # it held no room: told, then closed
            with pytest.raises(ConnectionError):
                ch.recv(10)
            ch.close()
        receiver = _receiver(sender, decode)  # a slot is free again
        try:
            _another_room_arrives(sender, receiver, 1)
            # Its connection idles out too. Room 2 is asked for between the decode's reader closing
            # the channel on the bye and marking the stage closed (the reader waits for the lock
            # this test holds): the send finds the channel closed, and the reader, once it has the
            # lock, connects again and asks for room 2 itself.
            with receiver._cond:
                stage = receiver._stages[0]
                deadline = time.monotonic() + 20
                while stage.channel.sock.fileno() != -1 and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert not stage.closed
                _another_room_arrives(sender, receiver, 2, wait=False)
            receiver.wait(2)
            # Room 3 once the decode knows the stage closed it: the request connects again first.
            with receiver._cond:
                assert receiver._cond.wait_for(lambda: receiver._stages[0].closed, 20)
            _another_room_arrives(sender, receiver, 3)
        finally:
            receiver.close()
    finally:
        agent.close()
        sender.close()


def _open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += stat.S_ISSOCK(os.stat(f"/proc/self/fd/{fd}").st_mode)
        except OSError:  # closed meanwhile
            pass
    return count


def test_a_closed_decode_leaves_no_socket_behind():
    sender, decode = _pair()
    closed = []  # kept, as an owner that forgets nothing would keep them
    try:
        for room in range(9):
            if room == 1:
                before = _open_sockets()  # after one decode came and went: the sender's own are open
            receiver = _receiver(sender, decode)
            _another_room_arrives(sender, receiver, room, like=1)
            receiver.close()
            closed.append(receiver)
        # Each closed decode's agent once kept a listening socket and its connections open: +8 or
        # more here. What may remain is the sender's side of the last connection, still closing.
        assert _open_sockets() <= before + 3
    finally:
        sender.close()

"""A room completes only when complete, and only from its own session, against a prefill stage that
lies (a stage driven by the test: real bootstrap socket, real NIXL agent over UCX on 127.0.0.1).

* A success that claims less than the room's plan fails the room: zero batches, a batch count
  beyond the plan, notifications that disagree with it, digests missing for a region the stage
  sends, a digest for a region it does not send. (A ``Status`` with ``ok=true, batches=0,
  digests={}`` once completed a room with checksums on, in both completion modes.) The honest
  claim, made the same way, completes the room: the failures are the claims'.
* A notification of another session is not counted (the receiver's session filter).
* With several prefill stages, the bytes of each are checked: one stage's corrupted writes fail
  the room, naming that stage.
* A stage that fails a room with writes still in flight (``inflight``), then goes away without
  confirming the cancel, keeps the room's destinations unreleased for the quarantine.
* A room asked for just as the stage closes an idle connection (its bye ahead of the unread
  request) is asked for again on a new connection.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

import pytest
from test_pd_protocol import CorruptingBackend
from test_pd_sender_receiver import dsv4_pool, needs_nixl, room_indices

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.bootstrap import Channel, b64, listen, unb64
from sparsekv.srt.disaggregation.deadlines import Deadlines
from sparsekv.srt.disaggregation.integrity import room_digests
from sparsekv.srt.disaggregation.manifest import Manifest
from sparsekv.srt.disaggregation.nixl_backend import NixlBackend
from sparsekv.srt.disaggregation.protocol import Bye, Cancelled, Notification, Status, Welcome
from sparsekv.srt.disaggregation.receiver import KVReceiver
from sparsekv.srt.disaggregation.room import RoomStatus
from sparsekv.srt.disaggregation.sender import KVSender
from sparsekv.srt.disaggregation.state_routing import kv_args_of
from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
from sparsekv.srt.model_executor.model_spec import ServerSpec, dsv4_preset
from sparsekv.srt.model_executor.pool_planner import plan_pipeline
from sparsekv.testing.pd_session import fill_regions

pytestmark = needs_nixl


class LyingStage:
    """A prefill stage whose answers the test writes: it welcomes one decode, then sends whatever
    statuses and notifications (through its NIXL agent) the test tells it to."""

    def __init__(self) -> None:
        self.kv_args = kv_args_of(dsv4_pool())
        self.backend = NixlBackend(net_devices="lo")
        self.backend.register(self.kv_args.regions())
        self._listener = listen()
        self.address = self._listener.getsockname()
        self._accepted = threading.Thread(target=self._accept, daemon=True)
        self._accepted.start()

    def _accept(self) -> None:
        sock, _ = self._listener.accept()
        self.channel = Channel(sock)
        self.hello = self.channel.recv(10)
        self.peer = self.backend.connect(unb64(self.hello["agent"]))
        self.channel.send(Welcome(b64(self.backend.descriptor()), Manifest.of(self.kv_args).to_dict()).encode())

    def connected(self, decode, answer_cancels: bool = True, quarantine_s: float = 10) -> KVReceiver:
        deadlines = Deadlines(**{**Deadlines.uniform(10).__dict__, "quarantine_s": quarantine_s, "close_s": 2})
        receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [self.address], deadlines=deadlines,
                              completion=self.completion)
        self._accepted.join(10)
        if answer_cancels:
            threading.Thread(target=self._answer_cancels, daemon=True).start()
        return receiver

    def accept_again(self) -> threading.Thread:
        """Accept the decode's next connection (on a thread: join it once the decode connected)."""
        self._accepted = threading.Thread(target=self._accept, daemon=True)
        self._accepted.start()
        return self._accepted

    def _answer_cancels(self) -> None:
        """Read the decode's messages; confirm each cancel (nothing is ever written here)."""
        while True:
            try:
                message = self.channel.recv(60)
            except (ConnectionError, TimeoutError, ValueError, OSError):
                return
            if message["op"] == "cancel":
                self.channel.send(Cancelled(message["room"]).encode())

    def notify(self, room: int, batch: int, batches: int, digests=None, session: str | None = None) -> None:
        notif = Notification(self.hello["session"] if session is None else session, self.address[1], room, batch,
                             batches, digests)
        self.backend.send_notif(self.peer, notif.encode())

    def close(self) -> None:
        self.channel.close()
        self._listener.close()
        self.backend.close()


@contextlib.contextmanager
def lying_connection(completion: str, **connected):
    """``(stage, receiver, decode kv args)``: a decode (completing rooms by ``completion``, its
    regions seeded) connected to a :class:`LyingStage` (``connected``: its options); both closed after."""
    stage = LyingStage()
    stage.completion = completion
    decode = kv_args_of(dsv4_pool())
    fill_regions(decode, seed=2)
    try:
        receiver = stage.connected(decode, **connected)
        try:
            yield stage, receiver, decode
        finally:
            receiver.close()
    finally:
        stage.close()


def honest_digests(decode, room: int) -> dict[str, str]:
    """The digests of what the decode's destinations of ``room`` hold: nothing is written, so these
    are the digests an honest stage would report for bytes equal to them."""
    _, _, dst_kv, dst_states = room_indices(room)
    return {k: f"{v:016x}" for k, v in room_digests(Manifest.of(decode).components, dst_kv, {}, dst_states).items()}


#: What the stage claims for room 1: ``(status or None, notifications)`` from the honest digests ``h``.
CLAIMS = {
    "honest": lambda h: (Status(1, True, batches=1, digests=h), [(0, 1, None)]),
    "zero batches, no digests": lambda h: (Status(1, True, batches=0, digests={}), []),
    "zero batches": lambda h: (Status(1, True, batches=0, digests=h), []),
    "more batches than items": lambda h: (Status(1, True, batches=10**6, digests=h), [(0, 10**6, None)]),
    "no digests": lambda h: (Status(1, True, batches=1, digests={}), [(0, 1, None)]),
    "a digest missing": lambda h: (Status(1, True, batches=1, digests=dict(list(h.items())[1:])), [(0, 1, None)]),
    "an unknown region": lambda h: (Status(1, True, batches=1, digests={**h, "kv/evil:0": "0" * 16}),
                                    [(0, 1, None)]),
    "a malformed digest": lambda h: (Status(1, True, batches=1, digests={**h, next(iter(h)): "-1"}), [(0, 1, None)]),
    "notifications of another count": lambda h: (Status(1, True, batches=1, digests=h), [(0, 2, None)]),
}
NOTIFIED_CLAIMS = {
    "honest": lambda h: (None, [(0, 1, h)]),
    "zero batches": lambda h: (None, [(0, 0, h)]),
    "no digests": lambda h: (None, [(0, 1, {})]),
    "an unknown region": lambda h: (None, [(0, 1, {**h, "swa/evil:0": "0" * 16})]),
    "counts that disagree": lambda h: (None, [(1, 3, None), (0, 2, h)]),
}


def _claimed(completion: str, claim) -> tuple[RoomStatus, str]:
    with lying_connection(completion) as (stage, receiver, decode):
        receiver.request(1, *room_indices(1)[2:])
        status, notifs = claim(honest_digests(decode, 1))
        for batch, batches, digests in notifs:
            stage.notify(1, batch, batches, digests)
        if status is not None:
            stage.channel.send(status.encode())
        try:
            receiver.wait(1)
        except TransferError as e:
            return RoomStatus.FAILED, str(e)
        return RoomStatus.SUCCESS, ""


@pytest.mark.parametrize(("completion", "claim"), [("status", claim) for claim in CLAIMS]
                         + [("notifications", claim) for claim in NOTIFIED_CLAIMS])
def test_a_claim_of_less_than_the_plan_fails_the_room(completion, claim):
    # In a Status, or in the notifications of a decode that completes rooms from them alone.
    outcome, error = _claimed(completion, (CLAIMS if completion == "status" else NOTIFIED_CLAIMS)[claim])
    if claim == "honest":
        assert outcome == RoomStatus.SUCCESS
    else:
        assert outcome == RoomStatus.FAILED and "prefill stage 0" in error, error


def test_a_notification_of_another_session_is_not_counted():
    with lying_connection("notifications") as (stage, receiver, decode):
        receiver.request(1, *room_indices(1)[2:])
        receiver.request(2, *room_indices(2)[2:])
        # Room 1's claim is complete and honest, but from another deployment's session.
        stage.notify(1, 0, 1, honest_digests(decode, 1), session="another-deployment")
        stage.notify(2, 0, 1, honest_digests(decode, 2))  # delivered after it, from the same agent
        receiver.wait(2)
        assert receiver.poll(1) == (RoomStatus.PENDING, "")


def _pp_pools(pp_size: int) -> tuple[list[DeepSeekV4TokenToKVPool], DeepSeekV4TokenToKVPool]:
    """The prefill's PP stage pools, and a decode pool holding every layer."""
    model = dsv4_preset("dsv4-flash", num_hidden_layers=6)
    server = ServerSpec(max_running_requests=2)
    stages = [DeepSeekV4TokenToKVPool(r.config, r.configurator, device="cpu")
              for r in plan_pipeline(model, server, 16 << 20, pp_size).ranks]
    rank = plan_pipeline(model, server, (16 << 20) * pp_size, 1).ranks[0]
    return stages, DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device="cpu")


@pytest.mark.parametrize("corrupted", [0, 1, 2])
def test_each_prefill_stage_s_bytes_are_checked(corrupted):
    stage_pools, decode_pool = _pp_pools(3)
    decode = kv_args_of(decode_pool)
    fill_regions(decode, seed=2)
    senders = []
    try:
        for i, pool in enumerate(stage_pools):
            args = kv_args_of(pool)
            fill_regions(args, seed=10 + i)
            backend = CorruptingBackend(net_devices="lo") if i == corrupted else NixlBackend(net_devices="lo")
            senders.append(KVSender(args, backend, timeout_s=10))
        receiver = KVReceiver(decode, NixlBackend(net_devices="lo"), [s.address for s in senders], timeout_s=10)
        try:
            src_kv, src_states, dst_kv, dst_states = room_indices(1)
            for sender in senders:
                sender.add_request(1, src_kv, src_states)
            receiver.request(1, dst_kv, dst_states)
            with pytest.raises(TransferError, match=f"prefill stage {corrupted}: .* arrived with other bytes"):
                receiver.wait(1)
        finally:
            receiver.close()
    finally:
        for sender in senders:
            sender.close()


def test_a_room_asked_for_as_the_stage_closes_an_idle_connection_is_asked_for_again():
    with lying_connection("status", answer_cancels=False) as (stage, receiver, decode):
        receiver.request(1, *room_indices(1)[2:])
        first = stage.channel
        assert select.select([first.sock], [], [], 10)[0]  # the request is there, unread
        again = stage.accept_again()
        first.send(Bye().encode())  # the stage had decided it was idle: bye, then close
        first.sock.shutdown(socket.SHUT_WR)
        while first.sock.recv(1 << 16):  # until the decode closes its end
            pass
        first.close()
        again.join(10)
        assert stage.channel is not first and stage.channel.recv(10)["op"] == "transfer"  # asked again
        stage.notify(1, 0, 1)
        stage.channel.send(Status(1, True, batches=1, digests=honest_digests(decode, 1)).encode())
        receiver.wait(1)


@pytest.mark.parametrize("quarantine_s", [60, 0.2])
def test_a_failure_with_writes_in_flight_releases_the_room_only_after_the_quarantine(quarantine_s):
    with lying_connection("status", answer_cancels=False, quarantine_s=quarantine_s) as (stage, receiver, _):
        receiver.request(1, *room_indices(1)[2:])
        stage.channel.send(Status(1, False, error="writes did not stop", inflight=True).encode())
        with pytest.raises(TransferError, match="writes did not stop"):
            receiver.wait(1)
        assert not receiver.released(1)  # its writes may still land, and the stage is still there
        stage.channel.close()  # it goes away without confirming the cancel
        with receiver._cond:
            assert receiver._cond.wait_for(lambda: receiver._stages[0].closed, 10)
        if quarantine_s > 10:
            assert not receiver.wait_released(1, timeout_s=0.2)
        else:
            assert receiver.wait_released(1, timeout_s=10)

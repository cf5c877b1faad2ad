"""``KVReceiver``: the decode side, which asks every prefill stage for rooms and waits for them.

The decode scheduler allocates a room's destinations and asks for it (:meth:`KVReceiver.request`,
sent to every prefill PP stage). A room is done when every stage reported success, every batch's
:class:`~.protocol.Notification` arrived (the engine delivers a batch's notification after its
data) *and*, with ``checksums`` (the default), every region's digest equals that of the bytes it
received; a mismatch fails the room naming the regions. Every wait is bounded; a prefill that dies
mid-transfer fails the room within the bound.

How a stage's success is learnt is one argument, ``completion``:

* ``"status"`` (the default): the stage's :class:`~.protocol.Status` message on the bootstrap
  connection (with the batch count and digests), then the notifications; :meth:`KVReceiver.wait`
  sleeps until the status arrives and only then polls the engine;
* ``"notifications"``: the notifications alone (each names its room's batch count, batch 0's
  carries the digests), no status round trip; a stage still sends a status when a room fails.
  The engine only offers polling for notifications (NIXL's ``get_notifs``), so
  :meth:`KVReceiver.wait` polls it from the request on.

Lifecycle: ``KVReceiver(kv_args, backend, addresses)`` registers, connects and checks the
manifests (raising :class:`~.manifest.ManifestMismatchError` on both sides); ``close()`` says
goodbye and releases everything.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from sparsekv.checks import one_of
from sparsekv.srt.disaggregation.backend import TransferBackend, TransferError, poll_pause
from sparsekv.srt.disaggregation.bootstrap import Channel, PeerClosedError, Wakeup, b64
from sparsekv.srt.disaggregation.deadlines import Deadlines
from sparsekv.srt.disaggregation.integrity import mismatched, room_digests
from sparsekv.srt.disaggregation.kv_args import KVArgs
from sparsekv.srt.disaggregation.manifest import Manifest, ManifestMismatchError, check_manifests
from sparsekv.srt.disaggregation.messages import ProtocolError
from sparsekv.srt.disaggregation.protocol import (
    Bye,
    Hello,
    Notification,
    Refused,
    Status,
    Transfer,
    Welcome,
    decode,
)
from sparsekv.srt.disaggregation.room import RoomState, RoomStatus, RoomTable

logger = logging.getLogger(__name__)

#: How a stage's success is learnt (:class:`KVReceiver`'s ``completion``), the first the default.
COMPLETIONS = ("status", "notifications")


@dataclass
class _Stage:
    channel: Channel
    port: int
    manifest: Manifest
    closed: bool = False
    thread: threading.Thread | None = None


@dataclass
class _Arrival:
    """A requested room: its destinations (for the digests) and what each stage said of it."""

    request: Transfer
    statuses: dict[int, Status] = field(default_factory=dict)  # stage index -> its status
    notifs: dict[int, set[int]] = field(default_factory=dict)  # stage index -> batches notified
    notified_batches: dict[int, int] = field(default_factory=dict)  # stage index -> batches its notifs name
    notified_digests: dict[int, dict[str, str]] = field(default_factory=dict)  # stage index -> batch 0's digests
    state: RoomState = RoomState.REQUESTED
    error: str = ""

    @property
    def outcome(self) -> tuple[RoomStatus, str]:
        return self.state.status, self.error


class KVReceiver:
    """The decode side: connects to every prefill stage, asks for rooms, waits for them.

    Parameters
    ----------
    kv_args : KVArgs
        The decode's regions (all layers); under HiSparse see :mod:`.hisparse_direct`.
    backend : TransferBackend
        The engine endpoint; closed by :meth:`close`.
    bootstrap_addresses : list of (str, int)
        One per prefill PP stage.
    timeout_s : float
        Bound of every wait (:meth:`.Deadlines.uniform`), unless ``deadlines`` names each.
    deadlines : Deadlines, optional
        This side's waits: connecting and the handshake, a stage's messages, a room's arrival
        (the default of :meth:`wait`), the threads on close.
    history : int
        Finished rooms whose outcome :meth:`poll` still reports; older ones are forgotten (a
        server's memory stays bounded).
    secret : str, optional
        The deployment's shared secret, presented to every stage (see :class:`~.sender.KVSender`).
    checksums : bool
        Verify every host region of every room against the digest its stage computed before
        sending (:mod:`.integrity`); a mismatch fails the room. On by default.
    completion : str
        How a stage's success is learnt: ``"status"`` or ``"notifications"`` (see the module docstring).

    Raises
    ------
    ManifestMismatchError
        A stage refused the manifest (or this side refuses the stage's); everything opened so far
        is closed again.
    ConnectionError, TimeoutError
        A stage cannot be reached or does not answer in time; likewise cleaned up.
    """

    def __init__(self, kv_args: KVArgs, backend: TransferBackend, bootstrap_addresses: list[tuple[str, int]], *,
                 timeout_s: float = 30.0, deadlines: Deadlines | None = None, history: int = 4096,
                 secret: str | None = None, checksums: bool = True, completion: str = "status") -> None:
        self.notified = one_of(completion, "completion", COMPLETIONS) == "notifications"
        self._rooms: RoomTable[_Arrival] = RoomTable(history)
        self.deadlines = deadlines if deadlines is not None else Deadlines.uniform(timeout_s)
        self.secret = secret
        self.checksums = checksums
        #: This receiver's identity in every notification sent to it (another deployment's never match).
        self.session = uuid.uuid4().hex
        self.kv_args = kv_args
        self.manifest = Manifest.of(kv_args)
        self.backend = backend
        # Guards the rooms; notified when a status arrives or a stage closes.
        self._cond = threading.Condition()
        self._stages: list[_Stage] = []
        self._wakeup = Wakeup()
        backend.register(kv_args.regions())
        try:
            for address in bootstrap_addresses:
                self._stages.append(self._connect(tuple(address)))
        except BaseException:
            self.close()
            raise
        self._stage_of_port = {s.port: i for i, s in enumerate(self._stages)}
        for i, stage in enumerate(self._stages):
            stage.thread = threading.Thread(target=self._read_loop, args=(i,), name="kv-receiver", daemon=True)
            stage.thread.start()

    @property
    def history(self) -> int:
        return self._rooms.history

    def _connect(self, address: tuple[str, int]) -> _Stage:
        ch = Channel.connect(address, self.deadlines.handshake_s)
        try:
            ch.send(Hello(b64(self.backend.descriptor()), self.manifest.to_dict(), self.session, self.checksums,
                          self.secret, self.notified).encode())
            reply = decode(ch.recv(self.deadlines.handshake_s), Welcome, Refused)
            if isinstance(reply, Refused):
                raise ManifestMismatchError(f"sparsekv: prefill stage at {address[0]}:{address[1]} refused this "
                                            f"decode: {reply.error}")
            remote = Manifest.from_dict(reply.manifest)
            check_manifests(remote, self.manifest)
        except ProtocolError as e:
            ch.close()
            raise ManifestMismatchError(f"sparsekv: unexpected handshake reply: {e}") from e
        except BaseException:
            ch.close()
            raise
        # Only the writing side loads the other's descriptor: when both sides connect to each
        # other at once, the engine's two simultaneous connects can reset one another.
        return _Stage(ch, address[1], remote)

    def _read_loop(self, index: int) -> None:
        stage = self._stages[index]
        while True:
            try:
                if not self._wakeup.wait_readable([stage.channel.sock]):
                    break
                message = decode(stage.channel.recv(self.deadlines.message_s), Status, Refused)
            except ProtocolError as e:
                logger.error("prefill stage %d sent a message this side cannot read: %s", stage.port, e)
                continue
            except (PeerClosedError, TimeoutError, ValueError, OSError):
                break
            if isinstance(message, Refused):
                logger.error("prefill stage %d refused a message: %s", stage.port, message.error)
                continue
            with self._cond:
                arrival = self._rooms.get(message.room)
                if arrival is not None and not arrival.state.finished:
                    arrival.statuses[index] = message
                self._cond.notify_all()
        with self._cond:
            stage.closed = True
            self._cond.notify_all()

    @property
    def stage_manifests(self) -> list[Manifest]:
        """Each connected prefill stage's manifest (e.g. to know which layers it sends)."""
        return [s.manifest for s in self._stages]

    def request(self, room: int, kv_indices, state_indices, kv_group_indices: dict[str, list[int]] | None = None
                ) -> None:
        """Ask every stage for room ``room`` into these destinations.

        Parameters
        ----------
        kv_indices : sequence of int
            Destination KV pages, paired with the prefill's source pages.
        state_indices : list of sequences of int
            One destination list per state component.
        kv_group_indices : dict, optional
            Destination indices of one KV region group instead of ``kv_indices`` (group = label
            prefix, e.g. ``"c4_kv"`` -> host pages under HiSparse).

        Raises
        ------
        ValueError
            The number of state lists differs from this side's components.
        PeerClosedError
            A stage is gone.
        """
        if len(state_indices) != len(self.kv_args.state_types):
            raise ValueError(f"sparsekv: {len(self.kv_args.state_types)} state components, got "
                             f"{len(state_indices)} index lists")
        transfer = Transfer(int(room), [int(i) for i in kv_indices], [[int(i) for i in s] for s in state_indices],
                            {k: [int(i) for i in v] for k, v in (kv_group_indices or {}).items()})
        with self._cond:  # a room asked for again is a new transfer: forget what the last one reported
            self._rooms.add(transfer.room, _Arrival(transfer), replace=True)
        message = transfer.encode()
        for stage in self._stages:
            stage.channel.send(message)

    def _drain_notifs(self) -> None:
        notifs = self.backend.get_notifs()
        with self._cond:
            for peer, messages in notifs.items():
                for m in messages:
                    try:
                        notif = Notification.decode(m)
                    except ProtocolError:
                        logger.warning("ignoring an unexpected notification %r from %s", m, peer)
                        continue
                    if notif.session != self.session:
                        logger.warning("ignoring a notification of another session from %s", peer)
                        continue
                    stage = self._stage_of_port.get(notif.port)
                    arrival = self._rooms.get(notif.room)
                    if stage is not None and arrival is not None and not arrival.state.finished:
                        arrival.notifs.setdefault(stage, set()).add(notif.batch)
                        arrival.notified_batches[stage] = notif.batches
                        if notif.digests is not None:
                            arrival.notified_digests[stage] = notif.digests

    def poll(self, room: int) -> tuple[RoomStatus, str]:
        """``(status, error)`` of a requested room, without waiting."""
        self._drain_notifs()
        with self._cond:
            arrival = self._rooms.get(room)
            if arrival is None:
                return RoomStatus.PENDING, ""
            if arrival.state.finished:
                return arrival.outcome
            failure = self._failure(arrival)
            if failure:
                return self._finish(room, arrival, failure)
            if not self._arrived(arrival):
                return RoomStatus.PENDING, ""
            expected = [arrival.statuses[i].digests if i in arrival.statuses else arrival.notified_digests[i]
                        for i in range(len(self._stages))]
        # Every byte is there: hash what arrived outside the lock (the stages' statuses and
        # notifications of other rooms keep coming in meanwhile).
        error = self._verify(arrival.request, expected)
        with self._cond:
            if self._rooms.get(room) is not arrival:  # asked for again meanwhile: a new transfer
                return RoomStatus.PENDING, ""
            if arrival.state.finished:  # another caller's poll finished it meanwhile
                return arrival.outcome
            return self._finish(room, arrival, error)

    def _finish(self, room: int, arrival: _Arrival, error: str) -> tuple[RoomStatus, str]:
        """Record a finished room's outcome: failed with ``error``, else a success (caller holds ``_cond``)."""
        arrival.error = error
        self._rooms.advance(room, RoomState.FAILED if error else RoomState.SUCCESS)
        arrival.statuses.clear()
        arrival.notifs.clear()
        arrival.notified_batches.clear()
        arrival.notified_digests.clear()
        return arrival.outcome

    def _verify(self, request: Transfer, expected_per_stage: list[dict[str, str]]) -> str:
        """Why the received bytes of a room (its destinations ``request``) disagree with its stages'
        digests ("" when they agree or checksums are off)."""
        if not self.checksums:
            return ""
        for i, digests in enumerate(expected_per_stage):
            try:
                expected = {k: int(v, 16) for k, v in digests.items()}
                got = room_digests(self.manifest.components, request.kv_indices, request.kv_group_indices,
                                   request.state_indices, only=set(expected))
            except (IndexError, ValueError, TypeError, AttributeError) as e:
                return f"prefill stage {i}: the received bytes cannot be checked: {e}"
            local_host = {k for k in expected if k in got}
            bad = mismatched({k: expected[k] for k in local_host}, got)
            if bad:
                return (f"prefill stage {i}: {len(bad)} region(s) arrived with other bytes than were sent "
                        f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        return ""

    def _failure(self, arrival: _Arrival) -> str:
        """Why a stage failed the room ("" if none did) (caller holds ``_cond``)."""
        for i, stage in enumerate(self._stages):
            status = arrival.statuses.get(i)
            if status is not None and not status.ok:
                return f"prefill stage {i}: {status.error}"
            if status is None and stage.closed:
                return f"prefill stage {i} closed the connection before room {arrival.request.room} finished"
        return ""

    def _arrived(self, arrival: _Arrival) -> bool:
        """Whether every stage's batches all notified their arrival, and the stage reported success
        (or, with ``completion="notifications"``, batch 0's notification brought the digests)
        (caller holds ``_cond``)."""
        for i in range(len(self._stages)):
            notified = len(arrival.notifs.get(i, ()))
            if i in arrival.statuses:
                if notified < arrival.statuses[i].batches:
                    return False
            elif not (self.notified and i in arrival.notified_digests and notified >= arrival.notified_batches[i]):
                return False
        return True

    def wait(self, room: int, timeout_s: float | None = None) -> None:
        """Wait until room ``room`` has fully arrived (at most ``timeout_s``; default: the arrival deadline).

        Raises
        ------
        TransferError
            A stage reported a failure, went away, or the room did not arrive within the timeout.
        """
        bound = self.deadlines.arrival_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        reported_at = None
        while True:
            status, error = self.poll(room)
            if status == RoomStatus.SUCCESS:
                return
            if status == RoomStatus.FAILED:
                raise TransferError(f"sparsekv: room {room} failed: {error}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"sparsekv: room {room} did not arrive within {bound} s")
            if self.notified:  # only the engine's notifications will say so: poll them
                reported_at = reported_at or time.monotonic()
                poll_pause(reported_at)
                continue
            with self._cond:
                if not self._reported(room):
                    # Block until a stage reports (or goes away) instead of polling the engine: a
                    # polling thread holds the agent lock the engine's progress thread needs, and
                    # on a small machine takes the core the transfer runs on.
                    self._cond.wait(left)
                    continue
            # Every stage reported success; the last notifications land right behind the status.
            reported_at = reported_at or time.monotonic()
            poll_pause(reported_at)

    def _reported(self, room: int) -> bool:
        """Whether every stage has reported on ``room`` or gone away, or another caller's poll
        already saw the room finish (caller holds ``_cond``)."""
        arrival = self._rooms.get(room)
        if arrival is None:
            return False
        return arrival.state.finished or all(i in arrival.statuses or s.closed for i, s in enumerate(self._stages))

    def close(self) -> None:
        """Say goodbye to every stage, close the connections, release the backend (idempotent)."""
        self._wakeup.set()
        for stage in self._stages:
            try:
                stage.channel.send(Bye().encode())
            except PeerClosedError:
                pass
            stage.channel.close()
            if stage.thread is not None:
                stage.thread.join(self.deadlines.close_s)
        self._stages = []
        self._wakeup.close()
        self.backend.close()

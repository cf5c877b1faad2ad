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

A room succeeds only when complete: a stage's success names a batch count the room's plan
allows (at least one batch per memory-kind pair the room writes, at most one per item it
writes), every batch of that count notified its arrival and no other, and (with checksums) a
digest for exactly the host regions the stage sends, each equal to what arrived. A status or
notification that claims less, or names a region the stage does not send, fails the room.

Giving up on a room (:meth:`KVReceiver.cancel`, a :meth:`KVReceiver.wait` that times out,
:meth:`KVReceiver.close`) tells every stage; its destinations may be reused only once
:meth:`KVReceiver.released` says so: every stage answered that none of the room's writes is in
flight or will be posted (a :class:`~.protocol.Cancelled`, or the room's final status), or its
connection ended at least ``deadlines.quarantine_s`` ago (docs/pd.md, "PD trust model").

Lifecycle: ``KVReceiver(kv_args, backend, addresses)`` registers, connects and checks the
manifests (raising :class:`~.manifest.ManifestMismatchError` on both sides); ``close()`` cancels
what is still in flight, says goodbye and releases everything. A stage that closes an idle
connection (it held no room for its ``idle_s``) is connected again for the next room.
"""

from __future__ import annotations

import logging
import re
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
from sparsekv.srt.disaggregation.messages import ProtocolError, new_nonce, proof_matches, secret_proof
from sparsekv.srt.disaggregation.protocol import (
    Bye,
    Cancel,
    Cancelled,
    Challenge,
    Hello,
    Notification,
    Proof,
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


_HEX_DIGEST = re.compile(r"[0-9a-f]{16}")


@dataclass
class _Stage:
    channel: Channel
    address: tuple[str, int]
    manifest: Manifest
    #: ``component/label`` of every host region the stage sends (the digests a room's status must name).
    host_regions: frozenset[str]
    #: Per region the stage sends: its component, its KV group (label prefix) and the memory kinds
    #: of its writes (source, destination): what a room's plan on this stage is made of.
    sends: tuple[tuple[int, str, tuple[str, str]], ...]
    closed: bool = False
    closed_at: float = 0.0  # monotonic() when the connection ended
    idle: bool = False  # the stage closed it after a bye (it held none of this decode's rooms)
    thread: threading.Thread | None = None


@dataclass
class _Arrival:
    """A requested room: its destinations (for the digests) and what each stage said of it."""

    request: Transfer
    statuses: dict[int, Status] = field(default_factory=dict)  # stage index -> its status
    notifs: dict[int, set[int]] = field(default_factory=dict)  # stage index -> batches notified
    notified_batches: dict[int, int] = field(default_factory=dict)  # stage index -> batches its notifs name
    notified_digests: dict[int, dict[str, str]] = field(default_factory=dict)  # stage index -> batch 0's digests
    #: Stage index -> why its notifications of this room cannot be believed (a batch beyond the
    #: count they name, or counts that disagree).
    bad_notifs: dict[int, str] = field(default_factory=dict)
    claims_checked: set[int] = field(default_factory=set)  # stages whose claim of success fits the plan
    cancelled: bool = False  # this side gave up: every stage was asked to write nothing more
    settled: set[int] = field(default_factory=set)  # stages with nothing of the room in flight
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
        (the default of :meth:`wait`), a gone stage's quarantine, the threads on close.
    history : int
        Finished rooms whose outcome :meth:`poll` still reports; older ones are forgotten (a
        server's memory stays bounded).
    secret : str, optional
        The deployment's shared secret: every stage must prove it holds it, and this side proves
        it to them (:mod:`.messages`, "Authentication"); it never crosses the wire. None: stages
        without a secret only.
    checksums : bool
        Verify every host region of every room against the digest its stage computed before
        sending (:mod:`.integrity`); a mismatch fails the room. On by default.
    completion : str
        How a stage's success is learnt: ``"status"`` or ``"notifications"`` (see the module docstring).

    Raises
    ------
    ManifestMismatchError
        A stage refused the manifest or this side's proof (or this side refuses the stage's
        manifest or proof); everything opened so far is closed again.
    ConnectionError, TimeoutError
        A stage cannot be reached or does not answer in time; likewise cleaned up.
    """

    def __init__(self, kv_args: KVArgs, backend: TransferBackend, bootstrap_addresses: list[tuple[str, int]], *,
                 timeout_s: float = 30.0, deadlines: Deadlines | None = None, history: int = 4096,
                 secret: str | None = None, checksums: bool = True, completion: str = "status") -> None:
        self.notified = one_of(completion, "completion", COMPLETIONS) == "notifications"
        self._rooms: RoomTable[_Arrival] = RoomTable(history)
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise ValueError("sparsekv: argument `secret` must be a non-empty string or None")
        self.deadlines = deadlines if deadlines is not None else Deadlines.uniform(timeout_s)
        self.secret = secret
        self.checksums = checksums
        #: This receiver's identity in every notification sent to it (another deployment's never match).
        self.session = uuid.uuid4().hex
        self.kv_args = kv_args
        self.manifest = Manifest.of(kv_args)
        self.backend = backend
        # Guards the rooms and the stages' connections; notified when a status or an
        # acknowledgement arrives or a stage closes.
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
        self._stage_of_port = {s.address[1]: i for i, s in enumerate(self._stages)}
        for i in range(len(self._stages)):
            self._start_reading(i)

    @property
    def history(self) -> int:
        return self._rooms.history

    def _connect(self, address: tuple[str, int]) -> _Stage:
        ch = Channel.connect(address, self.deadlines.handshake_s)
        try:
            challenge = new_nonce() if self.secret is not None else ""
            ch.send(Hello(b64(self.backend.descriptor()), self.manifest.to_dict(), self.session, self.checksums,
                          challenge, self.notified).encode())
            reply = decode(ch.recv(self.deadlines.handshake_s), Challenge, Welcome, Refused)
            if isinstance(reply, Challenge):
                if self.secret is None:
                    raise ManifestMismatchError(f"sparsekv: prefill stage at {address[0]}:{address[1]} asks for a "
                                                "secret this decode was not given")
                if not proof_matches(self.secret, "prefill", challenge, reply.nonce, self.session, reply.proof):
                    raise ManifestMismatchError(f"sparsekv: prefill stage at {address[0]}:{address[1]} did not prove "
                                                "it holds this deployment's secret")
                ch.send(Proof(secret_proof(self.secret, "decode", challenge, reply.nonce, self.session)).encode())
                reply = decode(ch.recv(self.deadlines.handshake_s), Welcome, Refused)
            elif isinstance(reply, Welcome) and self.secret is not None:
                raise ManifestMismatchError(f"sparsekv: prefill stage at {address[0]}:{address[1]} did not prove it "
                                            "holds this deployment's secret (it asked for none)")
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
        host = frozenset(f"{name}/{r.label}" for name, regions in remote.components for r in regions
                         if r.mem_kind == "DRAM")
        sends = tuple((c, r.label.split(":", 1)[0], (r.mem_kind, self.manifest.region_map(c)[r.label].mem_kind))
                      for c, (_, regions) in enumerate(remote.components) for r in regions)
        return _Stage(ch, address, remote, host, sends)

    def _start_reading(self, index: int) -> None:
        stage = self._stages[index]
        stage.thread = threading.Thread(target=self._read_loop, args=(index, stage.channel), name="kv-receiver",
                                        daemon=True)
        stage.thread.start()

    def _read_loop(self, index: int, channel: Channel) -> None:
        stage = self._stages[index]
        idle = False
        while True:
            try:
                if not self._wakeup.wait_readable([channel.sock]):
                    break
                message = decode(channel.recv(self.deadlines.message_s), Status, Cancelled, Refused, Bye)
            except ProtocolError as e:
                logger.error("prefill stage %d sent a message this side cannot read: %s", stage.address[1], e)
                continue
            except (PeerClosedError, TimeoutError, ValueError, OSError):
                break
            if isinstance(message, Refused):
                logger.error("prefill stage %d refused a message: %s", stage.address[1], message.error)
                continue
            if isinstance(message, Bye):  # idle: it holds none of our rooms, and read none it did not answer
                idle = True
                break
            with self._cond:
                arrival = self._rooms.get(message.room)
                if arrival is not None:
                    if isinstance(message, Cancelled):
                        arrival.settled.add(index)
                    elif not arrival.state.finished:
                        arrival.statuses[index] = message
                    if arrival.state.finished and not (isinstance(message, Status) and message.inflight):
                        arrival.settled.add(index)  # a final status: nothing of the room is in flight
                self._cond.notify_all()
        channel.close()
        with self._cond:
            if stage.channel is channel:
                stage.closed, stage.idle, stage.closed_at = True, idle, time.monotonic()
                if idle and any(index not in a.statuses for _, a in self._rooms.live_items()):
                    # A room asked for while the stage decided it was idle: ask again at once.
                    try:
                        self._reconnect_idle(index)
                    except (OSError, ManifestMismatchError, ProtocolError) as e:
                        logger.error("prefill stage %d cannot be reached again: %s", stage.address[1], e)
                        stage.idle = False  # its rooms fail: it is gone
            self._cond.notify_all()

    def _reconnect_idle(self, index: int) -> None:
        """Connect again to a stage that closed an idle connection (caller holds ``_cond``). The stage
        answered every message of ours it read before its bye: a live room it did not answer was
        never read there and is asked for again; a given-up one has nothing there to stop."""
        fresh = self._connect(self._stages[index].address)
        self._stages[index] = fresh
        self._start_reading(index)
        for _, arrival in self._rooms.live_items():
            if index not in arrival.statuses:
                fresh.channel.send(arrival.request.encode())
        for _, arrival in self._rooms.finished_items():
            arrival.settled.add(index)

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
            The number of state lists differs from this side's components, or the room is still
            live (pending, or given up and not yet :meth:`released`).
        PeerClosedError
            A stage is gone.
        """
        if len(state_indices) != len(self.kv_args.state_types):
            raise ValueError(f"sparsekv: {len(self.kv_args.state_types)} state components, got "
                             f"{len(state_indices)} index lists")
        transfer = Transfer(int(room), [int(i) for i in kv_indices], [[int(i) for i in s] for s in state_indices],
                            {k: [int(i) for i in v] for k, v in (kv_group_indices or {}).items()})
        with self._cond:
            old = self._rooms.get(transfer.room)
            if old is not None and not (old.state.finished and self._released(old)):
                raise ValueError(f"sparsekv: room {transfer.room} is still in transfer (or given up and not yet "
                                 "released): it cannot be asked for again yet")
            for i, stage in enumerate(self._stages):
                if stage.closed and stage.idle:
                    self._reconnect_idle(i)
            # A room asked for again is a new transfer: forget what the last one reported.
            self._rooms.add(transfer.room, _Arrival(transfer), replace=True)
            stages = list(self._stages)
        message = transfer.encode()
        for stage in stages:
            try:
                stage.channel.send(message)
            except PeerClosedError:
                if not self._asked_again_after_bye(stage):
                    raise

    def _asked_again_after_bye(self, stage: _Stage) -> bool:
        """A send that failed because the stage's reader closed the channel on the stage's bye
        (after this room was added, before it was sent): the reader then asks every live room
        again on a fresh connection, this one included. False when the stage is gone instead."""
        with self._cond:
            self._cond.wait_for(lambda: stage.closed, self.deadlines.message_s)
            return stage.closed and stage.idle

    def cancel(self, room: int, reason: str = "cancelled by the decode") -> None:
        """Give up on a requested room: it fails with ``reason`` (unless it already finished) and
        every stage is told to write nothing more of it. Its destinations may be reused once
        :meth:`released` says so."""
        with self._cond:
            arrival = self._rooms.get(room)
            if arrival is None:
                return
            if not arrival.state.finished:
                self._finish(room, arrival, f"gave up: {reason}")
            if arrival.cancelled or self._released(arrival):
                return
            arrival.cancelled = True
            stages = [s for i, s in enumerate(self._stages) if i not in arrival.settled]
        for stage in stages:
            try:
                stage.channel.send(Cancel(room).encode())
            except PeerClosedError:  # its end is seen by the stage's reader; quarantine applies
                pass

    def _released(self, arrival: _Arrival) -> bool:
        """Whether no stage can still write into a finished room's destinations (caller holds ``_cond``)."""
        if arrival.state == RoomState.SUCCESS:
            return True
        now = time.monotonic()
        for i, stage in enumerate(self._stages):
            if i in arrival.settled or stage.idle:
                continue
            if not stage.closed or now - stage.closed_at < self.deadlines.quarantine_s:
                return False
        return True

    def released(self, room: int) -> bool:
        """Whether room ``room``'s destinations may be reused: it succeeded, or it failed and every
        stage either said that none of its writes is in flight or will be posted, or closed its
        connection at least ``deadlines.quarantine_s`` ago. An unknown (or forgotten) room: True."""
        with self._cond:
            arrival = self._rooms.get(room)
            return arrival is None or (arrival.state.finished and self._released(arrival))

    def wait_released(self, room: int, timeout_s: float | None = None) -> bool:
        """Wait until :meth:`released` (at most ``timeout_s``; default: the arrival deadline); whether it is."""
        deadline = time.monotonic() + (self.deadlines.arrival_s if timeout_s is None else timeout_s)
        with self._cond:
            while not self.released(room):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # A gone stage's quarantine ends without a message: wake for it too.
                self._cond.wait(min(left, self.deadlines.quarantine_s))
            return True

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
                    if stage is None or arrival is None or arrival.state.finished:
                        continue
                    named = arrival.notified_batches.setdefault(stage, notif.batches)
                    if notif.batch >= notif.batches or notif.batches != named:
                        arrival.bad_notifs[stage] = (f"its notifications name batch {notif.batch} of {notif.batches} "
                                                     f"after naming {named} batches")
                    arrival.notifs.setdefault(stage, set()).add(notif.batch)
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
        # A stage that reported a final status has nothing of the room in flight (unless it says so).
        arrival.settled.update(i for i, status in arrival.statuses.items() if not status.inflight)
        arrival.statuses.clear()
        arrival.notifs.clear()
        arrival.notified_batches.clear()
        arrival.notified_digests.clear()
        self._cond.notify_all()
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

    def _batch_bounds(self, i: int, request: Transfer) -> tuple[int, int]:
        """The fewest and most batches room ``request`` can take on stage ``i``: one per memory-kind
        pair it writes, one per item it writes (each item of each region one write, uncoalesced)."""
        kinds, items = set(), 0
        for c, group, kind in self._stages[i].sends:
            if c == 0:
                n = len(request.kv_group_indices.get(group, request.kv_indices))
            else:
                n = len(request.state_indices[c - 1]) if c - 1 < len(request.state_indices) else 0
            if n:
                kinds.add(kind)
                items += n
        return len(kinds), items

    def _claim_error(self, i: int, request: Transfer, batches: int, digests: dict[str, str]) -> str:
        """Why stage ``i``'s claim of success (its batch count and digests) cannot be the room's
        ("" if it can) (caller holds ``_cond``)."""
        fewest, most = self._batch_bounds(i, request)
        if not fewest <= batches <= most:
            return f"it reported {batches} batches, the room's plan takes {fewest} to {most}"
        expected = self._stages[i].host_regions if self.checksums else frozenset()
        missing, unknown = sorted(expected - digests.keys()), sorted(digests.keys() - expected)
        if missing or unknown:
            return (f"its digests do not cover the regions it sends (missing {missing[:4]}, unknown "
                    f"{[k[:40] for k in unknown[:4]]})")
        malformed = [k for k, v in digests.items() if not _HEX_DIGEST.fullmatch(v)]
        if malformed:
            return f"its digests of {malformed[:4]} are not 16 hex digits"
        return ""

    def _failure(self, arrival: _Arrival) -> str:
        """Why a stage failed the room ("" if none did) (caller holds ``_cond``)."""
        for i, stage in enumerate(self._stages):
            status = arrival.statuses.get(i)
            if status is not None and not status.ok:
                return f"prefill stage {i}: {status.error}"
            if i in arrival.bad_notifs:
                return f"prefill stage {i}: {arrival.bad_notifs[i]}"
            if status is not None:
                named = arrival.notified_batches.get(i, status.batches)
                if named != status.batches:
                    return f"prefill stage {i}: its status reports {status.batches} batches, its notifications {named}"
            if i not in arrival.claims_checked:  # each stage's claim is checked once, as it arrives
                if status is not None:
                    claim = self._claim_error(i, arrival.request, status.batches, status.digests)
                elif self.notified and i in arrival.notified_digests:
                    claim = self._claim_error(i, arrival.request, arrival.notified_batches[i],
                                              arrival.notified_digests[i])
                else:
                    claim = None
                if claim:
                    return f"prefill stage {i}: {claim}"
                if claim is not None:
                    arrival.claims_checked.add(i)
            if status is None and stage.closed:
                return f"prefill stage {i} closed the connection before room {arrival.request.room} finished"
        return ""

    def _arrived(self, arrival: _Arrival) -> bool:
        """Whether every stage's batches all notified their arrival, and the stage reported success
        (or, with ``completion="notifications"``, batch 0's notification brought the digests)
        (caller holds ``_cond``; :meth:`_failure` found nothing wrong)."""
        for i in range(len(self._stages)):
            notified = len(arrival.notifs.get(i, ()))
            if i in arrival.statuses:
                if notified != arrival.statuses[i].batches:
                    return False
            elif not (self.notified and i in arrival.notified_digests and notified == arrival.notified_batches[i]):
                return False
        return True

    def wait(self, room: int, timeout_s: float | None = None) -> None:
        """Wait until room ``room`` has fully arrived (at most ``timeout_s``; default: the arrival deadline).

        A room that does not arrive in time is given up (:meth:`cancel`).

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
                self.cancel(room)  # a stage's failure may leave the others writing: stop them
                raise TransferError(f"sparsekv: room {room} failed: {error}")
            left = deadline - time.monotonic()
            if left <= 0:
                self.cancel(room, f"did not arrive within {bound} s")
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
        """Give up on every room still in flight and wait (at most ``deadlines.close_s``) until no
        stage can write into it, then say goodbye to every stage, close the connections (their
        threads' ends: at most ``deadlines.close_s`` more, all together) and release the backend,
        deregistering its memory (idempotent)."""
        with self._cond:
            live = [room for room, _ in self._rooms.live_items()]
            live += [room for room, arrival in self._rooms.finished_items() if not self._released(arrival)]
        for room in live:
            self.cancel(room, "the decode is closing")
        deadline = time.monotonic() + self.deadlines.close_s
        for room in live:
            if not self.wait_released(room, max(0.0, deadline - time.monotonic())):
                logger.error("room %d: a prefill stage did not confirm it stopped writing within %s s; closing "
                             "anyway (its destinations are deregistered)", room, self.deadlines.close_s)
        self._wakeup.set()
        for stage in self._stages:
            try:
                stage.channel.send(Bye().encode())
            except PeerClosedError:
                pass
            stage.channel.close()
            if stage.thread is not None:
                stage.thread.join(max(0.0, deadline + self.deadlines.close_s - time.monotonic()))
        self._stages = []
        self._wakeup.close()
        self.backend.close()

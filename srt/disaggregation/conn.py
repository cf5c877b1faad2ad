"""``KVSender`` (prefill side) and ``KVReceiver`` (decode side): one request's KV and state, moved.

A *room* is one request's transfer. The prefill scheduler declares where a room's data is
(:meth:`KVSender.add_request`: its KV pages and, per state component, its state indices); the
decode scheduler allocates destinations and asks for the room (:meth:`KVReceiver.request`, sent to
every prefill PP stage). Each stage then

1. plans every write before issuing any (:mod:`.transfer_plan`): KV regions by label through
   ``get_contiguous_buf_infos``, then each state component through its :data:`SENDERS` entry; an
   index-length mismatch, an out-of-range index, a state type with no sender or a TP split the
   state cannot take fails the room here, with nothing written;
2. posts the writes in batches of at most ``max_batch_rows`` rows, ``max_inflight`` at a time,
   each batch carrying the notification ``b"<session>:<stage port>:<room>:<batch>:<batches>"``
   (``session``: the decode's random id from its hello, so no other deployment's notification
   counts);
3. reports the room's status on the bootstrap connection, with a digest of every host region it
   sent when the decode asked for them (:mod:`.integrity`).

The decode side declares a room done when every stage reported success, every batch's
notification arrived (NIXL delivers a batch's notification after its data) *and*, with
``checksums`` (the default), every region's digest equals that of the bytes it received; a
mismatch fails the room naming the regions. Every wait is bounded (``timeout_s``); a peer that
dies mid-transfer fails the room on the other side within it.

Peer input is untrusted (:mod:`.messages`): every message is checked against its schema, a bad
one gets one refusal on its connection and changes nothing else; frames are bounded
(:data:`~.bootstrap.MAX_MESSAGE_BYTES`) and so are the connections a sender serves
(``max_connections``). With a shared ``secret`` the sender serves only decodes that present it.

Lifecycle: ``KVSender(kv_args, backend)`` registers its regions and listens; ``close()`` stops it
and releases every handle and registration. ``KVReceiver(kv_args, backend, addresses)`` registers,
connects and checks the manifests (raising :class:`~.manifest.ManifestMismatchError` on both
sides); ``close()`` likewise.
"""

from __future__ import annotations

import binascii
import logging
import queue
import select
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np

from sparsekv.srt.disaggregation.backend import TransferBackend, TransferError, TransferHandle, poll_pause
from sparsekv.srt.disaggregation.bootstrap import LOOPBACK, Channel, PeerClosedError, b64, listen, unb64
from sparsekv.srt.disaggregation.integrity import mismatched, room_digests, start_room_digests
from sparsekv.srt.disaggregation.kv_args import KVArgs, StateType
from sparsekv.srt.disaggregation.manifest import (
    TP_SHARDED_STATES,
    Manifest,
    ManifestMismatchError,
    Region,
    check_manifests,
)
from sparsekv.srt.disaggregation.messages import (
    ProtocolError,
    op_of,
    parse_hello,
    parse_transfer,
    secret_matches,
)
from sparsekv.srt.disaggregation.transfer_plan import check_index_pairs, plan_transfer

logger = logging.getLogger(__name__)

#: A plan: (source memory kind, destination memory kind) -> write rows (uint64 ``[N, 3]``).
Plan = dict[tuple[str, str], list[np.ndarray]]


class RoomStatus(str, Enum):
    """Where a room's transfer stands."""

    PENDING = "pending"
    SUCCESS = "success"
    FAILED = "failed"


# ---- planning ------------------------------------------------------------------------------------


class RegionPairs(NamedTuple):
    """Local regions matched to the remote regions of the same label, for one memory-kind pair."""

    kinds: tuple[str, str]
    src_ptrs: np.ndarray
    dst_ptrs: np.ndarray
    item_lens: np.ndarray
    src_lens: np.ndarray
    dst_lens: np.ndarray


def pair_regions(local: list[Region], remote: dict[str, Region]) -> list[RegionPairs]:
    """Each ``local`` region with the ``remote`` region of its label, grouped by memory-kind pair.

    Raises
    ------
    ValueError
        A local region without a remote one, or with another item size.
    """
    by_kind: dict[tuple[str, str], list[tuple[Region, Region]]] = {}
    for region in local:
        other = remote.get(region.label)
        if other is None or other.item_len != region.item_len:
            raise ValueError(f"sparsekv: no matching destination region for {region.label!r}")
        by_kind.setdefault((region.mem_kind, other.mem_kind), []).append((region, other))

    def column(pairs, get) -> np.ndarray:
        return np.array([get(a, b) for a, b in pairs], dtype=np.uint64)

    return [RegionPairs(kinds, column(pairs, lambda a, b: a.ptr), column(pairs, lambda a, b: b.ptr),
                        column(pairs, lambda a, b: a.item_len), column(pairs, lambda a, b: a.nbytes),
                        column(pairs, lambda a, b: b.nbytes)) for kinds, pairs in by_kind.items()]


def plan_pairs(plan: Plan, pairs: list[RegionPairs], src_indices, dst_indices, *, coalesce: bool) -> None:
    """Add the writes of ``src_indices -> dst_indices`` over every region pair to ``plan``.

    Raises
    ------
    ValueError
        Index lists of different lengths, or a negative index.
    IndexError
        An index outside a region.
    """
    check_index_pairs(src_indices, dst_indices)
    for p in pairs:
        plan.setdefault(p.kinds, []).append(plan_transfer(p.src_ptrs, p.dst_ptrs, p.item_lens, src_indices,
                                                          dst_indices, src_lens=p.src_lens, dst_lens=p.dst_lens,
                                                          coalesce=coalesce))


@dataclass
class SendContext:
    """What a state sender needs: both manifests, the component's region pairs, the plan to extend."""

    local: Manifest
    remote: Manifest
    pairs: list[RegionPairs]
    plan: Plan
    coalesce: bool

    def generic(self, src_indices, dst_indices) -> None:
        """The generic send of this component (lengths checked first)."""
        plan_pairs(self.plan, self.pairs, src_indices, dst_indices, coalesce=self.coalesce)


def _send_tp_sharded(ctx: SendContext, state_type: StateType, src_indices, dst_indices) -> None:
    if (not ctx.local.is_mla or not ctx.remote.is_mla) and ctx.local.attn_tp_size != ctx.remote.attn_tp_size:
        raise TransferError(f"sparsekv: PD transfer does not support different attention TP sizes (prefill "
                            f"{ctx.local.attn_tp_size}, decode {ctx.remote.attn_tp_size}) for non-MLA "
                            f"{state_type.value.upper()} hybrid models")
    ctx.generic(src_indices, dst_indices)


def _send_replicated(ctx: SendContext, state_type: StateType, src_indices, dst_indices) -> None:
    ctx.generic(src_indices, dst_indices)


def _send_same_tp(ctx: SendContext, state_type: StateType, src_indices, dst_indices) -> None:
    if ctx.local.attn_tp_size != ctx.remote.attn_tp_size:
        raise TransferError(f"sparsekv: PD transfer does not split {state_type.value.upper()} state across "
                            f"attention TP sizes {ctx.local.attn_tp_size} -> {ctx.remote.attn_tp_size}")
    ctx.generic(src_indices, dst_indices)


#: The sender of each state type. SWA (DSV4 included: SWA pages plus the C4 rings on the same
#: SWA page ids) and DSA use the generic send with the TP rule; the request-scoped C128 rings
#: are the same on every TP rank; MAMBA state is sent whole, so TP sizes must match.
SENDERS: dict[StateType, Callable[[SendContext, StateType, object, object], None]] = {
    StateType.SWA: _send_tp_sharded,
    StateType.DSA: _send_tp_sharded,
    StateType.C128_STATE: _send_replicated,
    StateType.MAMBA: _send_same_tp,
}
_UNSENT = (set(StateType) | set(TP_SHARDED_STATES)) - set(SENDERS)
if _UNSENT:  # dispatch must be exhaustive: a state type without a sender would silently stay behind
    raise ImportError(f"sparsekv: state types without a PD sender: {sorted(t.value for t in _UNSENT)}")


class RoomPlanner:
    """Plans rooms from this side's regions into one decode's; pairs regions once per connection.

    A short request's plan is a few numpy calls per region group, so pairing the regions by label
    on every room would cost more than its writes.

    Parameters
    ----------
    local, remote : Manifest
        This (prefill) side's and the decode side's manifests.
    kv_args : KVArgs
        This side's state types (parallel to the state components).
    """

    def __init__(self, local: Manifest, remote: Manifest, kv_args: KVArgs) -> None:
        self.local = local
        self.remote = remote
        self.state_types = [StateType(t) for t in kv_args.state_types]
        # Frozen set of region groups with their own destination indices -> (group or None, pairs).
        self._kv_pairs: dict[frozenset, list[tuple[str | None, list[RegionPairs]]]] = {}
        self._state_pairs: dict[int, list[RegionPairs]] = {}

    def _kv(self, overridden: frozenset) -> list[tuple[str | None, list[RegionPairs]]]:
        if overridden not in self._kv_pairs:
            # The groups without their own list are planned in one go.
            groups: dict[str | None, list[Region]] = {}
            for region in self.local.components[0][1]:
                group = region.label.split(":", 1)[0]
                groups.setdefault(group if group in overridden else None, []).append(region)
            remote_kv = self.remote.region_map(0)
            self._kv_pairs[overridden] = [(g, pair_regions(regions, remote_kv)) for g, regions in groups.items()]
        return self._kv_pairs[overridden]

    def _state(self, component: int) -> list[RegionPairs]:
        if component not in self._state_pairs:
            self._state_pairs[component] = pair_regions(self.local.components[component][1],
                                                         self.remote.region_map(component))
        return self._state_pairs[component]

    def plan(self, src_kv, src_states: list, request: dict, *, coalesce: bool = True) -> Plan:
        """Every write of one room, planned and checked before any is issued.

        Parameters
        ----------
        src_kv, src_states
            The room's source KV pages and per-component state indices.
        request : dict
            The decode's ``transfer`` message: ``kv_indices``, optional ``kv_group_indices`` (a
            region group's own destination indices, e.g. host pages for ``c4_kv`` under HiSparse),
            ``state_indices`` (one list per component).

        Raises
        ------
        ValueError, IndexError
            Index lists of different lengths or out of range; a wrong number of state lists; a
            region without a matching destination region.
        TransferError
            A state type without a sender, or a TP split its sender refuses.
        """
        plan: Plan = {}
        overrides = request.get("kv_group_indices") or {}
        for group, pairs in self._kv(frozenset(overrides)):
            dst = request["kv_indices"] if group is None else overrides[group]
            plan_pairs(plan, pairs, src_kv, dst, coalesce=coalesce)
        dst_states = request.get("state_indices") or []
        if len(dst_states) != len(self.state_types) or len(src_states) != len(self.state_types):
            raise ValueError(f"sparsekv: {len(self.state_types)} state components, but {len(src_states)} source and "
                             f"{len(dst_states)} destination index lists")
        for c, state_type in enumerate(self.state_types):
            sender = SENDERS.get(state_type)
            if sender is None:
                raise TransferError(f"sparsekv: no sender for state type {state_type.value!r}: refusing to "
                                    "transfer a request whose state would be left behind")
            sender(SendContext(self.local, self.remote, self._state(c + 1), plan, coalesce), state_type,
                   src_states[c], dst_states[c])
        return plan


def plan_room(local: Manifest, remote: Manifest, kv_args: KVArgs, src_kv, src_states: list, request: dict, *,
              coalesce: bool = True) -> Plan:
    """One room's plan (:meth:`RoomPlanner.plan` of a planner made for this one room)."""
    return RoomPlanner(local, remote, kv_args).plan(src_kv, src_states, request, coalesce=coalesce)


def plan_batches(plan: Plan, max_batch_rows: int) -> list[tuple[str, str, np.ndarray]]:
    """The plan's rows as batches of at most ``max_batch_rows``, one memory-kind pair each."""
    batches = []
    for (src_kind, dst_kind), parts in plan.items():
        rows = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)
        for start in range(0, rows.shape[0], max_batch_rows):
            batches.append((src_kind, dst_kind, rows[start : start + max_batch_rows]))
    return batches


# ---- prefill side --------------------------------------------------------------------------------


class _Session(NamedTuple):
    """What one decode connection asked for in its hello."""

    id: str  # the decode's session id, echoed in every notification to it
    checksums: bool  # report region digests with each room's status


@dataclass
class _Room:
    kv_indices: np.ndarray
    state_indices: list[np.ndarray]
    on_done: Callable[[int, bool], None] | None
    status: RoomStatus = RoomStatus.PENDING
    claimed: bool = False  # a decode asked for it: it is planned, queued or being written
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class KVSender:
    """The prefill side of one PP stage: listens for decode servers and writes rooms into them.

    Parameters
    ----------
    kv_args : KVArgs
        This stage's regions (:func:`~.kv_args.kv_args_of`).
    backend : TransferBackend
        The engine endpoint; its lifetime becomes the sender's (closed by :meth:`close`).
    host, port : str, int
        Bootstrap address to listen on (port 0: any free port; see :attr:`address`).
    timeout_s : float
        Bound of every wait: a decode's next message, a room's source, a batch's completion.
    max_batch_rows, max_inflight : int
        Writes per posted batch, and batches in flight at once.
    coalesce : bool
        Merge consecutive index runs into single writes.
    progress : callable, optional
        ``progress(room, batches_done, batches)`` after each completed batch.
    close_backend : bool
        Whether :meth:`close` also closes ``backend`` (False when PP stages of one process share
        one engine endpoint, as they should: one agent per process).
    history : int
        Finished rooms remembered for :meth:`status`, :meth:`error` and :meth:`stats`; older ones
        are forgotten (a server's memory stays bounded, and their ids may be declared again).
    secret : str, optional
        The deployment's shared secret: a decode whose hello does not present it is refused
        (constant-time comparison). None serves any decode that can reach the port (README, "PD
        trust model").
    max_connections : int
        Decode connections served at once; one more is refused (one message) and closed.
    """

    def __init__(self, kv_args: KVArgs, backend: TransferBackend, *, host: str = LOOPBACK, port: int = 0,
                 timeout_s: float = 30.0, max_batch_rows: int = 16384, max_inflight: int = 4, coalesce: bool = True,
                 progress: Callable[[int, int, int], None] | None = None, close_backend: bool = True,
                 history: int = 4096, secret: str | None = None, max_connections: int = 64) -> None:
        if max_batch_rows < 1 or max_inflight < 1 or history < 1 or max_connections < 1:
            raise ValueError("sparsekv: arguments `max_batch_rows`, `max_inflight`, `history` and `max_connections` "
                             "must be >= 1")
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise ValueError("sparsekv: argument `secret` must be a non-empty string or None")
        self.secret = secret
        self.max_connections = max_connections
        self.kv_args = kv_args
        self.manifest = Manifest.of(kv_args)
        self.backend = backend
        self.timeout_s = timeout_s
        self.max_batch_rows = max_batch_rows
        self.max_inflight = max_inflight
        self.coalesce = coalesce
        self.progress = progress
        self.close_backend = close_backend
        #: Why each refused decode connection was refused, in order.
        self.refusals: list[str] = []
        self._rooms: dict[int, _Room] = {}
        self.history = history
        self._finished: deque[int] = deque()  # finished rooms, oldest first
        self._cond = threading.Condition()
        self._closing = False
        backend.register(kv_args.regions())
        self._listener = listen(host, port)
        self.address: tuple[str, int] = self._listener.getsockname()
        self._threads: list[threading.Thread] = []
        self._channels: list[Channel] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kv-sender-accept", daemon=True)
        self._accept_thread.start()

    # ---- scheduler API ----

    def add_request(self, room: int, kv_indices, state_indices, on_done: Callable[[int, bool], None] | None = None
                    ) -> None:
        """Declare where room ``room``'s data is: KV pages and one index list per state component.

        ``on_done(room, ok)`` runs once the room succeeded or failed (e.g. to free its pages), on
        one of the sender's threads: senders (PP stages) that share a callback may call it at
        the same time, so it must be thread-safe. An exception it raises is logged; it never
        ends the decode's connection nor keeps the room's status from the decode.

        Raises
        ------
        ValueError
            The room is already declared, or the number of state lists is wrong.
        """
        if len(state_indices) != len(self.kv_args.state_types):
            raise ValueError(f"sparsekv: {len(self.kv_args.state_types)} state components, got "
                             f"{len(state_indices)} index lists")
        with self._cond:
            if room in self._rooms:
                raise ValueError(f"sparsekv: room {room} is already declared")
            self._rooms[room] = _Room(np.asarray(kv_indices, dtype=np.int64),
                                      [np.asarray(s, dtype=np.int64) for s in state_indices], on_done)
            self._cond.notify_all()

    def status(self, room: int) -> RoomStatus:
        """The room's status (``PENDING`` also for an unknown room)."""
        with self._cond:
            r = self._rooms.get(room)
            return r.status if r is not None else RoomStatus.PENDING

    def error(self, room: int) -> str:
        """Why the room failed ("" otherwise)."""
        with self._cond:
            r = self._rooms.get(room)
            return r.error if r is not None else ""

    def stats(self, room: int) -> tuple[int, float]:
        """``(bytes written, seconds from first post to last completion)`` of a finished room.

        Raises
        ------
        KeyError
            An unknown room, or one beyond the ``history`` of finished rooms.
        """
        with self._cond:
            r = self._rooms[room]
            return r.nbytes, r.seconds

    def abort(self, room: int, reason: str) -> None:
        """Fail a declared room that is still pending (e.g. its decode never asked for it in time);
        its ``on_done`` runs. A room already finished is left as it is."""
        with self._cond:
            if room not in self._rooms:
                return
        self._finish(room, RoomStatus.FAILED, reason)

    def wait(self, room: int, timeout_s: float | None = None) -> RoomStatus:
        """Wait until the room is no longer pending, at most ``timeout_s`` (default: the sender's)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self.status(room) == RoomStatus.PENDING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self.status(room)

    def close(self) -> None:
        """Stop listening, drop every connection, release every handle and registration (idempotent)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._listener.close()
        for ch in list(self._channels):
            ch.close()
        for t in [self._accept_thread, *self._threads]:
            t.join(self.timeout_s)
        if self.close_backend:
            self.backend.close()

    # ---- connections ----

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.1)
                if not readable:
                    continue
                sock, _ = self._listener.accept()
            except (OSError, ValueError):
                return
            ch = Channel(sock)
            self._channels = [c for c in self._channels if not c.closed]
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._channels) >= self.max_connections:
                self._refuse(ch, f"sparsekv: this prefill serves at most {self.max_connections} decode connections")
                continue
            self._channels.append(ch)
            t = threading.Thread(target=self._serve, args=(ch,), name="kv-sender-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _refuse(self, ch: Channel, error: str) -> None:
        """Refuse a decode connection: one ``refused`` message, then close it."""
        self.refusals.append(error)
        logger.error("refusing a decode connection: %s", error)
        try:
            ch.send({"op": "refused", "error": error})
        except PeerClosedError:
            pass
        ch.close()

    def _finish(self, room: int, status: RoomStatus, error: str = "") -> None:
        with self._cond:
            r = self._rooms[room]
            if r.status != RoomStatus.PENDING:
                return
            r.status, r.error = status, error
            self._finished.append(room)
            while len(self._finished) > self.history:
                del self._rooms[self._finished.popleft()]
            callback = r.on_done
            self._cond.notify_all()
        if callback is not None:
            try:
                callback(room, status == RoomStatus.SUCCESS)
            except Exception:  # the scheduler's bug: the connection still serves the other rooms
                logger.exception("on_done of room %d raised", room)

    def _next_message(self, ch: Channel, hangup: threading.Event) -> dict | None:
        """The decode's next message; None once it hung up (``hangup`` is then set) or the sender
        closes. A frame that is whole but not a JSON object is refused (one message) and skipped; a
        frame over the size bound ends the connection, after a refusal (the stream cannot be
        trusted past it)."""
        while not self._closing:
            try:
                readable, _, _ = select.select([ch.sock], [], [], 0.1)
            except (OSError, ValueError):
                return None
            if readable:
                try:
                    return ch.recv(self.timeout_s)
                except ProtocolError as e:
                    self._send_refusal(ch, str(e))
                    continue
                except ValueError as e:
                    self._send_refusal(ch, str(e))
                    return None
                except (PeerClosedError, TimeoutError):
                    hangup.set()
                    return None
        return None

    def _send_refusal(self, ch: Channel, error: str, room: int | None = None) -> None:
        """One message telling the decode a message of its was refused (a room's status when it named one)."""
        logger.error("refusing a decode message: %s", error)
        message = {"op": "refused", "error": error} if room is None else \
            {"op": "status", "room": room, "ok": False, "error": error}
        try:
            ch.send(message)
        except PeerClosedError:
            pass

    def _serve(self, ch: Channel) -> None:
        peer = None
        try:
            hello_message = ch.recv(self.timeout_s)
            if op_of(hello_message) != "hello":
                raise ProtocolError(f"sparsekv: expected a hello, got {hello_message.get('op')!r:.80}")
            hello = parse_hello(hello_message)
            if not secret_matches(self.secret, hello.secret):
                raise ProtocolError("sparsekv: the decode did not present this deployment's secret")
            remote = Manifest.from_dict(hello.manifest)
            check_manifests(self.manifest, remote)
            descriptor = unb64(hello.agent)
        except (ManifestMismatchError, ValueError, binascii.Error, TypeError, KeyError, AttributeError) as e:
            self._refuse(ch, str(e))  # a malformed hello (ProtocolError), manifest or descriptor
            return
        except (PeerClosedError, TimeoutError) as e:
            logger.error("decode connection failed during the handshake: %s", e)
            ch.close()
            return
        try:
            peer = self.backend.connect(descriptor)
        except Exception as e:  # a peer's descriptor is untrusted input: any engine error refuses it
            self._refuse(ch, f"sparsekv: the decode's engine descriptor was refused: {type(e).__name__}: {e}")
            return
        try:
            ch.send({"op": "welcome", "agent": b64(self.backend.descriptor()), "manifest": self.manifest.to_dict()})
            planner = RoomPlanner(self.manifest, remote, self.kv_args)
            session = _Session(hello.session, hello.checksums)
            # Two stages: this thread reads and plans the next room while the poster thread's
            # writes of the previous one run (the engine releases the GIL while it copies). This
            # thread is the connection's only reader: it tells the poster, through `hangup`, that
            # the decode went away. (A poster that peeked at the socket itself could find the byte
            # select() saw already read by this thread, and its peek then blocked for the socket's
            # timeout and read as a hangup: a 30 s stall that failed a healthy room.)
            posts: queue.Queue = queue.Queue()
            hangup = threading.Event()
            poster = threading.Thread(target=self._post_loop, args=(ch, peer, posts, session, hangup),
                                      name="kv-sender-post", daemon=True)
            poster.start()
            try:
                while poster.is_alive() and (message := self._next_message(ch, hangup)) is not None:
                    op = message.get("op")
                    if op == "transfer":
                        if (prepared := self._prepare(ch, planner, message, session)) is not None:
                            posts.put(prepared)
                    elif op == "bye":  # the decode waits for nothing more
                        hangup.set()
                        break
                    else:
                        self._send_refusal(ch, f"sparsekv: unknown bootstrap op {op!r:.80}")
            finally:
                posts.put(None)
                poster.join()
        except (PeerClosedError, TransferError) as e:
            logger.error("decode connection lost: %s", e)
        finally:
            ch.close()
            if peer is not None:
                try:
                    self.backend.disconnect(peer)
                except Exception as e:  # the engine may already have dropped a dead peer
                    logger.warning("could not disconnect %s: %s", peer, e)

    def _wait_source(self, room: int) -> _Room | None:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while room not in self._rooms and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._rooms.get(room)

    def _prepare(self, ch: Channel, planner: RoomPlanner, message: dict,
                 session: _Session) -> tuple[int, _Room, Plan, Callable[[], dict[str, int]]] | None:
        """The room a ``transfer`` message asks for, claimed, planned and (when the decode asked)
        its digests started; None if refused (the decode was told why, nothing else changed)."""
        try:
            request = parse_transfer(message)
        except ProtocolError as e:
            room = message.get("room")  # a refusal names the room only when the room itself is valid
            self._send_refusal(ch, str(e), room if type(room) is int and 0 <= room < 1 << 63 else None)  # noqa: E721
            return None
        room = request.room
        source = self._wait_source(room)
        if source is None:
            ch.send({"op": "status", "room": room, "ok": False,
                     "error": f"sparsekv: prefill has no room {room} (not declared within {self.timeout_s} s)"})
            return None
        with self._cond:
            state = source.status.value if source.status != RoomStatus.PENDING else "in transfer"
            claimed, source.claimed = source.claimed or source.status != RoomStatus.PENDING, True
        if claimed:
            ch.send({"op": "status", "room": room, "ok": False, "error": f"sparsekv: room {room} is already {state}"})
            return None
        try:
            plan = planner.plan(source.kv_indices, source.state_indices, request._asdict(), coalesce=self.coalesce)
            # A large room is hashed on the digest threads while this thread reads on and the
            # poster writes the rooms before it; the poster waits for its digests before its first
            # write of the room.
            digests = start_room_digests(self.manifest.components, source.kv_indices, {}, source.state_indices) \
                if session.checksums else lambda: {}
            return room, source, plan, digests
        except (ValueError, IndexError, TypeError, TransferError) as e:
            self._fail(ch, room, f"sparsekv: room {room} refused before any write: {e}")
            return None

    def _post_loop(self, ch: Channel, peer: str, posts: queue.Queue, session: _Session,
                   hangup: threading.Event) -> None:
        """Write the planned rooms in order; after a failed transfer fail the rest and stop."""
        lost = ""
        while (item := posts.get()) is not None:
            room, source, plan, digests = item
            if lost:
                self._fail(ch, room, f"sparsekv: room {room} not sent: {lost}")
                continue
            try:
                # What the source holds before anything is sent (a source changed after this,
                # e.g. a page reused too early, then fails the room on the decode).
                hexdigests = {k: f"{v:016x}" for k, v in digests().items()}
            except (IndexError, ValueError) as e:  # the plan checked every index: not expected
                self._fail(ch, room, f"sparsekv: room {room} refused before any write: its source cannot be "
                                     f"digested: {e}")
                continue
            try:
                batches, nbytes, seconds = self._write(peer, room, plan, session, hangup)
            except TransferError as e:
                self._fail(ch, room, str(e))
                lost = str(e)
                ch.close()  # the serving thread stops reading, the decode sees the connection end
                continue
            with self._cond:
                source.nbytes, source.seconds = nbytes, seconds
            self._finish(room, RoomStatus.SUCCESS)
            try:
                ch.send({"op": "status", "room": room, "ok": True, "batches": batches, "bytes": nbytes,
                         "digests": hexdigests})
            except PeerClosedError as e:
                lost = str(e)

    def _fail(self, ch: Channel, room: int, error: str) -> None:
        logger.error("%s", error)
        self._finish(room, RoomStatus.FAILED, error)
        try:
            ch.send({"op": "status", "room": room, "ok": False, "error": error})
        except PeerClosedError:
            pass

    def _write(self, peer: str, room: int, plan: Plan, session: _Session,
               hangup: threading.Event) -> tuple[int, int, float]:
        batches = plan_batches(plan, self.max_batch_rows)
        n = len(batches)
        nbytes = int(sum(int(rows[:, 2].sum()) for _, _, rows in batches))
        if n == 0:
            return 0, 0, 0.0
        deadline = time.monotonic() + self.timeout_s
        start = time.perf_counter()
        inflight: list[TransferHandle] = []
        done = 0
        try:
            for i, (src_kind, dst_kind, rows) in enumerate(batches):
                while len(inflight) >= self.max_inflight:
                    self._wait_one(hangup, inflight.pop(0), deadline)
                    done += 1
                    if self.progress is not None:
                        self.progress(room, done, n)
                inflight.append(self.backend.write(peer, rows, src_kind=src_kind, dst_kind=dst_kind,
                                                   notif=f"{session.id}:{self.address[1]}:{room}:{i}:{n}".encode()))
            while inflight:
                self._wait_one(hangup, inflight.pop(0), deadline)
                done += 1
                if self.progress is not None:
                    self.progress(room, done, n)
        except TransferError as e:
            raise TransferError(f"sparsekv: room {room}: transfer failed after {done}/{n} batches: {e}") from e
        finally:
            for handle in inflight:  # aborted: cancel what is still posted
                handle.release()
        return n, nbytes, time.perf_counter() - start

    def _wait_one(self, hangup: threading.Event, handle: TransferHandle, deadline: float) -> None:
        since = time.monotonic()
        try:
            while True:
                state = handle.status()
                if state == "DONE":
                    return
                if state == "ERR":
                    raise TransferError("the transfer engine reported a failed write")
                if hangup.is_set():
                    raise TransferError("the decode side went away mid-transfer")
                if self._closing:
                    raise TransferError("the sender is closing")
                if time.monotonic() > deadline:
                    raise TransferError(f"writes did not complete within {self.timeout_s} s")
                poll_pause(since)
        finally:
            handle.release()


# ---- decode side ---------------------------------------------------------------------------------


@dataclass
class _Stage:
    channel: Channel
    port: int
    manifest: Manifest
    statuses: dict[int, dict] = field(default_factory=dict)
    notifs: dict[int, set[int]] = field(default_factory=dict)
    closed: bool = False
    thread: threading.Thread | None = None


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
        Bound of every wait (connecting, the handshake; the default of :meth:`wait`).
    history : int
        Finished rooms whose outcome :meth:`poll` still reports; older ones are forgotten (a
        server's memory stays bounded).
    secret : str, optional
        The deployment's shared secret, presented to every stage (see :class:`KVSender`).
    checksums : bool
        Verify every host region of every room against the digest its stage computed before
        sending (:mod:`.integrity`); a mismatch fails the room. On by default.

    Raises
    ------
    ManifestMismatchError
        A stage refused the manifest (or this side refuses the stage's); everything opened so far
        is closed again.
    ConnectionError, TimeoutError
        A stage cannot be reached or does not answer in time; likewise cleaned up.
    """

    def __init__(self, kv_args: KVArgs, backend: TransferBackend, bootstrap_addresses: list[tuple[str, int]], *,
                 timeout_s: float = 30.0, history: int = 4096, secret: str | None = None,
                 checksums: bool = True) -> None:
        if history < 1:
            raise ValueError(f"sparsekv: argument `history` must be >= 1, got {history}")
        self.secret = secret
        self.checksums = checksums
        #: This receiver's identity in every notification sent to it (another deployment's never match).
        self.session = uuid.uuid4().hex
        # Destination indices of each requested room, for its digests: (kv, kv groups, states).
        self._requested: dict[int, tuple[list[int], dict[str, list[int]], list[list[int]]]] = {}
        self.kv_args = kv_args
        self.manifest = Manifest.of(kv_args)
        self.backend = backend
        self.timeout_s = timeout_s
        # Guards the stages' statuses; notified when a status arrives or a stage closes.
        self._cond = threading.Condition()
        self._stages: list[_Stage] = []
        self.history = history
        self._finished: OrderedDict[int, tuple[RoomStatus, str]] = OrderedDict()  # oldest first
        backend.register(kv_args.regions())
        try:
            for address in bootstrap_addresses:
                self._stages.append(self._connect(tuple(address)))
        except BaseException:
            self.close()
            raise
        for stage in self._stages:
            stage.thread = threading.Thread(target=self._read_loop, args=(stage,), name="kv-receiver", daemon=True)
            stage.thread.start()

    def _connect(self, address: tuple[str, int]) -> _Stage:
        ch = Channel.connect(address, self.timeout_s)
        try:
            hello = {"op": "hello", "agent": b64(self.backend.descriptor()), "manifest": self.manifest.to_dict(),
                     "session": self.session, "checksums": self.checksums}
            if self.secret is not None:
                hello["secret"] = self.secret
            ch.send(hello)
            reply = ch.recv(self.timeout_s)
            if reply.get("op") == "refused":
                raise ManifestMismatchError(f"sparsekv: prefill stage at {address[0]}:{address[1]} refused this "
                                            f"decode: {reply.get('error')}")
            if reply.get("op") != "welcome":
                raise ManifestMismatchError(f"sparsekv: unexpected handshake reply {reply.get('op')!r}")
            remote = Manifest.from_dict(reply.get("manifest", {}))
            check_manifests(remote, self.manifest)
        except BaseException:
            ch.close()
            raise
        # Only the writing side loads the other's descriptor: when both sides connect to each
        # other at once, the engine's two simultaneous connects can reset one another.
        return _Stage(ch, address[1], remote)

    def _read_loop(self, stage: _Stage) -> None:
        while not stage.channel.closed:
            try:
                readable, _, _ = select.select([stage.channel.sock], [], [], 0.1)
                if not readable:
                    continue
                message = stage.channel.recv(self.timeout_s)
            except (PeerClosedError, TimeoutError, ValueError, OSError):
                break
            room = message.get("room")
            if message.get("op") == "status" and type(room) is int:  # noqa: E721
                with self._cond:
                    if room not in self._finished:
                        stage.statuses[room] = message
                    self._cond.notify_all()
            elif message.get("op") == "refused":
                logger.error("prefill stage %d refused a message: %s", stage.port, message.get("error"))
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
        message = {"op": "transfer", "room": int(room), "kv_indices": [int(i) for i in kv_indices],
                   "state_indices": [[int(i) for i in s] for s in state_indices],
                   "kv_group_indices": {k: [int(i) for i in v] for k, v in (kv_group_indices or {}).items()}}
        with self._cond:  # a room asked for again is a new transfer: forget what the last one reported
            self._requested[int(room)] = (message["kv_indices"], message["kv_group_indices"],
                                          message["state_indices"])
            self._finished.pop(int(room), None)
            for stage in self._stages:
                stage.statuses.pop(int(room), None)
                stage.notifs.pop(int(room), None)
        for stage in self._stages:
            stage.channel.send(message)

    def _drain_notifs(self) -> None:
        by_port = {s.port: s for s in self._stages}
        notifs = self.backend.get_notifs()
        with self._cond:
            for peer, messages in notifs.items():
                for m in messages:
                    try:
                        session, *fields = m.decode().split(":")
                        port, room, batch, _ = (int(x) for x in fields)
                    except ValueError:
                        logger.warning("ignoring an unexpected notification %r from %s", m, peer)
                        continue
                    if session != self.session:
                        logger.warning("ignoring a notification of another session from %s", peer)
                        continue
                    stage = by_port.get(port)
                    if stage is not None and room not in self._finished:  # late ones of a failed room
                        stage.notifs.setdefault(room, set()).add(batch)

    def poll(self, room: int) -> tuple[RoomStatus, str]:
        """``(status, error)`` of a requested room, without waiting."""
        self._drain_notifs()
        with self._cond:
            if room in self._finished:
                return self._finished[room]
            outcome = self._outcome(room)
            if outcome is not None:
                return self._keep(room, outcome) if outcome[0] != RoomStatus.PENDING else outcome
            request = self._requested.get(room)
            expected = [s.statuses[room].get("digests") for s in self._stages]
        # Every byte is there: hash what arrived outside the lock (the stages' statuses and
        # notifications of other rooms keep coming in meanwhile).
        error = self._verify(request, expected)
        with self._cond:
            if room in self._finished:  # another caller's poll finished it meanwhile
                return self._finished[room]
            if self._requested.get(room) is not request:  # asked for again meanwhile: a new transfer
                return RoomStatus.PENDING, ""
            return self._keep(room, (RoomStatus.FAILED, error) if error else (RoomStatus.SUCCESS, ""))

    def _keep(self, room: int, outcome: tuple[RoomStatus, str]) -> tuple[RoomStatus, str]:
        """Record a finished room's outcome and drop its bookkeeping (caller holds ``_cond``)."""
        self._finished[room] = outcome
        while len(self._finished) > self.history:
            self._finished.popitem(last=False)
        for stage in self._stages:
            stage.statuses.pop(room, None)
            stage.notifs.pop(room, None)
        self._requested.pop(room, None)
        return outcome

    def _verify(self, request: tuple | None, expected_per_stage: list) -> str:
        """Why the received bytes of a room (its destination indices ``request``) disagree with its
        stages' digests ("" when they agree or checksums are off)."""
        if not self.checksums or request is None:
            return ""
        kv, groups, states = request
        for i, digests in enumerate(expected_per_stage):
            try:
                expected = {str(k): int(v, 16) for k, v in (digests or {}).items()}
                got = room_digests(self.manifest.components, kv, groups, states, only=set(expected))
            except (IndexError, ValueError, TypeError, AttributeError) as e:
                return f"prefill stage {i}: the received bytes cannot be checked: {e}"
            local_host = {k for k in expected if k in got}
            bad = mismatched({k: expected[k] for k in local_host}, got)
            if bad:
                return (f"prefill stage {i}: {len(bad)} region(s) arrived with other bytes than were sent "
                        f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        return ""

    def _outcome(self, room: int) -> tuple[RoomStatus, str] | None:
        """What the stages' statuses and notifications say of ``room``: failed, pending, or None
        when every stage reported success and every notification arrived (caller holds ``_cond``)."""
        done = True
        for i, stage in enumerate(self._stages):
            status = stage.statuses.get(room)
            if status is not None and not status.get("ok"):
                return RoomStatus.FAILED, f"prefill stage {i}: {status.get('error')}"
            if status is None:
                if stage.closed:
                    return RoomStatus.FAILED, f"prefill stage {i} closed the connection before room {room} finished"
                done = False
            elif len(stage.notifs.get(room, ())) < int(status.get("batches", 0)):
                done = False
        return None if done else (RoomStatus.PENDING, "")

    def wait(self, room: int, timeout_s: float | None = None) -> None:
        """Wait until room ``room`` has fully arrived.

        Raises
        ------
        TransferError
            A stage reported a failure, went away, or the room did not arrive within the timeout.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        reported_at = None
        while True:
            status, error = self.poll(room)
            if status == RoomStatus.SUCCESS:
                return
            if status == RoomStatus.FAILED:
                raise TransferError(f"sparsekv: room {room} failed: {error}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(f"sparsekv: room {room} did not arrive within {timeout_s or self.timeout_s} s")
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
        return room in self._finished or all(room in s.statuses or s.closed for s in self._stages)

    def close(self) -> None:
        """Say goodbye to every stage, close the connections, release the backend (idempotent)."""
        for stage in self._stages:
            try:
                stage.channel.send({"op": "bye"})
            except PeerClosedError:
                pass
            stage.channel.close()
            if stage.thread is not None:
                stage.thread.join(self.timeout_s)
        self._stages = []
        self.backend.close()

"""``KVSender``: the prefill side of one PP stage, which writes rooms into the decodes that ask.

The prefill scheduler declares where a room's data is (:meth:`KVSender.add_request`: its KV pages
and, per state component, its state indices); a decode asks for the room (a :class:`~.protocol.Transfer`
on its bootstrap connection). The sender then

1. plans every write before issuing any (:mod:`.planning`);
2. posts the writes in batches of at most ``max_batch_rows`` rows, ``max_inflight`` at a time,
   each batch carrying a :class:`~.protocol.Notification` that the engine delivers after its data;
3. reports the room's :class:`~.protocol.Status` on the bootstrap connection, with a digest of
   every host region it sent when the decode asked for them (:mod:`.integrity`); to a decode that
   completes rooms from their notifications (``completion="notifications"``) only a failure, the
   digests riding on batch 0's notification instead.

Per decode connection one thread reads and plans the next room while another posts the writes,
``max_inflight`` batches at a time across rooms (the next room's first batches go out while the
last ones of the room before it still land).

Peer input is untrusted (:mod:`.protocol`): a bad message gets one refusal on its connection and
changes nothing else; frames are bounded (:data:`~.bootstrap.MAX_MESSAGE_BYTES`) and so are the
connections served at once (``max_connections``). With a shared ``secret`` the sender serves only
decodes that present it. A connection that ends is forgotten at once.

Lifecycle: ``KVSender(kv_args, backend)`` registers its regions and listens; ``close()`` stops it
and releases every handle and registration.
"""

from __future__ import annotations

import binascii
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sparsekv.srt.disaggregation.backend import SPIN_S, TransferBackend, TransferError, TransferHandle, poll_pause
from sparsekv.srt.disaggregation.bootstrap import LOOPBACK, Channel, PeerClosedError, Wakeup, b64, listen, unb64
from sparsekv.srt.disaggregation.deadlines import Deadlines
from sparsekv.srt.disaggregation.integrity import start_room_digests
from sparsekv.srt.disaggregation.kv_args import KVArgs
from sparsekv.srt.disaggregation.manifest import Manifest, ManifestMismatchError, check_manifests
from sparsekv.srt.disaggregation.messages import ProtocolError, secret_matches
from sparsekv.srt.disaggregation.planning import Plan, RoomPlanner, plan_batches
from sparsekv.srt.disaggregation.protocol import (
    Bye,
    Hello,
    Message,
    Notification,
    Refused,
    Status,
    Transfer,
    Welcome,
    decode,
)
from sparsekv.srt.disaggregation.room import RoomState, RoomStatus, RoomTable

logger = logging.getLogger(__name__)


class _Session(NamedTuple):
    """What one decode connection asked for in its hello."""

    id: str  # the decode's session id, echoed in every notification to it
    checksums: bool  # report region digests with each room's status
    notified: bool  # the decode completes rooms from their notifications: no success status


@dataclass
class _Posting:
    """A claimed, planned room on its way out: its batches, how many are posted and landed."""

    room: int
    source: _Source
    batches: list[tuple[str, str, np.ndarray]]
    hexdigests: dict[str, str]
    nbytes: int
    posted: int = 0
    done: int = 0
    start: float = 0.0  # perf_counter() at the first post
    deadline: float = 0.0  # monotonic() by which every batch must have landed


@dataclass
class _Source:
    """A declared room: where its data is, and what became of it."""

    kv_indices: np.ndarray
    state_indices: list[np.ndarray]
    on_done: Callable[[int, bool], None] | None
    state: RoomState = RoomState.DECLARED
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


class KVSender:
    """The prefill side of one PP stage: listens for decode servers and writes rooms into them.

    Parameters
    ----------
    kv_args : KVArgs
        This stage's regions (:func:`~.state_routing.kv_args_of`).
    backend : TransferBackend
        The engine endpoint; its lifetime becomes the sender's (closed by :meth:`close`).
    host, port : str, int
        Bootstrap address to listen on (port 0: any free port; see :attr:`address`).
    timeout_s : float
        Bound of every wait (:meth:`.Deadlines.uniform`), unless ``deadlines`` names each.
    deadlines : Deadlines, optional
        This side's waits: a decode's hello and its messages, a room's source, a room's writes,
        the threads on close.
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
        (constant-time comparison). None serves any decode that can reach the port (docs/pd.md, "PD
        trust model").
    max_connections : int
        Decode connections served at once; one more is refused (one message) and closed.
    """

    def __init__(self, kv_args: KVArgs, backend: TransferBackend, *, host: str = LOOPBACK, port: int = 0,
                 timeout_s: float = 30.0, deadlines: Deadlines | None = None, max_batch_rows: int = 16384,
                 max_inflight: int = 4, coalesce: bool = True, progress: Callable[[int, int, int], None] | None = None,
                 close_backend: bool = True, history: int = 4096, secret: str | None = None,
                 max_connections: int = 64) -> None:
        if max_batch_rows < 1 or max_inflight < 1 or history < 1 or max_connections < 1:
            raise ValueError("sparsekv: arguments `max_batch_rows`, `max_inflight`, `history` and `max_connections` "
                             "must be >= 1")
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise ValueError("sparsekv: argument `secret` must be a non-empty string or None")
        self.deadlines = deadlines if deadlines is not None else Deadlines.uniform(timeout_s)
        self.secret = secret
        self.max_connections = max_connections
        self.kv_args = kv_args
        self.manifest = Manifest.of(kv_args)
        self.backend = backend
        self.max_batch_rows = max_batch_rows
        self.max_inflight = max_inflight
        self.coalesce = coalesce
        self.progress = progress
        self.close_backend = close_backend
        #: Why each refused decode connection was refused, in order.
        self.refusals: list[str] = []
        self._rooms: RoomTable[_Source] = RoomTable(history)
        # Guards the rooms and the connections; notified when a room is declared or finishes and
        # when a connection ends.
        self._cond = threading.Condition()
        self._connections: dict[Channel, threading.Thread] = {}
        self._wakeup = Wakeup()
        backend.register(kv_args.regions())
        self._listener = listen(host, port)
        self.address: tuple[str, int] = self._listener.getsockname()
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
            self._rooms.add(room, _Source(np.asarray(kv_indices, dtype=np.int64),
                                          [np.asarray(s, dtype=np.int64) for s in state_indices], on_done))
            self._cond.notify_all()

    def status(self, room: int) -> RoomStatus:
        """The room's status (``PENDING`` also for an unknown room)."""
        with self._cond:
            r = self._rooms.get(room)
            return r.state.status if r is not None else RoomStatus.PENDING

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
            r = self._rooms.get(room)
            if r is None:
                raise KeyError(room)
            return r.nbytes, r.seconds

    def abort(self, room: int, reason: str) -> None:
        """Fail a declared room that is still pending (e.g. its decode never asked for it in time);
        its ``on_done`` runs. A room already finished is left as it is."""
        self._finish(room, RoomState.FAILED, reason)

    def wait(self, room: int, timeout_s: float | None = None) -> RoomStatus:
        """Wait until the room is no longer pending, at most ``timeout_s`` (default: the writes' deadline)."""
        deadline = time.monotonic() + (self.deadlines.write_s if timeout_s is None else timeout_s)
        with self._cond:
            while self.status(room) == RoomStatus.PENDING:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self.status(room)

    @property
    def connections(self) -> int:
        """Decode connections being served now (one that ended is forgotten at once)."""
        with self._cond:
            return len(self._connections)

    def close(self) -> None:
        """Stop listening, drop every connection, release every handle and registration (idempotent)."""
        with self._cond:
            if self._wakeup.is_set:
                return
            self._wakeup.set()
            self._cond.notify_all()
            connections = dict(self._connections)
        self._listener.close()
        for ch in connections:
            ch.close()
        for t in [self._accept_thread, *connections.values()]:
            t.join(self.deadlines.close_s)
        self._wakeup.close()
        if self.close_backend:
            self.backend.close()

    @property
    def _closing(self) -> bool:
        return self._wakeup.is_set

    # ---- connections ----

    def _accept_loop(self) -> None:
        while True:
            try:
                if not self._wakeup.wait_readable([self._listener]):
                    return
                sock, _ = self._listener.accept()
            except (OSError, ValueError):
                return
            ch = Channel(sock)
            with self._cond:
                if self._closing:  # close() has taken its list of connections to end
                    ch.close()
                    return
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[ch] = t = threading.Thread(target=self._serve, args=(ch,),
                                                                 name="kv-sender-conn", daemon=True)
                    t.start()  # under the lock: close() never sees a thread it cannot join
            if full:
                self._refuse(ch, f"sparsekv: this prefill serves at most {self.max_connections} decode connections")

    def _refuse(self, ch: Channel, error: str) -> None:
        """Refuse a decode connection: one ``refused`` message, then close it."""
        self.refusals.append(error)
        logger.error("refusing a decode connection: %s", error)
        self._send(ch, Refused(error))
        ch.close()

    @staticmethod
    def _send(ch: Channel, message: Message) -> bool:
        """Send ``message``; False if the decode is gone."""
        try:
            ch.send(message.encode())
            return True
        except PeerClosedError:
            return False

    def _finish(self, room: int, state: RoomState, error: str = "") -> None:
        with self._cond:
            r = self._rooms.get(room)
            if r is None or r.state.finished:
                return
            r.error = error
            self._rooms.advance(room, state)
            self._cond.notify_all()
        if r.on_done is not None:
            try:
                r.on_done(room, state == RoomState.SUCCESS)
            except Exception:  # the scheduler's bug: the connection still serves the other rooms
                logger.exception("on_done of room %d raised", room)

    def _next_message(self, ch: Channel, hangup: threading.Event) -> dict | None:
        """The decode's next message; None once it hung up (``hangup`` is then set) or the sender
        closes. A frame that is whole but not a JSON object is refused (one message) and skipped; a
        frame over the size bound ends the connection, after a refusal (the stream cannot be
        trusted past it)."""
        while True:
            try:
                if not self._wakeup.wait_readable([ch.sock]):
                    return None
            except (OSError, ValueError):
                return None
            try:
                return ch.recv(self.deadlines.message_s)
            except ProtocolError as e:
                self._send_refusal(ch, str(e))
                continue
            except ValueError as e:
                self._send_refusal(ch, str(e))
                return None
            except (PeerClosedError, TimeoutError):
                hangup.set()
                return None

    def _send_refusal(self, ch: Channel, error: str, room: int | None = None) -> None:
        """One message telling the decode a message of its was refused (a room's status when it named one)."""
        logger.error("refusing a decode message: %s", error)
        self._send(ch, Refused(error) if room is None else Status(room, ok=False, error=error))

    def _handshake(self, ch: Channel) -> tuple[Hello, Manifest, bytes] | None:
        """The decode's hello, its manifest and engine descriptor, checked; None if refused or gone."""
        try:
            hello = decode(ch.recv(self.deadlines.handshake_s), Hello)
            if not secret_matches(self.secret, hello.secret):
                raise ProtocolError("sparsekv: the decode did not present this deployment's secret")
            remote = Manifest.from_dict(hello.manifest)
            check_manifests(self.manifest, remote)
            return hello, remote, unb64(hello.agent)
        except (ManifestMismatchError, ValueError, binascii.Error, TypeError, KeyError, AttributeError) as e:
            self._refuse(ch, str(e))  # a malformed hello (ProtocolError), manifest or descriptor
        except (PeerClosedError, TimeoutError) as e:
            logger.error("decode connection failed during the handshake: %s", e)
            ch.close()
        return None

    def _serve(self, ch: Channel) -> None:
        peer = None
        try:
            if (shaken := self._handshake(ch)) is None:
                return
            hello, remote, descriptor = shaken
            try:
                peer = self.backend.connect(descriptor)
            except Exception as e:  # a peer's descriptor is untrusted input: any engine error refuses it
                self._refuse(ch, f"sparsekv: the decode's engine descriptor was refused: {type(e).__name__}: {e}")
                return
            if not self._send(ch, Welcome(b64(self.backend.descriptor()), self.manifest.to_dict())):
                logger.error("decode connection lost after the handshake")
                return
            self._serve_rooms(ch, peer, RoomPlanner(self.manifest, remote, self.kv_args),
                              _Session(hello.session, hello.checksums, hello.notified))
        finally:
            ch.close()
            if peer is not None:
                try:
                    self.backend.disconnect(peer)
                except Exception as e:  # the engine may already have dropped a dead peer
                    logger.warning("could not disconnect %s: %s", peer, e)
            with self._cond:
                self._connections.pop(ch, None)
                self._cond.notify_all()

    def _serve_rooms(self, ch: Channel, peer: str, planner: RoomPlanner, session: _Session) -> None:
        # Two stages: this thread reads and plans the next room while the poster thread's writes
        # of the previous one run (the engine releases the GIL while it copies). This thread is
        # the connection's only reader: it tells the poster, through `hangup`, that the decode
        # went away. (A poster that peeked at the socket itself could find the byte select() saw
        # already read by this thread, and its peek then blocked for the socket's timeout and read
        # as a hangup: a 30 s stall that failed a healthy room.)
        posts: queue.Queue = queue.Queue()
        hangup = threading.Event()
        poster = threading.Thread(target=self._post_loop, args=(ch, peer, posts, session, hangup),
                                  name="kv-sender-post", daemon=True)
        poster.start()
        try:
            while poster.is_alive() and (message := self._next_message(ch, hangup)) is not None:
                try:
                    request = decode(message, Transfer, Bye)
                except ProtocolError as e:
                    room = message.get("room")  # a refusal names the room only when the room itself is valid
                    valid = message.get("op") == Transfer.OP and type(room) is int and 0 <= room < 1 << 63  # noqa: E721
                    self._send_refusal(ch, str(e), room if valid else None)
                    continue
                if isinstance(request, Bye):  # the decode waits for nothing more
                    hangup.set()
                    break
                if (prepared := self._prepare(ch, planner, request, session)) is not None:
                    posts.put(prepared)
        finally:
            posts.put(None)
            poster.join()

    def _wait_source(self, room: int) -> _Source | None:
        deadline = time.monotonic() + self.deadlines.source_s
        with self._cond:
            while room not in self._rooms and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._rooms.get(room)

    def _prepare(self, ch: Channel, planner: RoomPlanner, request: Transfer,
                 session: _Session) -> tuple[int, _Source, Plan, Callable[[], dict[str, int]]] | None:
        """The room a ``transfer`` asks for, claimed, planned and (when the decode asked) its digests
        started; None if refused (the decode was told why, nothing else changed)."""
        room = request.room
        source = self._wait_source(room)
        if source is None:
            self._send(ch, Status(room, ok=False, error=f"sparsekv: prefill has no room {room} (not declared within "
                                                        f"{self.deadlines.source_s} s)"))
            return None
        with self._cond:
            state = source.state
            claimed = state == RoomState.DECLARED and self._rooms.advance(room, RoomState.CLAIMED)
        if not claimed:
            what = "in transfer" if state == RoomState.CLAIMED else state.value
            self._send(ch, Status(room, ok=False, error=f"sparsekv: room {room} is already {what}"))
            return None
        try:
            plan = planner.plan(source.kv_indices, source.state_indices, request.plan_request(), coalesce=self.coalesce)
            # A large room is hashed on the digest threads while this thread reads on and the
            # poster writes the rooms before it; the poster waits for its digests before its first
            # write of the room.
            digests = start_room_digests(self.manifest.components, source.kv_indices, {}, source.state_indices) \
                if session.checksums else dict
            return room, source, plan, digests
        except (ValueError, IndexError, TypeError, TransferError) as e:
            self._fail(ch, room, f"sparsekv: room {room} refused before any write: {e}")
            return None

    def _post_loop(self, ch: Channel, peer: str, posts: queue.Queue, session: _Session,
                   hangup: threading.Event) -> None:
        """Write the planned rooms in order, at most ``max_inflight`` batches in flight across rooms
        (a room's first batches go out while the last ones of the room before it still land, so
        the engine never waits for this thread to see a room finish); after a failed transfer fail
        the rest and stop."""
        pending: deque[_Posting] = deque()  # rooms with batches still to post, in order
        inflight: deque[tuple[_Posting, TransferHandle]] = deque()  # posted batches, oldest first
        lost, ended = "", False
        try:
            while not ended or pending or inflight:
                culprit = None
                try:
                    # Take the next room the reader has planned once this one's batches are all
                    # posted (waiting for its digests, which the reader started, only then); wait
                    # for one only when nothing is in flight.
                    while not ended and not pending:
                        try:
                            item = posts.get(block=not inflight)
                        except queue.Empty:
                            break
                        if item is None:
                            ended = True
                        elif (posting := self._posting(ch, item, lost)) is not None:
                            if posting.batches:
                                pending.append(posting)
                            elif not self._succeed(ch, posting, session):
                                lost = "sparsekv: the decode side went away"
                    # Post one batch when there is room for it, then see to the oldest batch in
                    # flight: waited for when nothing else can be posted, else given SPIN_S to land
                    # (a host-to-host write copies inside the post and completes tens of
                    # microseconds later), so a room whose batches have landed is reported at once,
                    # not after the batches posted behind it (its decode then checks bytes it has
                    # just received).
                    posted = bool(pending) and len(inflight) < self.max_inflight
                    if posted:
                        culprit = posting = pending[0]
                        inflight.append((posting, self._post(peer, posting, session)))
                        if posting.posted == len(posting.batches):
                            pending.popleft()
                    if inflight:
                        culprit, handle = inflight[0]
                        if self._landed(hangup, handle, culprit.deadline, SPIN_S if posted else None):
                            inflight.popleft()
                            culprit.done += 1
                            if self.progress is not None:
                                self.progress(culprit.room, culprit.done, len(culprit.batches))
                            if culprit.done == len(culprit.batches) and not self._succeed(ch, culprit, session):
                                lost = "sparsekv: the decode side went away"
                except TransferError as e:
                    lost = (f"sparsekv: room {culprit.room}: transfer failed after {culprit.done}/"
                            f"{len(culprit.batches)} batches: {e}")
                    self._fail(ch, culprit.room, lost)
                    for room in dict.fromkeys(p.room for p in (*(p for p, _ in inflight), *pending)):
                        if room != culprit.room:
                            self._fail(ch, room, f"sparsekv: room {room} not sent: {lost}")
                    for _, handle in inflight:  # aborted: cancel what is still posted
                        handle.release()
                    pending.clear()
                    inflight.clear()
                    ch.close()  # the serving thread stops reading, the decode sees the connection end
        finally:
            for _, handle in inflight:
                handle.release()

    def _posting(self, ch: Channel, item: tuple, lost: str) -> _Posting | None:
        """A planned room ready to post, its source digested; None if it fails first (told why)."""
        room, source, plan, digests = item
        if lost:
            self._fail(ch, room, f"sparsekv: room {room} not sent: {lost}")
            return None
        try:
            # What the source holds before anything is sent (a source changed after this, e.g. a
            # page reused too early, then fails the room on the decode).
            hexdigests = {k: f"{v:016x}" for k, v in digests().items()}
        except (IndexError, ValueError) as e:  # the plan checked every index: not expected
            self._fail(ch, room, f"sparsekv: room {room} refused before any write: its source cannot be "
                                 f"digested: {e}")
            return None
        batches = plan_batches(plan, self.max_batch_rows)
        return _Posting(room, source, batches, hexdigests, int(sum(int(rows[:, 2].sum()) for _, _, rows in batches)))

    def _post(self, peer: str, posting: _Posting, session: _Session) -> TransferHandle:
        """Post the room's next batch (raises TransferError as the engine does)."""
        i, n = posting.posted, len(posting.batches)
        if i == 0:
            posting.start = time.perf_counter()
            posting.deadline = time.monotonic() + self.deadlines.write_s
        src_kind, dst_kind, rows = posting.batches[i]
        digests = posting.hexdigests if session.notified and i == 0 else None
        notif = Notification(session.id, self.address[1], posting.room, i, n, digests).encode()
        handle = self.backend.write(peer, rows, src_kind=src_kind, dst_kind=dst_kind, notif=notif)
        posting.posted += 1
        return handle

    def _succeed(self, ch: Channel, posting: _Posting, session: _Session) -> bool:
        """Finish a room whose every batch landed and tell the decode; False if the decode is gone."""
        with self._cond:
            posting.source.nbytes = posting.nbytes
            posting.source.seconds = time.perf_counter() - posting.start if posting.batches else 0.0
        self._finish(posting.room, RoomState.SUCCESS)
        if session.notified and posting.batches:  # its notifications told the decode everything
            return True
        return self._send(ch, Status(posting.room, ok=True, batches=len(posting.batches), bytes=posting.nbytes,
                                     digests=posting.hexdigests))

    def _fail(self, ch: Channel, room: int, error: str) -> None:
        logger.error("%s", error)
        self._finish(room, RoomState.FAILED, error)
        self._send(ch, Status(room, ok=False, error=error))

    def _landed(self, hangup: threading.Event, handle: TransferHandle, deadline: float,
                patience: float | None) -> bool:
        """Whether the batch of ``handle`` landed within ``patience`` seconds (None: polls until it
        has; its handle is then released). Raises TransferError (the handle released) if it
        failed, the decode went away, the sender is closing or the deadline passed."""
        since = time.monotonic()
        try:
            while True:
                state = handle.status()
                if state == "DONE":
                    handle.release()
                    return True
                if state == "ERR":
                    raise TransferError("the transfer engine reported a failed write")
                if hangup.is_set():
                    raise TransferError("the decode side went away mid-transfer")
                if self._closing:
                    raise TransferError("the sender is closing")
                if time.monotonic() > deadline:
                    raise TransferError(f"writes did not complete within {self.deadlines.write_s} s")
                if patience is not None and time.monotonic() - since >= patience:
                    return False
                poll_pause(since)
        except TransferError:
            handle.release()
            raise

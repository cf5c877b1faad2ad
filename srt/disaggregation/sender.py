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
last ones of the room before it still land). A room asked for before it is declared waits aside
(at most ``deadlines.source_s``) and never delays the rooms asked for after it.

A decode that gives up on a room sends a :class:`~.protocol.Cancel`: a room still waiting to be
declared is dropped, a room being written posts no further batch (the poster checks before each),
and once none of its batches is in flight the decode gets a :class:`~.protocol.Cancelled`. A
failure status says whether writes of the room may still be in flight (``inflight``).

Peer input is untrusted (:mod:`.protocol`): a bad message gets one refusal on its connection and
changes nothing else; frames are bounded (:data:`~.bootstrap.MAX_MESSAGE_BYTES`) and so are the
connections served at once (``max_connections``). With a shared ``secret`` the sender serves only
decodes that prove they hold it (:mod:`.messages`, "Authentication"). A connection that holds no
room for ``deadlines.idle_s`` is closed (after a :class:`~.protocol.Bye`), one that ends is
forgotten at once.

Lifecycle: ``KVSender(kv_args, backend)`` registers its regions and listens; ``close()`` stops it
and releases every handle and registration.
"""

from __future__ import annotations

import binascii
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from sparsekv.srt.disaggregation.backend import SPIN_S, TransferBackend, TransferError, TransferHandle, poll_pause
from sparsekv.srt.disaggregation.bootstrap import (
    LOOPBACK,
    Channel,
    Doorbell,
    PeerClosedError,
    Wakeup,
    b64,
    listen,
    unb64,
)
from sparsekv.srt.disaggregation.deadlines import Deadlines
from sparsekv.srt.disaggregation.integrity import start_room_digests
from sparsekv.srt.disaggregation.kv_args import KVArgs
from sparsekv.srt.disaggregation.manifest import Manifest, ManifestMismatchError, check_manifests
from sparsekv.srt.disaggregation.messages import ProtocolError, new_nonce, proof_matches, secret_proof
from sparsekv.srt.disaggregation.planning import RoomPlanner, plan_batches
from sparsekv.srt.disaggregation.protocol import (
    Bye,
    Cancel,
    Cancelled,
    Challenge,
    Hello,
    Message,
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

#: How long a failed room's other batches in flight are given to stop before its status says that
#: writes of it may still land.
STOP_S = 1.0


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
    cancelled: bool = False  # the decode gave up on it: no further batch is posted

    @property
    def settled(self) -> bool:
        """Whether the room is over: every batch it will post has landed."""
        return self.done == self.posted and (self.cancelled or self.posted == len(self.batches))


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


@dataclass
class _Connection:
    """One decode connection's rooms (guarded by the sender's lock)."""

    channel: Channel
    doorbell: Doorbell  # rung when a room it waits for is declared
    thread: threading.Thread | None = None
    #: Rooms asked for before they were declared: the request and the monotonic() deadline.
    awaiting: dict[int, tuple[Transfer, float]] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)  # rooms claimed here and not yet answered
    cancels: set[int] = field(default_factory=set)  # live rooms the decode gave up on

    @property
    def holds_rooms(self) -> bool:
        return bool(self.awaiting or self.live)


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
        an idle connection, the threads on close.
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
        The deployment's shared secret: a decode that does not prove it holds it is refused; the
        sender proves it holds it too (:mod:`.messages`, "Authentication"); it never crosses the
        wire. None serves any decode that can reach the port (docs/pd.md, "PD trust model").
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
        self._connections: dict[Channel, _Connection] = {}
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
            for connection in self._connections.values():
                if room in connection.awaiting:
                    connection.doorbell.ring()
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
        """Stop listening, drop every connection (its threads end within ``deadlines.close_s``, all
        together), release every handle and registration (idempotent)."""
        with self._cond:
            if self._wakeup.is_set:
                return
            self._wakeup.set()
            self._cond.notify_all()
            connections = dict(self._connections)
        self._listener.close()
        for ch in connections:
            ch.close()
        deadline = time.monotonic() + self.deadlines.close_s  # one bound for all of them
        for t in [self._accept_thread, *(c.thread for c in connections.values())]:
            t.join(max(0.0, deadline - time.monotonic()))
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
                    connection = self._connections[ch] = _Connection(ch, Doorbell())
                    connection.thread = threading.Thread(target=self._serve, args=(connection,),
                                                         name="kv-sender-conn", daemon=True)
                    connection.thread.start()  # under the lock: close() never sees a thread it cannot join
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

    def _read(self, ch: Channel, hangup: threading.Event) -> dict | None:
        """The decode's next message, its first bytes there; None once it hung up (``hangup`` is
        then set) or a frame over the size bound ended the connection (after a refusal: the stream
        cannot be trusted past it). A frame that is whole but not a JSON object is refused (one
        message) and read as ``{}``."""
        try:
            return ch.recv(self.deadlines.message_s)
        except ProtocolError as e:
            self._send_refusal(ch, str(e))
            return {}
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
        """The decode's hello, its proof of the secret, its manifest and engine descriptor, checked;
        None if refused or gone."""
        try:
            hello = decode(ch.recv(self.deadlines.handshake_s), Hello)
            if self.secret is not None:
                if not hello.nonce:
                    raise ProtocolError("sparsekv: the decode did not present this deployment's secret (its hello "
                                        "carries no challenge)")
                nonce = new_nonce()
                ch.send(Challenge(nonce, secret_proof(self.secret, "prefill", hello.nonce, nonce,
                                                      hello.session)).encode())
                answer = decode(ch.recv(self.deadlines.handshake_s), Proof)
                if not proof_matches(self.secret, "decode", hello.nonce, nonce, hello.session, answer.proof):
                    raise ProtocolError("sparsekv: the decode did not prove it holds this deployment's secret")
            remote = Manifest.from_dict(hello.manifest)
            check_manifests(self.manifest, remote)
            return hello, remote, unb64(hello.agent)
        except (ManifestMismatchError, ValueError, binascii.Error, TypeError, KeyError, AttributeError) as e:
            self._refuse(ch, str(e))  # a malformed hello (ProtocolError), proof, manifest or descriptor
        except (PeerClosedError, TimeoutError) as e:
            logger.error("decode connection failed during the handshake: %s", e)
            ch.close()
        return None

    def _serve(self, connection: _Connection) -> None:
        ch, peer = connection.channel, None
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
            self._serve_rooms(connection, peer, RoomPlanner(self.manifest, remote, self.kv_args),
                              _Session(hello.session, hello.checksums, hello.notified))
        finally:
            ch.close()
            if peer is not None:
                try:
                    # The poster has stopped and no batch is in flight: forget the decode's memory.
                    self.backend.disconnect(peer)
                except Exception as e:  # the engine may already have dropped a dead peer
                    logger.warning("could not disconnect %s: %s", peer, e)
            with self._cond:
                self._connections.pop(ch, None)
                self._cond.notify_all()
            connection.doorbell.close()

    def _serve_rooms(self, connection: _Connection, peer: str, planner: RoomPlanner, session: _Session) -> None:
        # Two stages: this thread reads and plans the next room while the poster thread's writes
        # of the previous one run (the engine releases the GIL while it copies). This thread is
        # the connection's only reader: it tells the poster, through `hangup`, that the decode
        # went away. (A poster that peeked at the socket itself could find the byte select() saw
        # already read by this thread, and its peek then blocked for the socket's timeout and read
        # as a hangup: a 30 s stall that failed a healthy room.) A room asked for before it is
        # declared waits in `connection.awaiting`, and this thread reads on: it never holds up
        # the rooms behind it.
        ch = connection.channel
        posts: queue.Queue = queue.Queue()
        hangup = threading.Event()
        poster = threading.Thread(target=self._post_loop, args=(connection, peer, posts, session, hangup),
                                  name="kv-sender-post", daemon=True)
        poster.start()
        idle_since = time.monotonic()
        try:
            while poster.is_alive():
                now = time.monotonic()
                with self._cond:
                    connection.doorbell.clear()
                    declared = [r for r in connection.awaiting if r in self._rooms]
                    expired = [r for r, (_, deadline) in connection.awaiting.items() if deadline <= now]
                    requests = [connection.awaiting.pop(r)[0] for r in dict.fromkeys(declared + expired)]
                for request in requests:
                    if request.room in declared:
                        self._claim(connection, planner, request, session, posts)
                    else:
                        self._send(ch, Status(request.room, ok=False, error=f"sparsekv: prefill has no room "
                                   f"{request.room} (not declared within {self.deadlines.source_s} s)"))
                with self._cond:
                    if connection.holds_rooms:
                        idle_since = now
                    idle = not connection.holds_rooms and now - idle_since >= self.deadlines.idle_s
                    bound = min([d for _, d in connection.awaiting.values()] +
                                ([] if connection.holds_rooms else [idle_since + self.deadlines.idle_s]), default=None)
                if idle:  # every room it asked for was answered before this bye, on this channel
                    self._send(ch, Bye())
                    hangup.set()
                    self._linger(ch)
                    break
                try:
                    readable = self._wakeup.wait_readable([ch.sock, connection.doorbell],
                                                          None if bound is None else max(0.0, bound - now))
                except (OSError, ValueError):
                    break
                if self._closing:
                    break
                if ch.sock not in readable:
                    continue
                if (message := self._read(ch, hangup)) is None:
                    break
                if message and not self._dispatch(connection, planner, message, session, posts, hangup):
                    break
        finally:
            posts.put(None)
            poster.join()

    def _linger(self, ch: Channel) -> None:
        """After a bye: stop sending, and read (and drop) what the decode still sends until it
        closes its end, at most ``deadlines.message_s``. Closing at once with a message of its
        unread would reset the connection, and the decode could lose the bye ahead of the reset."""
        try:
            ch.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + self.deadlines.message_s
            while (left := deadline - time.monotonic()) > 0:
                ch.sock.settimeout(left)
                if not ch.sock.recv(1 << 16):
                    return
        except OSError:  # reset, timed out or closed: nothing more to wait for
            pass

    def _dispatch(self, connection: _Connection, planner: RoomPlanner, message: dict, session: _Session,
                  posts: queue.Queue, hangup: threading.Event) -> bool:
        """Act on one message of the decode's; False once it said goodbye."""
        ch = connection.channel
        try:
            request = decode(message, Transfer, Cancel, Bye)
        except ProtocolError as e:
            room = message.get("room")  # a refusal names the room only when the room itself is valid
            valid = message.get("op") == Transfer.OP and type(room) is int and 0 <= room < 1 << 63  # noqa: E721
            self._send_refusal(ch, str(e), room if valid else None)
            return True
        if isinstance(request, Bye):  # the decode waits for nothing more
            hangup.set()
            return False
        room = request.room
        if isinstance(request, Cancel):
            with self._cond:
                stopping = room in connection.live
                if stopping:  # the poster answers once none of its batches is in flight
                    connection.cancels.add(room)
                connection.awaiting.pop(room, None)
                self._cond.notify_all()
            if not stopping:  # waiting for its declaration, finished, or never asked for: nothing in flight
                self._send(ch, Cancelled(room))
            return True
        with self._cond:
            asked = room in connection.awaiting or room in connection.live
            if not asked and room not in self._rooms:
                connection.awaiting[room] = (request, time.monotonic() + self.deadlines.source_s)
                return True
        if asked:
            self._send(ch, Status(room, ok=False, error=f"sparsekv: room {room} is already asked for on this "
                                                        "connection"))
        else:
            self._claim(connection, planner, request, session, posts)
        return True

    def _claim(self, connection: _Connection, planner: RoomPlanner, request: Transfer, session: _Session,
               posts: queue.Queue) -> None:
        """Claim the declared room a ``transfer`` asks for, plan it and start its digests (when the
        decode asked), and queue it for the poster; if refused, the decode is told why and nothing
        else changes."""
        ch, room = connection.channel, request.room
        with self._cond:
            source = self._rooms.get(room)
            state = source.state if source is not None else RoomState.FAILED  # forgotten: long finished
            claimed = state == RoomState.DECLARED and self._rooms.advance(room, RoomState.CLAIMED)
            if claimed:
                connection.live.add(room)
        if not claimed:
            what = "in transfer" if state == RoomState.CLAIMED else state.value
            self._send(ch, Status(room, ok=False, error=f"sparsekv: room {room} is already {what}"))
            return
        try:
            plan = planner.plan(source.kv_indices, source.state_indices, request.plan_request(), coalesce=self.coalesce)
            # A large room is hashed on the digest threads while this thread reads on and the
            # poster writes the rooms before it; the poster waits for its digests before its first
            # write of the room.
            digests = start_room_digests(self.manifest.components, source.kv_indices, {}, source.state_indices) \
                if session.checksums else dict
        except (ValueError, IndexError, TypeError, TransferError) as e:
            self._fail(connection, room, f"sparsekv: room {room} refused before any write: {e}")
            return
        posts.put((room, source, plan, digests))

    def _post_loop(self, connection: _Connection, peer: str, posts: queue.Queue, session: _Session,
                   hangup: threading.Event) -> None:
        """Write the planned rooms in order, at most ``max_inflight`` batches in flight across rooms
        (a room's first batches go out while the last ones of the room before it still land, so
        the engine never waits for this thread to see a room finish); stop a room the decode gave
        up on before its next batch; after a failed transfer fail the rest and stop."""
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
                        elif (posting := self._posting(connection, item, lost)) is not None:
                            if posting.batches:
                                pending.append(posting)
                            elif not self._settle(connection, posting, session):
                                lost = "sparsekv: the decode side went away"
                    if connection.cancels:  # checked before each batch: a given-up room posts no more
                        self._stop_cancelled(connection, pending, inflight)
                    # Post one batch when there is room for it, then see to the oldest batch in
                    # flight: waited for when nothing else can be posted, else given SPIN_S to land
                    # (a host-to-host write copies inside the post and completes tens of
                    # microseconds later), so a room whose batches have landed is reported at once,
                    # not after the batches posted behind it (its decode then checks bytes it has
                    # just received).
                    posted = bool(pending) and len(inflight) < self.max_inflight and not hangup.is_set()
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
                            if culprit.settled and not self._settle(connection, culprit, session):
                                lost = "sparsekv: the decode side went away"
                    elif hangup.is_set() and pending:
                        raise TransferError("the decode side went away")
                except TransferError as e:
                    culprit = culprit or pending[0]
                    lost = (f"sparsekv: room {culprit.room}: transfer failed after {culprit.done}/"
                            f"{len(culprit.batches)} batches: {e}")
                    # Whatever still runs is cancelled and given its bound to stop; a room whose
                    # writes may still land says so in its status.
                    unsettled = {p.room for p, h in inflight if not self._stopped(h)}
                    for room in dict.fromkeys([culprit.room, *(p.room for p, _ in inflight),
                                               *(p.room for p in pending)]):
                        self._fail(connection, room, lost if room == culprit.room else
                                   f"sparsekv: room {room} not sent: {lost}", inflight=room in unsettled)
                    pending.clear()
                    inflight.clear()
                    connection.channel.close()  # the serving thread stops reading, the decode sees the connection end
        finally:
            for _, handle in inflight:
                handle.release()

    def _stop_cancelled(self, connection: _Connection, pending: deque[_Posting],
                        inflight: deque[tuple[_Posting, TransferHandle]]) -> None:
        """Stop posting the rooms the decode gave up on; answer those with nothing in flight."""
        with self._cond:
            cancels, connection.cancels = connection.cancels, set()
        stopped = {p.room: p for p in (*pending, *(p for p, _ in inflight)) if p.room in cancels}
        for posting in stopped.values():
            posting.cancelled = True
        pending_left = [p for p in pending if not p.cancelled]
        pending.clear()
        pending.extend(pending_left)
        for posting in stopped.values():
            if posting.settled:
                self._settle(connection, posting, None)
        # A cancel for a room not yet taken from the queue is seen when it is taken (_posting).
        with self._cond:
            connection.cancels |= cancels - stopped.keys()

    def _posting(self, connection: _Connection, item: tuple, lost: str) -> _Posting | None:
        """A planned room ready to post, its source digested; None if it fails first (told why) or
        the decode gave it up meanwhile (answered)."""
        room, source, plan, digests = item
        if lost:
            self._fail(connection, room, f"sparsekv: room {room} not sent: {lost}")
            return None
        with self._cond:
            cancelled = room in connection.cancels
            connection.cancels.discard(room)
        if cancelled:
            self._settle(connection, _Posting(room, source, [], {}, 0, cancelled=True), None)
            return None
        try:
            # What the source holds before anything is sent (a source changed after this, e.g. a
            # page reused too early, then fails the room on the decode).
            hexdigests = {k: f"{v:016x}" for k, v in digests().items()}
        except (IndexError, ValueError) as e:  # the plan checked every index: not expected
            self._fail(connection, room, f"sparsekv: room {room} refused before any write: its source cannot be "
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

    def _settle(self, connection: _Connection, posting: _Posting, session: _Session | None) -> bool:
        """Finish a room none of whose batches is in flight any more, and tell the decode: a success
        (every batch landed), or that it stopped the room the decode gave up on. False if the
        decode is gone."""
        if posting.cancelled:
            self._finish(posting.room, RoomState.FAILED, "sparsekv: the decode gave the room up")
            told = self._send(connection.channel, Cancelled(posting.room))
        else:
            with self._cond:
                posting.source.nbytes = posting.nbytes
                posting.source.seconds = time.perf_counter() - posting.start if posting.batches else 0.0
            self._finish(posting.room, RoomState.SUCCESS)
            told = (session.notified and bool(posting.batches)  # its notifications told the decode everything
                    or self._send(connection.channel, Status(posting.room, ok=True, batches=len(posting.batches),
                                                             bytes=posting.nbytes, digests=posting.hexdigests)))
        self._answered(connection, posting.room)
        return told

    def _fail(self, connection: _Connection, room: int, error: str, *, inflight: bool = False) -> None:
        logger.error("%s", error)
        self._finish(room, RoomState.FAILED, error)
        self._send(connection.channel, Status(room, ok=False, error=error, inflight=inflight))
        self._answered(connection, room)

    def _answered(self, connection: _Connection, room: int) -> None:
        """The decode was told the room's outcome: the connection no longer holds it (its reader
        is woken to start counting the idle time)."""
        with self._cond:
            connection.live.discard(room)
            connection.cancels.discard(room)
            if not connection.holds_rooms:
                connection.doorbell.ring()

    def _stopped(self, handle: TransferHandle) -> bool:
        """Whether a batch that will not be waited for any more has stopped (landed or failed),
        given :data:`STOP_S` (the handle is released either way)."""
        since = time.monotonic()
        try:
            while handle.status() == "PROC":
                if time.monotonic() - since > STOP_S:
                    return False
                poll_pause(since)
            return True
        except Exception:  # an engine that cannot say: assume the worst
            return False
        finally:
            handle.release()

    def _landed(self, hangup: threading.Event, handle: TransferHandle, deadline: float,
                patience: float | None) -> bool:
        """Whether the batch of ``handle`` landed within ``patience`` seconds (None: polls until it
        has; its handle is then released). Raises TransferError if it failed, the decode went
        away, the sender is closing or the deadline passed (the caller then stops the handle)."""
        since = time.monotonic()
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

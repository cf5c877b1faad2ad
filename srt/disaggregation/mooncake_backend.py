"""``MooncakeBackend``: the transfer backend on the Mooncake Transfer Engine (TCP transport), host memory.

Install: ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`` (the ``mooncake`` extra; the
CUDA build needs a CUDA driver). Its ``engine.so`` links ``libibverbs.so.1`` even for TCP, and the
wheel does not bundle it: install ``libibverbs1`` (it pulls ``libnl-3-200`` and
``libnl-route-3-200``), or extract the three Debian packages without root --
``tools/fetch_mooncake_libs.sh DIR`` (``make install`` does it into ``.venv/sysroot``) -- and point
``SPARSEKV_MOONCAKE_LIBDIR`` at ``DIR`` when it is not ``<venv>/sysroot``.
:func:`load_mooncake_engine` preloads the libraries from there.

How this backend maps the interface onto the engine (``initialize("127.0.0.1", "P2PHANDSHAKE",
"tcp", "")``; a peer is addressed as ``127.0.0.1:<its rpc port>``):

* **Range checks.** Mooncake checks the *destination* range on the receiving side but sends from
  any *source* address it is given (whatever memory is mapped there). So :meth:`MooncakeBackend.write`
  checks every row against this side's registered regions and the peer's (its descriptor lists
  them) before anything is posted; a bad row is a :class:`~.backend.TransferError` naming it.
* **Batch size.** The TCP transport rejects batches of more than about 1024 requests (and a
  rejected batch breaks the next ones for a second), so a write is posted in sub-batches of at most
  :data:`MAX_BATCH_ROWS` rows, one at a time per peer, by the peer's worker thread.
* **Completion.** ``get_batch_transfer_status`` *waits* for a batch and frees it, so it is called
  exactly once per sub-batch, by the worker; :meth:`MooncakeHandle.status` only reads what the
  worker found. The engine bounds that wait by ``MC_TRANSFER_TIMEOUT`` seconds (at least 5,
  default 30), which its Python API reads from the process environment when a ``TransferEngine``
  is made and offers no argument for; this backend does not change the environment, so set it
  there (before the process starts) for another bound. The callers' own deadlines (e.g. a room's
  writes, :class:`~.deadlines.Deadlines`) still apply on top; :func:`engine_wait_s` tells how long
  a worker may be held.
* **Logging.** The engine's log level likewise comes only from ``MC_LOG_LEVEL`` in the environment
  (its INFO and WARNING lines are per connection); front ends set it for their processes
  (``sparsekv pd-demo`` does), the library leaves it alone.
* **Notifications.** The engine's Python API cannot send one, so each backend listens on a
  loopback TCP port of its own (:mod:`.bootstrap` framing; the port is in the descriptor). The
  worker sends a write's notification on that connection after the write's last sub-batch
  completed, i.e. after its data landed; notifications of one peer arrive in order.

Mooncake's listeners bind ``0.0.0.0`` whatever host it is initialised with (all traffic here goes
to 127.0.0.1); run it in a private network namespace (``unshare -n``) to keep them off other
interfaces, as the tests do.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import os
import platform
import queue
import sys
import sysconfig
import threading
import uuid
from pathlib import Path

import numpy as np

from sparsekv import env
from sparsekv.srt.disaggregation.backend import TransferBackend, TransferError, TransferHandle
from sparsekv.srt.disaggregation.bootstrap import LOOPBACK, Channel, PeerClosedError, Wakeup, b64, listen, unb64

logger = logging.getLogger(__name__)

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: The libraries ``engine.so`` needs beyond the wheel, in load order (libibverbs needs both libnl).
SYSTEM_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
#: Requests per posted batch (the TCP transport's per-peer queue holds 1024).
MAX_BATCH_ROWS = 1024
_FAILED_BATCH_IDS = (0, (1 << 64) - 1)  # what batch_transfer_async_write returns when it posts nothing


def library_dirs() -> list[Path]:
    """Where :func:`load_mooncake_engine` looks for :data:`SYSTEM_LIBS` before the system's loader path:
    ``SPARSEKV_MOONCAKE_LIBDIR`` if set, else ``<venv>/sysroot`` (each as a directory of libraries and as
    the root of extracted Debian packages)."""
    root = env.mooncake_libdir() or Path(sys.prefix) / "sysroot"
    multiarch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return [root, root / "lib" / multiarch, root / "usr" / "lib" / multiarch, root / "lib", root / "usr" / "lib"]


def _preload_system_libs() -> list[str]:
    """Load :data:`SYSTEM_LIBS` (from :func:`library_dirs`, else the system); the ones missing."""
    missing = []
    for lib in SYSTEM_LIBS:
        candidates = [str(d / lib) for d in library_dirs() if (d / lib).is_file()] + [lib]
        for path in candidates:
            try:
                # The loader meets engine.so's dependency on the SONAME with the copy already
                # loaded, whatever its scope. Local, not global: NIXL's wheel bundles its own
                # libnl-3/libnl-route-3, whose constructors and destructors would otherwise bind to
                # this copy's symbols, register their traffic-control ops in it twice and crash the
                # process at exit (rtnl_tc_unregister) when both engines were loaded.
                ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
                break
            except OSError:
                continue
        else:
            missing.append(lib)
    return missing


def load_mooncake_engine():
    """The ``mooncake.engine`` module, its system libraries preloaded.

    Raises
    ------
    ImportError
        Mooncake is not installed, or a library it needs is missing; the message names what is
        missing and how to install it.
    """
    if importlib.util.find_spec("mooncake") is None:
        raise ImportError(f"sparsekv: Mooncake is not installed (pip install {PACKAGE}, the `mooncake` extra)")
    missing = _preload_system_libs()
    if missing:
        raise ImportError(
            f"sparsekv: Mooncake's engine needs {', '.join(missing)}, found neither in "
            f"{library_dirs()[0]} nor on the system: apt-get install libibverbs1 (it pulls libnl-3-200 and "
            "libnl-route-3-200), or without root `tools/fetch_mooncake_libs.sh DIR` and "
            "SPARSEKV_MOONCAKE_LIBDIR=DIR (make install does this into .venv/sysroot)")
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as e:
        raise ImportError(f"sparsekv: Mooncake's engine cannot be loaded ({e}); install {PACKAGE}, "
                          "not the CUDA build, on a machine without a CUDA driver") from e


class RegionTable:
    """Registered regions ``(ptr, nbytes)`` of one side, for range checks of many rows at once.

    A row ``[addr, addr + nbytes)`` is inside when one region holds all of it (regions may overlap;
    a row spanning two adjacent regions is outside: the engine addresses one registered buffer).
    """

    def __init__(self, regions: list[tuple[int, int]]) -> None:
        spans = sorted((int(p), int(p) + int(n)) for p, n in regions if int(n) > 0)
        self.starts = np.array([s for s, _ in spans], dtype=np.uint64)
        # Among the regions starting at or before an address, the one reaching furthest decides.
        self.reach = np.maximum.accumulate(np.array([e for _, e in spans], dtype=np.uint64)) if spans else \
            np.zeros(0, dtype=np.uint64)

    def outside(self, addrs: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Mask of the rows not inside any region (uint64 ``addrs`` and ``nbytes``, same length)."""
        if self.starts.size == 0:
            return np.ones(addrs.shape, dtype=bool)
        idx = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        reach = self.reach[np.maximum(idx, 0)]
        room = reach - np.minimum(addrs, reach)  # never wraps: 0 where the row starts beyond reach
        return (idx < 0) | (addrs > reach) | (nbytes > room)


def check_rows(rows: np.ndarray, local: RegionTable, remote: RegionTable, peer: str) -> None:
    """Refuse ``rows`` (uint64 ``[N, 3]``: src, dst, bytes) unless every source lies in ``local`` and
    every destination in ``remote``.

    Raises
    ------
    TransferError
        Names the first bad row, its range and the side, and how many rows are bad.
    """
    for column, table, side in ((0, local, "this side"), (1, remote, f"peer {peer!r}")):
        bad = np.flatnonzero(table.outside(rows[:, column], rows[:, 2]))
        if bad.size:
            i = int(bad[0])
            what = "source" if column == 0 else "destination"
            raise TransferError(
                f"sparsekv: Mooncake write row {i} ({what} 0x{int(rows[i, column]):x}, {int(rows[i, 2])} B) is "
                f"outside every region registered on {side} ({bad.size} of {rows.shape[0]} rows are); nothing "
                "was posted")


class MooncakeHandle(TransferHandle):
    """A write queued to (or running on) its peer's worker."""

    def __init__(self, backend: MooncakeBackend, peer: str, rows: np.ndarray, notif: bytes) -> None:
        self._backend = backend
        self.peer = peer
        self.rows = rows
        self.notif = notif
        self.state = "PROC"
        self.cancelled = False

    def status(self) -> str:
        return "ERR" if self.cancelled and self.state == "PROC" else self.state

    def release(self) -> None:
        # The engine cannot cancel a posted batch: the worker finishes the one it waits on and
        # posts no more of this write; its notification is not sent.
        self.cancelled = True
        with self._backend._lock:
            self._backend._open.pop(id(self), None)


class _Peer:
    """A connected peer: where to write, its regions, the notification channel, the worker."""

    def __init__(self, name: str, session: str, regions: RegionTable, channel: Channel) -> None:
        self.name = name
        self.session = session
        self.regions = regions
        self.channel = channel
        self.connections = 1
        self.queue: queue.Queue[MooncakeHandle | None] = queue.Queue()
        self.worker: threading.Thread | None = None


def engine_wait_s() -> float:
    """How long the engine waits for one batch before it fails it: ``MC_TRANSFER_TIMEOUT`` seconds
    (at least 5; 30 when unset or not a number), as the engine reads it."""
    try:
        return float(max(5, int(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))))
    except ValueError:
        return 30.0


class MooncakeBackend(TransferBackend):
    """A Mooncake Transfer Engine endpoint over TCP on 127.0.0.1 (host memory only).

    Parameters
    ----------
    name : str, optional
        Endpoint name, unique among the peers (default: random).
    timeout_s : float
        Bound of this backend's waits: connecting a notification channel, and stopping a worker
        on close (beyond the engine's own wait for the batch it is in, :func:`engine_wait_s`).

    Raises
    ------
    ImportError
        Mooncake or a library it needs is missing (see :func:`load_mooncake_engine`).
    RuntimeError
        The engine did not initialise.
    """

    @classmethod
    def loopback(cls, name: str | None = None, *, timeout_s: float = 30.0) -> MooncakeBackend:
        """An endpoint on 127.0.0.1 (every endpoint is; the engine table's factory, :data:`~.engines.ENGINES`)."""
        return cls(name, timeout_s=timeout_s)

    def __init__(self, name: str | None = None, *, timeout_s: float = 30.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"sparsekv: argument `timeout_s` must be > 0, got {timeout_s}")
        engine = load_mooncake_engine()
        self.name = name or f"sparsekv-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.engine = engine.TransferEngine()
        rc = self.engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"sparsekv: Mooncake's transfer engine failed to initialise (rc {rc})")
        self.rpc_port = int(self.engine.get_rpc_port())
        self._lock = threading.RLock()
        self.registered: list[tuple[int, int, str]] = []
        self._local = RegionTable([])
        self._peers: dict[str, _Peer] = {}
        self._open: dict[int, MooncakeHandle] = {}
        self._closed = False
        # Notifications from peers: a loopback listener, read by one thread.
        self._listener = listen(LOOPBACK, 0)
        self._wakeup = Wakeup()  # ends the reader's wait on close
        self.notif_port = self._listener.getsockname()[1]
        self._inbox: dict[str, list[bytes]] = {}
        self._incoming: dict[Channel, str] = {}
        self._reader = threading.Thread(target=self._read_notifs, name="mooncake-notifs", daemon=True)
        self._reader.start()

    # ---- memory ----

    def register(self, regions: list[tuple[int, int, str]]) -> None:
        """Register host regions ``(ptr, nbytes, "DRAM")``.

        Raises
        ------
        ValueError
            A region is not host memory (``mem_kind`` other than ``"DRAM"``) or is empty.
        RuntimeError
            The backend is closed, or the engine refused a region (those registered before it
            stay registered).
        """
        regions = [(int(p), int(n), str(k)) for p, n, k in regions]
        for ptr, nbytes, kind in regions:
            if kind != "DRAM":
                raise ValueError(f"sparsekv: argument `regions`: MooncakeBackend moves host memory only, got "
                                 f"mem_kind {kind!r} at 0x{ptr:x}")
            if nbytes <= 0:
                raise ValueError(f"sparsekv: argument `regions`: empty region at 0x{ptr:x}")
        with self._lock:
            if self._closed:
                raise RuntimeError("sparsekv: the Mooncake backend is closed")
            for ptr, nbytes, kind in regions:
                rc = self.engine.register_memory(ptr, nbytes)
                if rc != 0:
                    raise RuntimeError(f"sparsekv: Mooncake refused to register {nbytes} B at 0x{ptr:x} (rc {rc})")
                self.registered.append((ptr, nbytes, kind))
            self._local = RegionTable([(p, n) for p, n, _ in self.registered])

    def descriptor(self) -> bytes:
        with self._lock:
            return json.dumps({"engine": "mooncake", "name": self.name, "rpc_port": self.rpc_port,
                               "notif_port": self.notif_port,
                               "regions": [[p, n, k] for p, n, k in self.registered]}).encode()

    # ---- peers ----

    def connect(self, descriptor: bytes) -> str:
        """Load a peer's descriptor and open the notification channel to it.

        Raises
        ------
        TransferError
            The descriptor is not a Mooncake one, or the peer's notification port does not answer.
        """
        try:
            d = json.loads(descriptor)
            name, rpc_port, notif_port = str(d["name"]), int(d["rpc_port"]), int(d["notif_port"])
            regions = RegionTable([(int(p), int(n)) for p, n, _ in d["regions"]])
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"sparsekv: not a Mooncake descriptor: {e}") from e
        with self._lock:
            if self._closed:
                raise TransferError("sparsekv: the Mooncake backend is closed")
            peer = self._peers.get(name)
            if peer is not None:
                peer.connections += 1
                peer.regions = regions  # the latest descriptor lists its latest registrations
                return name
        try:
            channel = Channel.connect((LOOPBACK, notif_port), self.timeout_s)
            channel.send({"op": "hello", "name": self.name})
        except (OSError, PeerClosedError) as e:
            raise TransferError(f"sparsekv: Mooncake peer {name!r} does not answer on its notification port: "
                                f"{e}") from e
        peer = _Peer(name, f"{LOOPBACK}:{rpc_port}", regions, channel)
        peer.worker = threading.Thread(target=self._work, args=(peer,), name=f"mooncake-{name}", daemon=True)
        with self._lock:
            self._peers[name] = peer
        peer.worker.start()
        return name

    def disconnect(self, peer: str) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                return
            p.connections -= 1
            if p.connections > 0:
                return
            del self._peers[peer]
        self._stop_peer(p)

    def _stop_peer(self, p: _Peer) -> None:
        """Cancel the peer's queued writes, stop its worker (bounded), close its channel."""
        with self._lock:
            mine = [h for h in self._open.values() if h.peer == p.name]
        for h in mine:
            h.release()
        p.queue.put(None)
        bound = max(self.timeout_s, engine_wait_s()) + 5.0
        p.worker.join(bound)
        if p.worker.is_alive():
            logger.warning("Mooncake worker for %s did not stop within %.0f s", p.name, bound)
        p.channel.close()

    @property
    def peers(self) -> list[str]:
        """Connected peers' names."""
        with self._lock:
            return list(self._peers)

    @property
    def open_handles(self) -> int:
        """Posted writes not yet released."""
        with self._lock:
            return len(self._open)

    # ---- writes ----

    def write(self, peer: str, rows: np.ndarray, *, src_kind: str, dst_kind: str,
              notif: bytes = b"") -> MooncakeHandle:
        """Queue writes ``rows`` (uint64 ``[N, 3]``: src, dst, bytes) to ``peer``; see the interface.

        Raises
        ------
        ValueError
            ``rows`` is not ``[N, 3]``.
        TransferError
            Unknown peer, device memory, or a row outside the registered regions of either side
            (the error names the row); nothing was posted.
        """
        rows = np.ascontiguousarray(rows, dtype=np.uint64)
        if rows.ndim != 2 or rows.shape[1] != 3:
            raise ValueError(f"sparsekv: argument `rows` must be [N, 3] (src, dst, nbytes), got shape {rows.shape}")
        for arg, kind in (("src_kind", src_kind), ("dst_kind", dst_kind)):
            if kind != "DRAM":
                raise TransferError(f"sparsekv: argument `{arg}`: MooncakeBackend moves host memory (DRAM) only, "
                                    f"got {kind!r}")
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                raise TransferError(f"sparsekv: Mooncake peer {peer!r} is not connected")
            check_rows(rows, self._local, p.regions, peer)
            handle = MooncakeHandle(self, peer, rows[rows[:, 2] > 0], bytes(notif))
            self._open[id(handle)] = handle
            p.queue.put(handle)
        return handle

    def _work(self, p: _Peer) -> None:
        """The peer's worker: runs its writes in order, one sub-batch in flight at a time."""
        while (handle := p.queue.get()) is not None:
            if handle.cancelled:
                continue
            handle.state = self._run(p, handle)

    def _run(self, p: _Peer, handle: MooncakeHandle) -> str:
        rows = handle.rows
        for start in range(0, rows.shape[0], MAX_BATCH_ROWS):
            if handle.cancelled:
                return "ERR"
            chunk = rows[start : start + MAX_BATCH_ROWS]
            batch = self.engine.batch_transfer_async_write(p.session, chunk[:, 0].tolist(), chunk[:, 1].tolist(),
                                                           chunk[:, 2].tolist())
            if batch in _FAILED_BATCH_IDS or batch < 0:
                logger.error("Mooncake could not post %d rows to %s", chunk.shape[0], p.name)
                return "ERR"
            # Waits (bounded by engine_wait_s()) and frees the batch: exactly one call per batch.
            if self.engine.get_batch_transfer_status([batch]) != 0:
                logger.error("Mooncake failed a write of %d rows to %s", chunk.shape[0], p.name)
                return "ERR"
        if handle.notif and not handle.cancelled:
            try:
                p.channel.send({"op": "notif", "data": b64(handle.notif)})
            except PeerClosedError as e:
                logger.error("could not notify %s: %s", p.name, e)
                return "ERR"
        return "DONE"

    # ---- notifications ----

    def send_notif(self, peer: str, message: bytes) -> None:
        with self._lock:
            p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"sparsekv: Mooncake peer {peer!r} is not connected")
        try:
            p.channel.send({"op": "notif", "data": b64(bytes(message))})
        except PeerClosedError as e:
            raise TransferError(f"sparsekv: could not notify {peer!r}: {e}") from e

    def get_notifs(self) -> dict[str, list[bytes]]:
        with self._lock:
            inbox, self._inbox = self._inbox, {}
        return inbox

    def _read_notifs(self) -> None:
        while True:
            channels = list(self._incoming)
            try:
                readable = self._wakeup.wait_readable([self._listener, *[c.sock for c in channels]])
            except (OSError, ValueError):
                return  # the listener was closed
            if not readable:
                return  # closing
            if self._listener in readable:
                try:
                    sock, _ = self._listener.accept()
                    self._incoming[Channel(sock)] = ""
                except OSError:
                    return
            for ch in channels:
                if ch.sock not in readable:
                    continue
                try:
                    message = ch.recv(self.timeout_s)
                except (PeerClosedError, TimeoutError, ValueError):
                    ch.close()
                    del self._incoming[ch]
                    continue
                if message.get("op") == "hello":
                    self._incoming[ch] = str(message.get("name", ""))
                elif message.get("op") == "notif":
                    with self._lock:
                        self._inbox.setdefault(self._incoming[ch], []).append(unb64(message["data"]))

    # ---- teardown ----

    def close(self) -> None:
        """Cancel every write, stop the workers, close every channel, deregister, drop the engine
        (idempotent). Regions a worker may still be writing from stay registered (logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            for h in list(self._open.values()):
                h.release()
        for p in peers:
            self._stop_peer(p)
        self._wakeup.set()
        self._reader.join(self.timeout_s)
        self._listener.close()
        self._wakeup.close()
        for ch in list(self._incoming):
            ch.close()
        self._incoming.clear()
        if any(p.worker.is_alive() for p in peers):
            logger.warning("Mooncake writes still running at close; their regions stay registered")
            return
        with self._lock:
            for ptr, _, _ in self.registered:
                rc = self.engine.unregister_memory(ptr)
                if rc != 0:
                    logger.warning("Mooncake could not deregister 0x%x (rc %d)", ptr, rc)
            self.registered = []
            self._local = RegionTable([])
        self.engine = None  # its destructor closes the segments and stops the listeners

"""``NixlBackend``: the transfer backend on NVIDIA NIXL (UCX), host or device memory.

Install: ``pip install --no-deps nixl-cu12 nixl`` *after* torch (``nixl-cu12`` requires torch and
would pull a CUDA build; the ``nixl`` meta package requires both the cu12 and cu13 flavours). The
meta package picks a flavour by the CUDA version it finds in the process and fails when that
flavour is absent (a CPU torch beside ``cuda-python`` 13 asks for cu13), so :func:`load_nixl_api`
falls back to whichever flavour is installed.

UCX picks its transports itself; on one machine it uses cross-memory attach (``process_vm_writev``)
for the data and TCP for control. ``net_devices="lo"`` keeps it on the loopback interface (tests,
demos); ``tls="tcp"`` forces the TCP path (containers that forbid cross-memory attach). Both reach
UCX through the UCX backend's ``engine_config`` parameter (``KEY=VALUE`` pairs NIXL hands to
``ucp_config_modify`` for this agent alone), never through the process environment; as everywhere
in NIXL, a ``UCX_NET_DEVICES`` or ``UCX_TLS`` already set in the environment takes precedence.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import uuid

import numpy as np

from sparsekv.srt.disaggregation.backend import TransferBackend, TransferError, TransferHandle

FLAVOURS = ("nixl", "nixl_cu12", "nixl_cu13")


def load_nixl_api():
    """The NIXL Python API module (``nixl._api`` or an installed flavour's ``_api``).

    Raises
    ------
    ImportError
        No NIXL flavour can be imported; the message names what each attempt raised.
    """
    errors = []
    for name in FLAVOURS:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        # NIXL logs every agent and backend creation at INFO to stdout.
        logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise ImportError("sparsekv: NIXL is not importable (pip install --no-deps nixl-cu12 nixl, after torch): "
                      + "; ".join(errors))


_BIND_LOCK = threading.Lock()


class _DelayedBind:
    """NIXL's binding module, except that agents it makes get progress thread delay ``delay_us``."""

    def __init__(self, bind, delay_us: int) -> None:
        self._bind = bind
        self._delay_us = delay_us

    def __getattr__(self, name: str):
        return getattr(self._bind, name)

    def nixlAgent(self, name: str, config):  # noqa: N802 (the binding's name)
        config.pthrDelay = self._delay_us
        return self._bind.nixlAgent(name, config)


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper


class NixlHandle(TransferHandle):
    """A posted NIXL transfer request."""

    def __init__(self, backend: NixlBackend, handle) -> None:
        self._backend = backend
        self._handle = handle

    def status(self) -> str:
        with self._backend.lock:
            if self._handle is None or self._backend.agent is None:
                return "ERR"
            return self._backend.agent.check_xfer_state(self._handle)

    def release(self) -> None:
        with self._backend.lock:
            self._release()

    def _release(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._backend._open.pop(id(self), None)
            if self._backend.agent is None:  # the agent is gone, and every request with it
                return
            try:
                self._backend.agent.release_xfer_handle(handle)
            except Exception as e:  # an un-cancellable request: NIXL keeps it, we must not reuse it
                logging.getLogger(__name__).warning("NIXL could not release a transfer handle: %s", e)


class NixlBackend(TransferBackend):
    """A NIXL agent with the UCX backend.

    Parameters
    ----------
    name : str, optional
        Agent name, unique among the peers (default: random).
    net_devices : str, optional
        UCX's ``NET_DEVICES`` for this agent (``"lo"``: loopback only); None: UCX's choice.
    tls : str, optional
        UCX's ``TLS`` for this agent (``"tcp"`` for a pure TCP path); None: UCX's choice.
        Neither may hold a comma: NIXL's ``engine_config`` separates its pairs by commas, so a
        list of devices or transports can only come from the environment (``UCX_NET_DEVICES``,
        ``UCX_TLS``).
    progress_delay_us : int
        Pause of the engine's progress thread between idle rounds. NIXL's Python API starts it
        with 0, a busy loop that keeps one core at 100% per process even when nothing moves; on
        a machine with few cores the prefill's and the decode's loops take every core and the
        request's own threads wait for a time slice (milliseconds per 8k-token request here).

    Raises
    ------
    ImportError
        NIXL is not installed (see the module docstring).
    """

    @classmethod
    def loopback(cls, name: str | None = None, *, timeout_s: float = 30.0) -> NixlBackend:
        """An agent on UCX's loopback device (``lo``) only. ``timeout_s`` is taken for the engine
        table's sake (:data:`~.engines.ENGINES`): NIXL itself does not wait, its callers bound their waits."""
        return cls(name, net_devices="lo")

    def __init__(self, name: str | None = None, *, net_devices: str | None = None, tls: str | None = None,
                 progress_delay_us: int = 100) -> None:
        if progress_delay_us < 0:
            raise ValueError(f"sparsekv: argument `progress_delay_us` must be >= 0, got {progress_delay_us}")
        ucx = {key: value for key, value in (("NET_DEVICES", net_devices), ("TLS", tls)) if value is not None}
        for key, value in ucx.items():
            if not isinstance(value, str) or not value or "," in value or "=" in value:
                raise ValueError(f"sparsekv: argument `{key.lower()}` must be one UCX {key} value without ',' or "
                                 f"'=', got {value!r} (a list can only come from UCX_{key} in the environment)")
        api = load_nixl_api()
        self.name = name or f"sparsekv-{uuid.uuid4().hex[:12]}"
        # STRICT: the agent locks internally too; its progress thread and ours share the UCX worker.
        config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        with _BIND_LOCK:
            # nixl_agent hard-codes the progress thread's delay: hand its binding one that sets ours.
            bind, api.nixlBind = api.nixlBind, _DelayedBind(api.nixlBind, progress_delay_us)
            try:
                self.agent = api.nixl_agent(self.name, config)
            finally:
                api.nixlBind = bind
        # This agent's UCX settings, passed to the backend (the process environment stays as it is).
        self.agent.create_backend("UCX", {"engine_config": ",".join(f"{k}={v}" for k, v in ucx.items())}
                                  if ucx else {})
        # The agent runs without NIXL's own locking (no listener thread); sender threads share it.
        self.lock = threading.RLock()
        self.registered: list[tuple[int, int, str]] = []
        self._reg_descs: list = []
        self._peers: dict[str, int] = {}  # peer -> connections using it
        self._known: dict[bytes, str] = {}  # descriptor -> peer
        self._open: dict[int, NixlHandle] = {}

    def _live(self):
        """The NIXL agent (caller holds ``lock``).

        Raises
        ------
        TransferError
            The backend is closed.
        """
        if self.agent is None:
            raise TransferError(f"sparsekv: NIXL agent {self.name!r} is closed")
        return self.agent

    @_locked
    def register(self, regions: list[tuple[int, int, str]]) -> None:
        by_kind: dict[str, list[tuple[int, int]]] = {}
        for ptr, nbytes, kind in regions:
            by_kind.setdefault(kind, []).append((int(ptr), int(nbytes)))
        for kind, spans in by_kind.items():
            descs = self._live().register_memory([(p, n, 0, "") for p, n in spans], kind)
            self._reg_descs.append(descs)
            self.registered += [(p, n, kind) for p, n in spans]

    @_locked
    def descriptor(self) -> bytes:
        return self._live().get_agent_metadata()

    @_locked
    def connect(self, descriptor: bytes) -> str:
        # Loading a peer's metadata again resets the engine's connection to it (a write another
        # thread has in flight to that peer then fails), so a known descriptor is not reloaded.
        peer = self._known.get(descriptor)
        if peer is None or peer not in self._peers:
            peer = self._live().add_remote_agent(descriptor)
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            # Open the engine's connection now, not on the first write (~10 ms on the first room).
            self._live().make_connection(peer)
            self._known[descriptor] = peer
        self._peers[peer] = self._peers.get(peer, 0) + 1
        return peer

    @_locked
    def disconnect(self, peer: str) -> None:
        if peer in self._peers:
            self._peers[peer] -= 1
            if self._peers[peer] == 0:
                del self._peers[peer]
                self._live().remove_remote_agent(peer)

    @_locked
    def write(self, peer: str, rows: np.ndarray, *, src_kind: str, dst_kind: str, notif: bytes = b"") -> NixlHandle:
        if peer not in self._peers:
            raise TransferError(f"sparsekv: NIXL peer {peer!r} is not connected")
        rows = np.ascontiguousarray(rows, dtype=np.uint64)
        local = np.zeros((rows.shape[0], 3), dtype=np.uint64)
        remote = np.zeros((rows.shape[0], 3), dtype=np.uint64)
        local[:, 0], local[:, 1] = rows[:, 0], rows[:, 2]
        remote[:, 0], remote[:, 1] = rows[:, 1], rows[:, 2]
        agent = self._live()
        try:
            handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, src_kind),
                                           agent.get_xfer_descs(remote, dst_kind), peer, notif)
        except Exception as e:
            raise TransferError(f"sparsekv: NIXL refused a {rows.shape[0]}-row write to {peer!r}: {e}") from e
        wrapped = NixlHandle(self, handle)
        self._open[id(wrapped)] = wrapped
        try:
            state = agent.transfer(handle)
        except Exception as e:
            wrapped.release()
            raise TransferError(f"sparsekv: NIXL could not post a write to {peer!r}: {e}") from e
        if state == "ERR":
            wrapped.release()
            raise TransferError(f"sparsekv: NIXL failed to post a write to {peer!r}")
        return wrapped

    @_locked
    def send_notif(self, peer: str, message: bytes) -> None:
        try:
            self._live().send_notif(peer, message)
        except Exception as e:
            raise TransferError(f"sparsekv: NIXL could not notify {peer!r}: {e}") from e

    @_locked
    def get_notifs(self) -> dict[str, list[bytes]]:
        if self.agent is None:  # closed: nothing arrives any more
            return {}
        return {str(k): list(v) for k, v in self.agent.get_new_notifs().items()}

    @property
    def peers(self) -> list[str]:
        """Connected peers' names."""
        return list(self._peers)

    @property
    def open_handles(self) -> int:
        """Posted writes not yet released."""
        return len(self._open)

    @_locked
    def close(self) -> None:
        """Release every handle, forget every peer, deregister every region, and drop the agent:
        NIXL frees an agent (its UCX worker, listening socket and connections) only when the
        last reference to it goes, so a closed backend that kept it held those sockets for as
        long as its owner lived (idempotent)."""
        if self.agent is None:
            return
        for h in list(self._open.values()):
            h._release()
        for peer in list(self._peers):
            self._peers[peer] = 1
            try:
                self.disconnect(peer)
            except Exception as e:
                logging.getLogger(__name__).warning("NIXL could not forget peer %r: %s", peer, e)
        for descs in self._reg_descs:
            self.agent.deregister_memory(descs)
        self._reg_descs.clear()
        self.registered = []
        self.agent = None

"""The transfer-engine interface of PD disaggregation.

The model every RDMA-style engine shares (NIXL, Mooncake): register host or device memory once,
hand the peer an opaque descriptor over a side channel (:mod:`.bootstrap`), then issue batches of
scattered one-sided WRITEs of ``(src_addr, dst_addr, nbytes)`` rows into the peer's registered
memory, poll them to completion, and tell the peer with a notification. Everything that can wait
takes a timeout. Which engine to open is :mod:`.engines`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import numpy as np

#: Polling a posted write: for this long after posting only yield the core between polls (a
#: request's small writes finish within tens of microseconds, well under one sleep's wake-up
#: latency), then sleep :data:`POLL_SLEEP_S` between polls, so that the engine's progress thread,
#: which needs the agent lock a poll holds, gets it and the core.
SPIN_S = 2e-4
POLL_SLEEP_S = 2e-4


def poll_pause(since: float) -> None:
    """Pause between two status polls of a write posted at ``since`` (a ``time.monotonic()``)."""
    time.sleep(0.0 if time.monotonic() - since < SPIN_S else POLL_SLEEP_S)


class TransferError(RuntimeError):
    """A transfer failed, was aborted, or did not finish in time."""


class TransferHandle(ABC):
    """One posted batch of writes."""

    @abstractmethod
    def status(self) -> str:
        """``"PROC"`` (in flight), ``"DONE"`` or ``"ERR"``."""

    @abstractmethod
    def release(self) -> None:
        """Free the handle, cancelling the batch if it is still in flight (idempotent)."""


class TransferBackend(ABC):
    """A transfer engine endpoint (one per process and side).

    Lifecycle: construct, :meth:`register` every region once, exchange :meth:`descriptor` with
    the peer and :meth:`connect` to it, then any number of :meth:`write` / :meth:`send_notif`,
    and finally :meth:`close` (releases every handle and registration).
    """

    #: Regions registered and not yet deregistered: ``(ptr, nbytes, mem_kind)``.
    registered: list[tuple[int, int, str]]

    @abstractmethod
    def register(self, regions: list[tuple[int, int, str]]) -> None:
        """Register regions ``(ptr, nbytes, mem_kind)`` (``mem_kind``: ``"DRAM"`` or ``"VRAM"``)."""

    @abstractmethod
    def descriptor(self) -> bytes:
        """What a peer needs to write into this endpoint's registered memory."""

    @abstractmethod
    def connect(self, descriptor: bytes) -> str:
        """Load a peer's descriptor; returns the peer's name. Connections to one peer are counted."""

    @abstractmethod
    def disconnect(self, peer: str) -> None:
        """Drop one connection to a peer; the last one forgets it (its writes must be released)."""

    @abstractmethod
    def write(self, peer: str, rows: np.ndarray, *, src_kind: str, dst_kind: str,
              notif: bytes = b"") -> TransferHandle:
        """Post writes ``rows`` (uint64 ``[N, 3]``: src address, dst address, bytes) to ``peer``.

        A non-empty ``notif`` reaches the peer's :meth:`get_notifs` after these writes have landed.

        Raises
        ------
        TransferError
            The engine refused the batch (unknown peer, unregistered range); nothing was posted.
        """

    @abstractmethod
    def send_notif(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` (delivered after the writes this side saw complete)."""

    @abstractmethod
    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, per peer name."""

    @property
    @abstractmethod
    def open_handles(self) -> int:
        """Posted writes not yet released (0 after :meth:`close`: nothing leaks)."""

    @abstractmethod
    def close(self) -> None:
        """Release every handle and deregister every region (idempotent)."""

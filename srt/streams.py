"""Streams and events behind one small interface, so runtime classes run unchanged on CPU and GPU.

A runtime class submits work to a :class:`Stream` (``stream.submit(fn, uses=...)``), orders
streams with events (``record_event`` / ``wait_event``) and polls completion (``event.query()``)
without blocking. Three implementations:

* :class:`CudaStream` wraps a ``torch.cuda.Stream``: ``submit`` runs ``fn`` with the stream
  current, so the kernels it launches are queued on it, and marks the CUDA tensors of ``uses``
  as in use by the stream (``Tensor.record_stream``).
* :class:`CpuStream` runs ``fn`` at once; every event is complete.
* ``CpuStream(deferred=True)`` queues ``fn`` until someone waits for it (``synchronize``, an
  event's ``synchronize`` or a ``wait_event`` from another stream): tests use it to see that a
  caller never reads results before their event completes.

Use :func:`make_streams` to get a factory for a device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class Event(Protocol):
    """A point in a stream's work."""

    def query(self) -> bool:
        """Whether the work before the event has completed (never blocks)."""

    def synchronize(self) -> None:
        """Block until the work before the event has completed."""


class Stream(Protocol):
    """An ordered queue of work."""

    def submit(self, fn: Callable[[], object], *, uses: Sequence[torch.Tensor] = ()) -> None:
        """Queue ``fn``'s work on this stream.

        ``uses``: tensors that work reads or writes which were allocated on another stream (e.g.
        index tensors the caller built on its compute stream). Their memory must not be handed to
        a new allocation before the work completes, even once the caller drops them.
        """

    def record_event(self) -> Event:
        """An event that completes once everything submitted so far has."""

    def wait_event(self, event: Event) -> None:
        """Work submitted after this call starts only after ``event`` completes."""

    def synchronize(self) -> None:
        """Block until everything submitted so far has completed."""


def _check_callable(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"sparsekv: argument `fn` must be callable, got {type(fn).__name__}")


class CpuEvent:
    """Completion of the first ``index`` work items of a :class:`CpuStream`."""

    def __init__(self, stream: CpuStream, index: int) -> None:
        self._stream = stream
        self._index = index

    def query(self) -> bool:
        return self._stream.completed >= self._index

    def synchronize(self) -> None:
        self._stream.run_until(self._index)


class CpuStream:
    """A host "stream": work runs at submit time, or, with ``deferred=True``, when waited for."""

    def __init__(self, *, deferred: bool = False) -> None:
        self.deferred = deferred
        self._pending: list[Callable[[], object]] = []
        self.completed = 0

    def submit(self, fn: Callable[[], object], *, uses: Sequence[torch.Tensor] = ()) -> None:
        # ``uses`` needs nothing here: host memory is not recycled behind a live reference, and a
        # deferred ``fn`` keeps its tensors referenced until it has run.
        _check_callable(fn)
        self._pending.append(fn)
        if not self.deferred:
            self.synchronize()

    def record_event(self) -> CpuEvent:
        return CpuEvent(self, self.completed + len(self._pending))

    def wait_event(self, event: Event) -> None:
        # Ordering on the host: finish the producer's work now, before anything submitted later here.
        event.synchronize()

    def run_until(self, index: int) -> None:
        """Run queued work (in order) until ``index`` items have completed.

        An item that raises still counts as completed (its exception reaches the caller that waited),
        so the events behind it complete once their own work has run.
        """
        while self.completed < index and self._pending:
            fn = self._pending.pop(0)
            try:
                fn()
            finally:
                self.completed += 1

    def synchronize(self) -> None:
        self.run_until(self.completed + len(self._pending))


class CudaStream:
    """A ``torch.cuda.Stream`` (the current one by default) behind the :class:`Stream` interface."""

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        self.stream = stream if stream is not None else torch.cuda.current_stream()

    def submit(self, fn: Callable[[], object], *, uses: Sequence[torch.Tensor] = ()) -> None:
        _check_callable(fn)
        try:
            with torch.cuda.stream(self.stream):
                fn()
        finally:
            # The caching allocator gives a freed block straight back to the stream that allocated
            # it, without waiting for kernels queued on other streams; record_stream makes the
            # block wait for this stream's work queued so far (also when fn failed after queuing
            # part of it).
            for tensor in uses:
                if tensor.is_cuda:
                    tensor.record_stream(self.stream)

    def record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait_event(self, event: torch.cuda.Event) -> None:
        self.stream.wait_event(event)

    def synchronize(self) -> None:
        self.stream.synchronize()


class StreamFactory(Protocol):
    """Where a runtime class gets its streams."""

    def current(self) -> Stream:
        """The stream the caller's compute runs on."""

    def new(self) -> Stream:
        """A fresh side stream."""


class CpuStreams:
    """Host streams; ``deferred=True`` makes side streams defer their work (the compute stream never does)."""

    def __init__(self, *, deferred: bool = False) -> None:
        self.deferred = deferred
        self._current = CpuStream()

    def current(self) -> CpuStream:
        return self._current

    def new(self) -> CpuStream:
        return CpuStream(deferred=self.deferred)


class CudaStreams:
    """CUDA streams of the current device."""

    def current(self) -> CudaStream:
        return CudaStream()

    def new(self) -> CudaStream:
        return CudaStream(torch.cuda.Stream())


def make_streams(device: torch.device | str) -> CpuStreams | CudaStreams:
    """The stream factory for ``device``: CUDA streams for a CUDA device, host streams otherwise."""
    return CudaStreams() if torch.device(device).type == "cuda" else CpuStreams()

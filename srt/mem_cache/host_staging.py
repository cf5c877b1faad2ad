"""Host -> device staging of a step's small integer tables, owned by the planner that uses it: :class:`HostStaging`.

A planner (:class:`~sparsekv.srt.mem_cache.compressor_state.CompressorState`) derives a few numbers per
request on the host and sends them to the device, where a kernel expands them into the step's
tables. On a GPU the copy must come from pinned memory (a copy from pageable memory synchronizes),
and the pinned block must outlive every copy that reads it, the copies a CUDA graph replays
included. A pinned temporary does not: after a capture it goes back to torch's caching host
allocator, the next pinned allocation takes it, and every replay reads whatever that allocation
wrote there. So the planner owns one pinned buffer (and one device buffer), allocated here and kept
as long as the planner lives.
"""

from __future__ import annotations

import torch

from sparsekv.checks import int_in


class HostStaging:
    """One pinned host buffer and one device buffer of int64, for the tables of one planner's steps.

    Parameters
    ----------
    device : torch.device
        Where the tables go. On the CPU they are used as given (no buffer, no copy).

    Ownership
    ---------
    :meth:`upload` writes the values into the host buffer, then queues one asynchronous copy into
    the device buffer on the current stream and returns the device buffer's first ``n`` entries (a
    view that the next upload overwrites: use it in the same step). Both buffers live as long as
    this object, so a copy captured in a CUDA graph keeps reading valid memory at every replay:

    * the buffers grow only outside a capture and before the first one (:meth:`reserve` the largest
      step first); a graph captured earlier would go on reading the old ones;
    * a write of the host buffer first waits for the last eager copy from it (an event: the step
      before, long done in practice), so it never overtakes a copy still in flight; once a graph
      has captured a copy, it waits for the current stream instead (a replay may still read it).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.host: torch.Tensor | None = None
        self.staged: torch.Tensor | None = None
        self.captured = False
        self._copied = None  # the event after the last eager copy (CUDA)

    @property
    def capacity(self) -> int:
        """int64 entries the buffers hold (0 before the first upload or reserve)."""
        return 0 if self.host is None else self.host.numel()

    def reserve(self, n: int) -> None:
        """Make the buffers hold at least ``n`` entries (before any capture).

        Raises
        ------
        RuntimeError
            The buffers must grow during a CUDA-graph capture, or after one captured a copy from them.
        """
        n = int_in(n, "n", 0)
        if self.device.type == "cpu" or n <= self.capacity:
            return
        if self.captured or self._capturing():
            raise RuntimeError(f"sparsekv: a staging buffer of {self.capacity} entries must grow to {n} after a "
                               f"CUDA graph captured a copy from it (the graph would go on reading the old one): "
                               f"reserve() the largest step before capturing")
        self._wait()  # the old host buffer may still be read by the last copy
        pin = self.device.type == "cuda"
        self.host = torch.empty(n, dtype=torch.int64, pin_memory=pin)
        self.staged = torch.empty(n, dtype=torch.int64, device=self.device)

    def upload(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (int64, on the host) on the device: staged through the owned buffers.

        Returns
        -------
        torch.Tensor
            int64, ``values``'s shape: ``values`` itself on the CPU, else a view of the device buffer.
        """
        if self.device.type == "cpu":
            return values
        n = values.numel()
        self.reserve(n)
        self._wait()
        self.host[:n].copy_(values.reshape(-1))
        staged = self.staged[:n]
        staged.copy_(self.host[:n], non_blocking=True)
        if self.device.type == "cuda":
            if self._capturing():
                self.captured = True
            else:
                self._copied = self._copied or torch.cuda.Event()
                self._copied.record()
        return staged.view(values.shape)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _wait(self) -> None:
        if self.device.type != "cuda":
            return
        if self.captured and not self._capturing():
            torch.cuda.current_stream(self.device).synchronize()
        elif self._copied is not None and not self._capturing():
            self._copied.synchronize()

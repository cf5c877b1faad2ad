"""The HiSparse swap-in with a resident-token index (kernel in ``csrc/hisparse_index.cuh``).

:func:`sparsekv.jit_kernel.hisparse.load_cache_to_device_buffer_mla` scans each request's whole hot
buffer (``H`` slots) every step to find which of the ``K`` wanted tokens are resident. Given a
:class:`ResidentIndex` (its ``resident_index=`` argument), it runs the indexed kernel instead: hits
are found by a direct map from C4 position to slot and the LRU order is a queue with lazy deletion,
so a step reads ``O(K)`` table entries (amortized), whatever ``H`` is. Results are the scanning
kernel's, bit for bit: same outputs, slot tokens, bytes, miss plan, counters and LRU order, for
every ``policy=`` (:data:`~sparsekv.jit_kernel.hisparse_params.SWAP_IN_POLICIES`). Under a protected
policy the walk from the queue's head also passes over the protected slots at the front of the LRU
order (at most ``W + 2 S K`` of them, whatever ``H`` is) and moves them up to where it stopped, so
no stale entry is read twice.

The index lives on the device next to ``device_buffer_tokens``, per request row (and per layer: one
:class:`ResidentIndex` per layer), and costs :func:`resident_index_bytes` per request and layer:
``2 * max_len + 8 * H + 8`` bytes (``max_len`` = C4 positions per request, the columns of
``host_cache_locs``). It is built (:meth:`ResidentIndex.build`) or rebuilt for admitted rows
(:meth:`ResidentIndex.rebuild_rows`) from ``device_buffer_tokens`` and ``lru_slots``; afterwards only
the kernel changes it, in the same launch that changes residency.

The scanning kernel stays the default: on the cpu backend (``tools/bench/bench_hisparse_index.py``,
K = 512) the indexed step costs about the same at H = 1-2k and is 1.3-2.4x faster at
H = 8k, where the scan has grown 1.7-1.9x and the indexed step 1.05-1.2x from H = 1k; no GPU
measurement yet. The direct map costs 2 bytes per C4 position: 512 KiB per request and layer at a
1M-token context, where an open-addressing table over the H slots would cost ~16 H bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from sparsekv.checks import int_in
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.hisparse_params import (
    SHARED_MEMORY_LIMIT,
    SWAP_IN_PARAMS,
    WARP,
    log2_ceil,
    near_bucket_bytes,
    swap_in_template_args,
)
from sparsekv.jit_kernel.torch_op import first_true
from sparsekv.kv_layout import resident_index_bytes

__all__ = [
    "INDEXED",
    "SORT_KEY_LIMIT",
    "ResidentIndex",
    "check_resident_index_on_device",
    "indexed_module",
    "indexed_shared_bytes",
    "resident_index_bytes",
]

#: Hot-buffer sizes must keep ``2 H`` queue positions below 2**16 (they share an int32 sort key with the slot).
SORT_KEY_LIMIT = 32768


def indexed_shared_bytes(num_top_k: int, block_size: int, protect_near: int = 0) -> int:
    """Bytes of ``IndexedSwapIn<K, H, BlockSize, Layout, W, S>::Shared`` (no ``H`` term, unlike the
    scanning kernel's).

    With ``T = 2 ** ceil(log2(2 K))`` hash cells and ``P = 2 ** ceil(log2 K)`` sort keys:
    ``align4(10 T + 4 P + 4 K) + 4 (BlockSize / 32) + 8``, plus :func:`near_bucket_bytes` when ``S > 0``.
    """
    cells = 1 << log2_ceil(2 * num_top_k)
    arrays = 10 * cells + 4 * (1 << log2_ceil(num_top_k)) + 4 * num_top_k
    return near_bucket_bytes(num_top_k, protect_near) + -(-arrays // 4) * 4 + 4 * (block_size // WARP) + 8


#: ``IndexedSwapIn<K, H, BlockSize, Layout[, W, S]>`` arguments: the scanning kernel's checks, except that the
#: scratch does not grow with ``H`` and ``2 H`` queue positions must fit the sort keys.
_complete_indexed = functools.partial(
    swap_in_template_args, "hisparse_index", slot_limit=SORT_KEY_LIMIT,
    hot_why="at least num_top_k; 2 * H queue positions below 2**16",
    shared_bytes=lambda k, h, block, recent, near: indexed_shared_bytes(k, block, near),
    too_large=lambda k, h, need: (f"sparsekv: hisparse_index num_top_k={k} needs {need} bytes of per-request scratch, "
                                  f"over the {SHARED_MEMORY_LIMIT} bytes of shared memory a GPU block can have; lower "
                                  f"num_top_k"))


INDEXED = register(
    KernelFamily(
        name="hisparse_index",
        header="hisparse_index.cuh",
        # The scanning module's export name, so the swap-in op calls either module's alike.
        exports={"load_cache_to_device_buffer": "sparsekv::hisparse::load_cache_to_device_buffer_indexed"},
        kernels=("sparsekv::hisparse::IndexedSwapIn",),
        params=SWAP_IN_PARAMS,
        complete=_complete_indexed,
        instances=(
            {"num_top_k": 5, "hot_buffer_size": 7, "layout": "generic"},
            {"num_top_k": 5, "hot_buffer_size": 7, "layout": "dsv4", "page_slots": 64},
            {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "dsv4", "page_slots": 64},
            {"num_top_k": 1024, "hot_buffer_size": 2048, "layout": "dsv4", "page_slots": 64},
            # near_lru: the test shape's scaled-down windows, and DSV4-Flash's.
            {"num_top_k": 5, "hot_buffer_size": 7, "layout": "generic", "protect_recent": 3, "protect_near": 1},
            {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "dsv4", "page_slots": 64, "protect_recent": 256,
             "protect_near": 16},
        ),
    )
)


def indexed_module(num_top_k: int, hot_buffer_size: int, *, is_dsv4_layout: bool = False,
                   page_slots: int | None = None, block_size: int | None = None, backend: str = "cpu",
                   protect_recent: int = 0, protect_near: int = 0):
    """The compiled indexed swap-in for ``(K, H)``, a layout (``page_slots`` defaults to 64 for dsv4) and
    a policy (``protect_recent`` / ``protect_near``, as for the scanning kernel's module)."""
    values = {"layout": "dsv4", "page_slots": page_slots or 64} if is_dsv4_layout else {"layout": "generic"}
    protect = {"protect_recent": protect_recent, "protect_near": protect_near} if protect_recent or protect_near \
        else {}
    return INDEXED.module(num_top_k=num_top_k, hot_buffer_size=hot_buffer_size, block_size=block_size,
                          backend=backend, **values, **protect)


@dataclass
class ResidentIndex:
    """One layer's resident-token index for every request row (see the module docstring).

    Attributes
    ----------
    slot_of : torch.Tensor
        int16 ``[max_reqs, max_len]``: hot slot holding each C4 position, -1 none.
    queue : torch.Tensor
        int16 ``[max_reqs, 2 H]``: the LRU queue (live entries front to back = least recently used first).
    queue_pos : torch.Tensor
        int32 ``[max_reqs, H + 2]``: queue position of each slot's live entry, then head and tail.
    """

    slot_of: torch.Tensor
    queue: torch.Tensor
    queue_pos: torch.Tensor

    @property
    def hot(self) -> int:
        """``H``, the hot slots per request."""
        return self.queue.shape[1] // 2

    @classmethod
    def empty(cls, max_reqs: int, max_len: int, hot_buffer_size: int, *,
              device: torch.device | str = "cpu") -> ResidentIndex:
        """An index of ``max_reqs`` rows with nothing resident and LRU ``0..H-1`` (call
        :meth:`rebuild_rows` for rows whose tables hold tokens)."""
        hot = int_in(hot_buffer_size, "hot_buffer_size", 1, SORT_KEY_LIMIT - 1, why="int16 slots",
                     owner="ResidentIndex")
        index = cls(slot_of=torch.full((max_reqs, max_len), -1, dtype=torch.int16, device=device),
                    queue=torch.zeros((max_reqs, 2 * hot), dtype=torch.int16, device=device),
                    queue_pos=torch.zeros((max_reqs, hot + 2), dtype=torch.int32, device=device))
        index._reset_queue(slice(None), torch.arange(hot, dtype=torch.int16, device=device).expand(max_reqs, hot))
        return index

    @classmethod
    def build(cls, device_buffer_tokens: torch.Tensor, lru_slots: torch.Tensor, max_len: int) -> ResidentIndex:
        """The index of every row of the swap-in tables (``lru_slots`` gives each row's LRU order)."""
        max_reqs, hot = lru_slots.shape
        index = cls.empty(max_reqs, max_len, hot, device=device_buffer_tokens.device)
        index.rebuild_rows(torch.arange(max_reqs), device_buffer_tokens, lru_slots)
        return index

    def rebuild_rows(self, rows: torch.Tensor | list[int], device_buffer_tokens: torch.Tensor,
                     lru_slots: torch.Tensor) -> None:
        """Rebuild ``rows`` from the swap-in tables (at admission): ``slot_of`` becomes the inverse of
        ``device_buffer_tokens[row, :H]`` (tokens outside ``[0, max_len)`` are not indexed) and the
        queue holds ``lru_slots[row]`` from position 0. Full tables, indexed by request row."""
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.slot_of.device).reshape(-1)
        hot, max_len = self.hot, self.slot_of.shape[1]
        tokens = device_buffer_tokens[rows.to(device_buffer_tokens.device), :hot].to(self.slot_of.device)
        slot_of = torch.full((len(rows), max_len), -1, dtype=torch.int16, device=self.slot_of.device)
        r, s = torch.nonzero((tokens >= 0) & (tokens < max_len), as_tuple=True)
        slot_of[r, tokens[r, s].long()] = s.to(torch.int16)
        self.slot_of[rows] = slot_of
        self._reset_queue(rows, lru_slots[rows.to(lru_slots.device)].to(self.queue.device))

    def _reset_queue(self, rows, lru: torch.Tensor) -> None:
        hot = self.hot
        self.queue[rows, :hot] = lru.to(torch.int16)
        pos = torch.empty(lru.shape, dtype=torch.int32, device=self.queue_pos.device)
        pos.scatter_(1, lru.long(), torch.arange(hot, dtype=torch.int32, device=pos.device).expand_as(pos).contiguous())
        self.queue_pos[rows, :hot] = pos
        self.queue_pos[rows, hot] = 0
        self.queue_pos[rows, hot + 1] = hot

    def lru_order(self, row: int) -> list[int]:
        """Row ``row``'s LRU order (least recently used first): what the scanning kernel's
        ``lru_slots[row]`` holds after the same steps. A host sync (tests and snapshots)."""
        hot = self.hot
        queue, pos = self.queue[row].tolist(), self.queue_pos[row].tolist()
        return [queue[j] for j in range(pos[hot], pos[hot + 1]) if 0 <= queue[j] < hot and pos[queue[j]] == j]

    def agrees_with(self, row: int, device_buffer_tokens: torch.Tensor) -> bool:
        """Whether row ``row``'s ``slot_of`` is the inverse of ``device_buffer_tokens[row, :H]`` and its
        queue names every slot exactly once (a host sync; tests and snapshots)."""
        hot, max_len = self.hot, self.slot_of.shape[1]
        tokens = device_buffer_tokens[row, :hot].tolist()
        expected = {t: s for s, t in enumerate(tokens) if 0 <= t < max_len}
        got = {t: s for t, s in enumerate(self.slot_of[row].tolist()) if s != -1}
        return got == expected and sorted(self.lru_order(row)) == list(range(hot))


def check_resident_index_on_device(index: ResidentIndex, rows: torch.Tensor,
                                   device_buffer_tokens: torch.Tensor) -> None:
    """Check that ``index`` agrees with ``device_buffer_tokens`` on request ``rows`` (the slow-path rows
    of a step, from :func:`~sparsekv.jit_kernel.hisparse.check_swap_in_on_device`), with torch on the
    tables' own device: the CUDA path of the indexed swap-in with ``SPARSEKV_CHECK_INDICES=1`` (a few
    host syncs). The C++ entry checks host-readable tables the same way (``validate_resident_index``
    in ``csrc/hisparse_index.cuh``, same messages), row by row; here each rule goes over every row in
    the order below: ``slot_of`` is the inverse of the held tokens, the queue's head and tail lie in
    ``[0, 2 H]``, and each slot's queue position is a live entry naming it. Tables of the wrong dtype,
    shape or device are left to the entry, which names them.

    Raises
    ------
    ValueError
        The index is out of step with the tables (rebuild it: :meth:`ResidentIndex.rebuild_rows`).
    """
    hot, max_len = index.hot, index.slot_of.shape[-1]
    if not (index.slot_of.dtype == index.queue.dtype == torch.int16 and index.queue_pos.dtype == torch.int32
            and index.slot_of.dim() == index.queue.dim() == index.queue_pos.dim() == 2
            and index.slot_of.shape[0] == index.queue.shape[0] == index.queue_pos.shape[0]
            == device_buffer_tokens.shape[0] and index.queue.shape[1] == 2 * hot
            and index.queue_pos.shape[1] == hot + 2 and device_buffer_tokens.shape[1] > hot
            and index.slot_of.device == index.queue.device == index.queue_pos.device == rows.device):
        return
    slot_of, tokens = index.slot_of[rows].long(), device_buffer_tokens[rows, :hot].long()
    listed = slot_of != -1
    positions = torch.arange(max_len, device=rows.device)
    owner = tokens.gather(1, torch.where((slot_of >= 0) & (slot_of < hot), slot_of, 0))
    bad = first_true(listed & ((slot_of < 0) | (slot_of >= hot) | (owner != positions)))
    if bad is not None:
        r, tok = bad
        raise ValueError(f"sparsekv: argument `slot_of`[{int(rows[r])}, {tok}] = {int(slot_of[r, tok])} disagrees "
                         f"with `device_buffer_tokens` (rebuild the resident index)")
    indexed, held = listed.sum(dim=1), ((tokens >= 0) & (tokens < max_len)).sum(dim=1)
    bad = first_true(indexed != held)
    if bad is not None:
        (r,) = bad
        raise ValueError(f"sparsekv: argument `slot_of`[{int(rows[r])}] indexes {int(indexed[r])} tokens but "
                         f"`device_buffer_tokens` holds {int(held[r])} (rebuild the resident index)")
    pos = index.queue_pos[rows].long()
    head, tail = pos[:, hot : hot + 1], pos[:, hot + 1 : hot + 2]
    bad = first_true(((head < 0) | (head > tail) | (tail > 2 * hot))[:, 0])
    if bad is not None:
        (r,) = bad
        raise ValueError(f"sparsekv: argument `queue_pos`[{int(rows[r])}] has head {int(head[r])} and tail "
                         f"{int(tail[r])}, outside 0 <= head <= tail <= {2 * hot}")
    pos = pos[:, :hot]
    live = (pos >= head) & (pos < tail)
    named = index.queue[rows].long().gather(1, torch.where(live, pos, 0))
    bad = first_true(~live | (named != torch.arange(hot, device=rows.device)))
    if bad is not None:
        r, slot = bad
        raise ValueError(f"sparsekv: argument `queue_pos`[{int(rows[r])}, {slot}] = {int(pos[r, slot])} is not a live "
                         f"queue entry of slot {slot}")

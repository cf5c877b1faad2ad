"""HiSparse swap-in and miss-plan replay (kernels in ``csrc/hisparse.cuh``).

HiSparse keeps each request's whole (compressed) KV in host memory and a hot buffer of ``H`` slots
(+ one reserved page) on the device. Every decode step and layer, :func:`load_cache_to_device_buffer_mla`
resolves the indexer's top-k positions against the hot buffer: hits are reused, misses evict the
least-recently-used slots and are copied host -> device by the same kernel. The full contract is at
the top of the header; the policy, restated as plain Python, is
:mod:`sparsekv.testing.hisparse_policy`.

The DSV4 token and page copies of :mod:`sparsekv.jit_kernel.hisparse_copy` are re-exported here
(``transfer_cache_dsv4_mla``, ``transfer_pages_dsv4_mla``), so the whole HiSparse kernel surface is
one import.
"""

from __future__ import annotations

import functools

import torch

from sparsekv import env
from sparsekv.jit_kernel.hisparse_copy import transfer_cache_dsv4_mla, transfer_pages_dsv4_mla
from sparsekv.jit_kernel.registry import KernelFamily, backend_of, register

__all__ = [
    "COUNTERS",
    "DSV4_C4",
    "DSV4_PAGE_SLOTS",
    "LINEAR",
    "PLANNED",
    "SWAP_IN",
    "copy_cache_planned_mla",
    "load_cache_to_device_buffer_dsv4_mla",
    "load_cache_to_device_buffer_mla",
    "resolve_block_size",
    "swap_in_module",
    "transfer_cache_dsv4_mla",
    "transfer_pages_dsv4_mla",
]

LINEAR = "sparsekv::hisparse::LinearRows"
DSV4_C4 = "sparsekv::hisparse::Dsv4C4"
#: Token slots per page of the DSV4 C4 layout (both the host and the device cache).
DSV4_PAGE_SLOTS = 64

SWAP_IN = register(
    KernelFamily(
        name="hisparse",
        header="hisparse.cuh",
        exports={
            "load_cache_to_device_buffer": "sparsekv::hisparse::load_cache_to_device_buffer",
            "check_load_cache_indices": "sparsekv::hisparse::check_load_cache_indices",
        },
        kernels=("sparsekv::hisparse::SwapIn",),
        params=("num_top_k", "hot_buffer_size", "block_size", "layout"),
        instances=(
            # Small shapes for the tests (odd sizes, hash collisions, H close to K).
            (5, 7, 64, LINEAR),
            (5, 7, 64, DSV4_C4),
            # DSV4-Flash (index_topk 512) and DSV4-Pro (1024) with the default hot buffer of 2 * top-k.
            (512, 1024, 512, DSV4_C4),
            (1024, 2048, 1024, DSV4_C4),
            # Generic MLA (DSA / GLM-class top-k 2048) and the benchmark's small case.
            (512, 1024, 512, LINEAR),
            (2048, 4096, 1024, LINEAR),
        ),
    )
)

PLANNED = register(
    KernelFamily(
        name="hisparse_planned",
        header="hisparse.cuh",
        exports={"copy_cache_planned": "sparsekv::hisparse::copy_cache_planned"},
        kernels=("sparsekv::hisparse::CopyPlanned",),
        params=("layout",),
        instances=((LINEAR,), (DSV4_C4,)),
    )
)

#: Counter slots of the optional ``counters`` tensor.
COUNTERS = ("hits", "misses", "bytes")


@functools.cache
def _absent(dtype: torch.dtype) -> torch.Tensor:
    # A 0-dim tensor tells the C++ entry that an optional argument was omitted (never a real value:
    # every optional argument is 1-D or 2-D). Cached, so the hot path allocates nothing.
    return torch.empty((), dtype=dtype)


def _layout(is_dsv4_layout: bool) -> str:
    return DSV4_C4 if is_dsv4_layout else LINEAR


@functools.cache
def resolve_block_size(num_top_k: int, hot_buffer_size: int, is_dsv4_layout: bool, block_size: int | None) -> int:
    """The block size of the table entry for ``(num_top_k, hot_buffer_size, layout)``, or ``block_size``.

    Raises
    ------
    ValueError
        ``hot_buffer_size < num_top_k``, either is outside ``[1, 32768)``, or no table entry matches.
    """
    for name, value in (("num_top_k", num_top_k), ("hot_buffer_size", hot_buffer_size)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 32768:
            raise ValueError(f"sparsekv: argument `{name}` must be an int in [1, 32768), got {value!r}")
    if hot_buffer_size < num_top_k:
        raise ValueError(f"sparsekv: argument `hot_buffer_size` ({hot_buffer_size}) must be >= `num_top_k` "
                         f"({num_top_k})")
    layout = _layout(is_dsv4_layout)
    if block_size is not None:
        return block_size
    for k, h, block, lay in SWAP_IN.instances:
        if (k, h, lay) == (num_top_k, hot_buffer_size, layout):
            return block
    raise ValueError(
        f"sparsekv: hisparse has no instance for num_top_k={num_top_k}, hot_buffer_size={hot_buffer_size}, "
        f"layout={'dsv4' if is_dsv4_layout else 'generic'}; supported: "
        f"{[SWAP_IN.describe(i) for i in SWAP_IN.instances]}"
    )


def swap_in_module(num_top_k: int, hot_buffer_size: int, *, is_dsv4_layout: bool = False,
                   block_size: int | None = None, backend: str = "cpu"):
    """The compiled swap-in module for one table entry (built at first use)."""
    block = resolve_block_size(num_top_k, hot_buffer_size, is_dsv4_layout, block_size)
    return SWAP_IN.module(num_top_k, hot_buffer_size, block, _layout(is_dsv4_layout), backend=backend)


def _load(is_dsv4_layout, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
          device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k,
          hot_buffer_size, num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size) -> None:
    plan = (miss_src, miss_dst, miss_count)
    if any(t is None for t in plan) and not all(t is None for t in plan):
        raise ValueError("sparsekv: arguments `miss_src`, `miss_dst` and `miss_count` go together: pass all or none")
    backend = backend_of(top_k_tokens)
    module = swap_in_module(num_top_k, hot_buffer_size, is_dsv4_layout=is_dsv4_layout, block_size=block_size,
                            backend=backend)
    args = [top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
            top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes,
            _absent(torch.int32) if num_real_reqs is None else num_real_reqs,
            _absent(torch.int64) if miss_src is None else miss_src,
            _absent(torch.int64) if miss_dst is None else miss_dst,
            _absent(torch.int32) if miss_count is None else miss_count,
            _absent(torch.int64) if counters is None else counters]
    if env.check_indices():
        # Debug mode: every index is followed on the host before the kernel runs. On the GPU that
        # means host copies of the tables (a sync); the caches are only measured, so they are
        # replaced by zero-copy stand-ins of the same shape.
        if backend == "cpu":
            module.check_load_cache_indices(*args)
        else:
            host_args = [_stand_in(a) if i in (4, 5) else a.cpu() if isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args)]
            swap_in_module(num_top_k, hot_buffer_size, is_dsv4_layout=is_dsv4_layout, block_size=block_size,
                           backend="cpu").check_load_cache_indices(*host_args)
    module.load_cache_to_device_buffer(*args)


def _stand_in(cache: torch.Tensor) -> torch.Tensor:
    """A host tensor with ``cache``'s shape, dtype and a unit last stride, backed by one row."""
    return torch.empty((1, cache.shape[-1]), dtype=cache.dtype).expand(cache.shape) if cache.dim() == 2 else cache.cpu()


def load_cache_to_device_buffer_mla(
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    item_size_bytes: int,
    num_top_k: int,
    hot_buffer_size: int,
    *,
    num_real_reqs: torch.Tensor | None = None,
    miss_src: torch.Tensor | None = None,
    miss_dst: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    block_size: int | None = None,
) -> None:
    """Resolve one layer's top-k against the per-request hot buffers; load the misses host -> device.

    For each batch row ``b`` (request row ``rid = req_pool_indices[b]``, ``n = seq_lens[b]``,
    ``K = num_top_k``, ``H = hot_buffer_size``), writes ``top_k_device_locs[b]``:

    * ``b >= num_real_reqs[0]`` (CUDA-graph padding): all -1, miss count 0, tables untouched.
    * ``n <= H`` (fast path, slot = position): ``device_buffer_locs[rid, tok]`` for ``i < min(n, K)``
      and ``0 <= tok < n``, else -1; nothing else changes.
    * ``n > H``: entries outside ``[0, n)`` give -1; the newest token ``n - 1`` maps to column ``H``;
      a token held by a hot slot keeps it (hit); the m-th distinct missing token (top-k order) takes
      the m-th least-recently-used non-hit slot and its bytes are copied from
      ``host_cache[host_cache_locs[rid, tok]]``; repeated entries share a slot; ``lru_slots[rid]``
      becomes ``[unused non-hits | misses | hits]``.

    Parameters
    ----------
    top_k_tokens : torch.Tensor
        int32 ``[bs, K]``, token positions within each request (any row stride, unit last stride).
    device_buffer_tokens : torch.Tensor
        int32 ``[max_reqs, H + P]`` (``P >= 1``): token held by each hot slot, -1 = empty. Updated.
    host_cache_locs : torch.Tensor
        int64 ``[max_reqs, max_len]``, contiguous: host slot of each token position.
    device_buffer_locs : torch.Tensor
        int32, shape and row stride of ``device_buffer_tokens``: device slot of each hot slot;
        column ``H`` is the reserved newest-token slot.
    host_cache, device_buffer : torch.Tensor
        uint8 ``[slots, item_size_bytes]`` (unit last stride, any row stride). ``host_cache`` may be
        pinned host memory when the rest lives on the GPU.
    top_k_device_locs : torch.Tensor
        int32 ``[bs, K]``, output; must not share memory with ``top_k_tokens`` (the kernel reads
        the top-k again after writing it).
    req_pool_indices, seq_lens : torch.Tensor
        int32 or int64 ``[bs]``, contiguous.
    lru_slots : torch.Tensor
        int16 ``[max_reqs, H]``: hot-slot ids, least recently used first. Updated.
    item_size_bytes : int
        Bytes of one token.
    num_top_k, hot_buffer_size : int
        ``K`` and ``H``; ``(K, H)`` selects the kernel instance (:data:`SWAP_IN` table).
    num_real_reqs : torch.Tensor, optional
        int32 ``[1]``: rows at or beyond it are padding. Default: every row is real.
    miss_src, miss_dst, miss_count : torch.Tensor, optional
        The miss plan, all or none: int64 ``[bs, >= K]``, int64 or int32 ``[bs, >= K]``, int32 ``[bs]``;
        ``(miss_src[b, m], miss_dst[b, m])`` is the (host slot, device slot) of the m-th miss.
    counters : torch.Tensor, optional
        int64 ``[3]``: ``(hits, misses, bytes)`` added to on the device, without a host sync.
    block_size : int, optional
        GPU threads per request; default from the instantiation table.

    Raises
    ------
    TypeError
        A tensor has the wrong dtype (the message names it).
    ValueError
        Wrong shape, stride or device; ``top_k_device_locs`` sharing memory with ``top_k_tokens``;
        ``H < K``; an unsupported ``(K, H)``.
    IndexError
        With ``SPARSEKV_CHECK_INDICES=1``: an index the kernel would follow is out of range (checked
        before anything is written; ``ValueError`` for an LRU row that is not a permutation or a
        request named by two real rows). Without it the kernel skips such entries instead of faulting.
    """
    _load(False, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
          top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k, hot_buffer_size,
          num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size)


def load_cache_to_device_buffer_dsv4_mla(
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    top_k_device_locs: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    item_size_bytes: int,
    num_top_k: int,
    hot_buffer_size: int,
    *,
    num_real_reqs: torch.Tensor | None = None,
    miss_src: torch.Tensor | None = None,
    miss_dst: torch.Tensor | None = None,
    miss_count: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    block_size: int | None = None,
) -> None:
    """:func:`load_cache_to_device_buffer_mla` for the DSV4 C4 layout, paged on both sides.

    Differences: ``host_cache`` and ``device_buffer`` are uint8 ``[pages, 37440]`` page rows of 64
    token slots (value records, then scale records; :mod:`sparsekv.jit_kernel.kv_layout` ``V4``);
    slot ``s`` is page ``s // 64``, offset ``s % 64``; ``item_size_bytes`` must be 584;
    ``device_buffer_tokens`` / ``device_buffer_locs`` are ``[max_reqs, H + 64]``. ``top_k_tokens``
    and ``seq_lens`` are compressed (C4) positions and lengths.
    """
    _load(True, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
          top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k, hot_buffer_size,
          num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size)


def copy_cache_planned_mla(
    *,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    num_real_reqs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    item_size_bytes: int,
    is_dsv4_layout: bool = False,
) -> None:
    """Replay a recorded miss plan into another layer's buffers (layers sharing one top-k index).

    For ``b < num_real_reqs[0]`` and ``m < miss_count[b]``: the token at host slot ``miss_src[b, m]``
    is copied to device slot ``miss_dst[b, m]``. The slot and LRU tables are the anchor layer's, so
    nothing but ``device_buffer`` changes. Entries with an out-of-range slot are skipped.

    Parameters
    ----------
    miss_src, miss_dst, miss_count : torch.Tensor
        The plan recorded by the swap-in: int64 ``[bs, W]``, int64 or int32 ``[bs, W]``, int32 ``[bs]``.
    num_real_reqs : torch.Tensor
        int32 ``[1]``, on the device.
    host_cache, device_buffer : torch.Tensor
        This layer's caches, as for the swap-in of the same layout.
    item_size_bytes : int
        Bytes of one token (584 for DSV4).
    is_dsv4_layout : bool
        DSV4 C4 paged addressing on both sides.

    Raises
    ------
    TypeError, ValueError
        Wrong dtype, shape, stride or device (the message names the argument).
    """
    backend = backend_of(miss_src)
    module = PLANNED.module(_layout(is_dsv4_layout), backend=backend)
    module.copy_cache_planned(miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer,
                              item_size_bytes)

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
from sparsekv.checks import int_in
from sparsekv.jit_kernel.build.registry import KernelFamily, backend_of, register
from sparsekv.jit_kernel.hisparse_copy import transfer_cache_dsv4_mla, transfer_pages_dsv4_mla
from sparsekv.jit_kernel.hisparse_index import ResidentIndex, indexed_module
from sparsekv.jit_kernel.hisparse_params import (
    LAYOUTS,
    SHARED_MEMORY_LIMIT,
    SWAP_IN_POLICIES,
    WARP,
    check_block_size,
    check_protections,
    default_block_size,
    layout_type,
    log2_ceil,
    near_bucket_bytes,
    policy_protections,
)
from sparsekv.jit_kernel.torch_op import kernel_op
from sparsekv.kv_layout import C4_PAGE_SLOTS, V4

__all__ = [
    "CHECK_ONLY",
    "CHECK_THEN_RUN",
    "COUNTERS",
    "LAYOUTS",
    "PLANNED",
    "RUN",
    "SHARED_MEMORY_LIMIT",
    "SWAP_IN",
    "SWAP_IN_ARGS",
    "SWAP_IN_POLICIES",
    "copy_cache_planned_mla",
    "default_block_size",
    "host_check_args",
    "load_cache_to_device_buffer_dsv4_mla",
    "load_cache_to_device_buffer_mla",
    "policy_protections",
    "swap_in_args",
    "swap_in_entry",
    "swap_in_module",
    "swap_in_shared_bytes",
    "transfer_cache_dsv4_mla",
    "transfer_pages_dsv4_mla",
]

_MAX_SLOTS = 32768  # slot ids are int16


def swap_in_shared_bytes(num_top_k: int, hot_buffer_size: int, block_size: int, protect_recent: int = 0,
                         protect_near: int = 0) -> int:
    """Bytes of ``SwapIn<K, H, BlockSize, Layout, W, S>::Shared``, the per-request scratch in shared memory.

    With ``T = 2 ** ceil(log2(2 K))`` hash cells: ``align4(10 T + 2 H + 2 K) + 4 (BlockSize / 32) + 4``
    (int32 key + int32 first index + int16 slot per cell, int16 LRU and miss arrays, one int32 per
    warp and a copy counter), plus ``align4(6 H)`` for a protected policy (three int16 arrays of H:
    the victim order, the protected slots, the victim ranks) and :func:`near_bucket_bytes` when
    ``S > 0``. ``tests/kernels/test_hisparse.py`` pins it to the C++ ``sizeof``.
    """
    cells = 1 << log2_ceil(2 * num_top_k)
    arrays = 10 * cells + 2 * hot_buffer_size + 2 * num_top_k
    protect = -(-6 * hot_buffer_size // 4) * 4 if protect_recent or protect_near else 0
    return protect + near_bucket_bytes(num_top_k, protect_near) + -(-arrays // 4) * 4 + 4 * (block_size // WARP) + 4


def _complete_swap_in(*, num_top_k: int, hot_buffer_size: int, layout: str = "generic", page_slots: int | None = None,
                      block_size: int | None = None, protect_recent: int = 0, protect_near: int = 0) -> tuple:
    """``SwapIn<K, H, BlockSize, Layout[, ProtectRecent, ProtectNear]>`` arguments: checks the ranges,
    derives the block size, and bounds ``(K, H)`` by the shared memory the GPU path's per-request
    scratch needs. LRU (both protections 0) keeps the four-argument form."""
    k = int_in(num_top_k, "num_top_k", 1, _MAX_SLOTS - 1, why="int16 slot ids", owner="hisparse")
    h = int_in(hot_buffer_size, "hot_buffer_size", k, _MAX_SLOTS - 1, why="at least num_top_k; int16 slot ids",
               owner="hisparse")
    block = check_block_size("hisparse", block_size, k)
    recent, near = check_protections("hisparse", protect_recent, protect_near)
    need = swap_in_shared_bytes(k, h, block, recent, near)
    if need > SHARED_MEMORY_LIMIT:
        raise ValueError(
            f"sparsekv: hisparse num_top_k={k}, hot_buffer_size={h} need {need} bytes of per-request scratch "
            f"(10 * 2**ceil(log2(2 * num_top_k)) + 2 * hot_buffer_size + 2 * num_top_k + ..., + 6 * "
            f"hot_buffer_size for a protected policy, + 12 * 2**ceil(log2(2 * num_top_k)) with protect_near), over the "
            f"{SHARED_MEMORY_LIMIT} bytes (227 KiB) of shared memory a GPU block can have on sm_90/sm_100; "
            f"lower num_top_k or hot_buffer_size")
    layout_struct = layout_type("hisparse", layout, page_slots)
    return (k, h, block, layout_struct) if recent == near == 0 else (k, h, block, layout_struct, recent, near)


def _complete_planned(*, layout: str = "generic", page_slots: int | None = None) -> tuple:
    """``CopyPlanned<Layout>`` arguments."""
    return (layout_type("hisparse_planned", layout, page_slots),)


SWAP_IN = register(
    KernelFamily(
        name="hisparse",
        header="hisparse.cuh",
        exports={"load_cache_to_device_buffer": "sparsekv::hisparse::load_cache_to_device_buffer",
                 "load_cache_to_device_buffer_speculative":
                     "sparsekv::hisparse::load_cache_to_device_buffer_speculative"},
        kernels=("sparsekv::hisparse::SwapIn",),
        params=("num_top_k", "hot_buffer_size", "layout", "page_slots", "block_size", "protect_recent",
                "protect_near"),
        complete=_complete_swap_in,
        instances=(
            # Small shapes for the tests (odd sizes, hash collisions, H close to K).
            {"num_top_k": 5, "hot_buffer_size": 7, "layout": "generic"},
            {"num_top_k": 5, "hot_buffer_size": 7, "layout": "dsv4", "page_slots": 64},
            # DSV4-Flash (index_topk 512) and DSV4-Pro (1024) with the default hot buffer of 2 * top-k.
            {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "dsv4", "page_slots": 64},
            {"num_top_k": 1024, "hot_buffer_size": 2048, "layout": "dsv4", "page_slots": 64},
            # Generic MLA (DSA / GLM-class top-k 2048) and the benchmark's small case.
            {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "generic"},
            {"num_top_k": 2048, "hot_buffer_size": 4096, "layout": "generic"},
            # The protected policies on the test shape (its windows scaled down) and on DSV4-Flash.
            {"num_top_k": 5, "hot_buffer_size": 7, "layout": "generic", "protect_recent": 3, "protect_near": 1},
            {"num_top_k": 512, "hot_buffer_size": 1024, "layout": "dsv4", "page_slots": 64, "protect_recent": 256,
             "protect_near": 16},
        ),
    )
)

PLANNED = register(
    KernelFamily(
        name="hisparse_planned",
        header="hisparse.cuh",
        exports={"copy_cache_planned": "sparsekv::hisparse::copy_cache_planned"},
        kernels=("sparsekv::hisparse::CopyPlanned",),
        params=("layout", "page_slots"),
        complete=_complete_planned,
        instances=({"layout": "generic"},) + tuple({"layout": "dsv4", "page_slots": p} for p in C4_PAGE_SLOTS),
    )
)

#: Counter slots of the optional ``counters`` tensor.
COUNTERS = ("hits", "misses", "bytes")


def _layout_values(is_dsv4_layout: bool, page_slots: int | None) -> dict:
    return {"layout": "dsv4", "page_slots": page_slots} if is_dsv4_layout else {"layout": "generic"}


def swap_in_module(num_top_k: int, hot_buffer_size: int, *, is_dsv4_layout: bool = False,
                   page_slots: int | None = None, block_size: int | None = None, backend: str = "cpu",
                   protect_recent: int = 0, protect_near: int = 0):
    """The compiled swap-in module for ``(K, H)``, a layout and a policy (built at first use, any
    valid values).

    ``page_slots`` (dsv4 only) defaults to 64, the C4 page of full-token page size 256.
    ``protect_recent`` / ``protect_near``: the policy's template arguments (:data:`SWAP_IN_POLICIES`).

    Raises
    ------
    ValueError
        Values outside the family's limits (see :data:`SWAP_IN`), before anything compiles.
    """
    if is_dsv4_layout and page_slots is None:
        page_slots = 64
    protect = {"protect_recent": protect_recent, "protect_near": protect_near} if protect_recent or protect_near \
        else {}
    return SWAP_IN.module(num_top_k=num_top_k, hot_buffer_size=hot_buffer_size, block_size=block_size,
                          backend=backend, **_layout_values(is_dsv4_layout, page_slots), **protect)


_SLOTS_OF_PAGE_BYTES = {V4.page_bytes(p): p for p in C4_PAGE_SLOTS}


def _page_slots(is_dsv4_layout: bool, page_slots: int | None, device_buffer: torch.Tensor) -> int | None:
    """The C4 page-slot count: as given, else read off the device buffer's page-row bytes (each of
    :data:`~sparsekv.kv_layout.C4_PAGE_SLOTS` has its own page size); 64 when the row
    matches none, so the C++ entry names the wrong row size."""
    if not is_dsv4_layout or page_slots is not None:
        return page_slots
    return _SLOTS_OF_PAGE_BYTES.get(device_buffer.shape[-1] if device_buffer.dim() == 2 else -1, 64)


#: ``index_check`` modes of the C++ entries (``IndexCheck`` in ``csrc/include/sparsekv/ffi.h``).
RUN, CHECK_ONLY, CHECK_THEN_RUN = 0, 1, 2

#: Positional arguments of the C++ swap-in entry, in order (see :func:`swap_in_args`).
SWAP_IN_ARGS = ("top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs", "host_cache",
                "device_buffer", "top_k_device_locs", "req_pool_indices", "seq_lens", "lru_slots", "item_size_bytes",
                "num_real_reqs", "miss_src", "miss_dst", "miss_count", "counters", "index_check")


def swap_in_args(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
                 top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, *, num_real_reqs=None,
                 miss_src=None, miss_dst=None, miss_count=None, counters=None, index_check: int = RUN) -> list:
    """The argument list of the C++ entry ``load_cache_to_device_buffer`` (the one place its order is
    written: the wrapper, the tests and the benchmark all build it here). Optional tensors stay None."""
    return [top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
            top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_real_reqs, miss_src,
            miss_dst, miss_count, counters, index_check]


def host_check_args(args: list, index_check: int = CHECK_ONLY) -> list:
    """``args`` for the index-check pass of the cpu build: host copies of the tables and one-row
    stand-ins of the two caches (the pass reads only their shapes), with ``index_check`` set. The
    indexed entry's arguments too (its extra tables come after the caches)."""
    out = []
    caches = (SWAP_IN_ARGS.index("host_cache"), SWAP_IN_ARGS.index("device_buffer"))
    for i, value in enumerate(args):
        if i in caches:
            value = _stand_in(value)
        elif isinstance(value, torch.Tensor):
            value = value.cpu()
        out.append(value)
    out[-1] = index_check
    return out


def _stand_in(cache: torch.Tensor) -> torch.Tensor:
    """A host tensor with ``cache``'s shape, dtype and a unit last stride, backed by one row."""
    return torch.empty((1, cache.shape[-1]), dtype=cache.dtype).expand(cache.shape) if cache.dim() == 2 else cache.cpu()


def swap_in_entry(module, speculative: bool):
    """The C++ entry of a compiled swap-in module: the plain one (every real row its own request)
    or the speculative one (rows of one request served together, in batch order)."""
    if not isinstance(speculative, bool):
        raise TypeError(f"sparsekv: argument `speculative` must be a bool, got {speculative!r}")
    return module.load_cache_to_device_buffer_speculative if speculative else module.load_cache_to_device_buffer


def _load(is_dsv4_layout, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
          device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k,
          hot_buffer_size, num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size, page_slots,
          speculative, resident_index, policy) -> None:
    """Checks the Python-object arguments and unpacks the resident index into the op's tensors."""
    if not isinstance(speculative, bool):
        raise TypeError(f"sparsekv: argument `speculative` must be a bool, got {speculative!r}")
    protect_recent, protect_near = policy_protections(policy)
    index = (None, None, None)
    if resident_index is not None:
        if not isinstance(resident_index, ResidentIndex):
            raise TypeError(f"sparsekv: argument `resident_index` must be a ResidentIndex or None, got "
                            f"{type(resident_index).__name__}")
        index = (resident_index.slot_of, resident_index.queue, resident_index.queue_pos)
    _swap_in(is_dsv4_layout, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
             device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k,
             hot_buffer_size, num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size, page_slots,
             speculative, *index, protect_recent, protect_near)


@kernel_op("load_cache_to_device_buffer", mutates_args=(
    "device_buffer_tokens", "device_buffer", "top_k_device_locs", "lru_slots", "miss_src", "miss_dst", "miss_count",
    "counters", "index_slot_of", "index_queue", "index_queue_pos"))
def _swap_in(is_dsv4_layout: bool, top_k_tokens: torch.Tensor, device_buffer_tokens: torch.Tensor,
             host_cache_locs: torch.Tensor, device_buffer_locs: torch.Tensor, host_cache: torch.Tensor,
             device_buffer: torch.Tensor, top_k_device_locs: torch.Tensor, req_pool_indices: torch.Tensor,
             seq_lens: torch.Tensor, lru_slots: torch.Tensor, item_size_bytes: int, num_top_k: int,
             hot_buffer_size: int, num_real_reqs: torch.Tensor | None, miss_src: torch.Tensor | None,
             miss_dst: torch.Tensor | None, miss_count: torch.Tensor | None, counters: torch.Tensor | None,
             block_size: int | None, page_slots: int | None, speculative: bool, index_slot_of: torch.Tensor | None,
             index_queue: torch.Tensor | None, index_queue_pos: torch.Tensor | None, protect_recent: int = 0,
             protect_near: int = 0) -> None:
    """Every swap-in variant (layout, speculative rows, resident index) as the custom op
    ``sparsekv::load_cache_to_device_buffer``."""
    backend = backend_of(top_k_tokens)
    page_slots = _page_slots(is_dsv4_layout, page_slots, device_buffer)
    args = swap_in_args(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
                        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes,
                        num_real_reqs=num_real_reqs, miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count,
                        counters=counters)
    compiled = swap_in_module
    if index_slot_of is not None:
        # The indexed entries take the index tables right after lru_slots.
        at = SWAP_IN_ARGS.index("lru_slots") + 1
        args[at:at] = [index_slot_of, index_queue, index_queue_pos]
        compiled = indexed_module
    compiled = functools.partial(compiled, protect_recent=protect_recent, protect_near=protect_near)

    def entry(on: str):
        return swap_in_entry(compiled(num_top_k, hot_buffer_size, is_dsv4_layout=is_dsv4_layout,
                                      page_slots=page_slots, block_size=block_size, backend=on), speculative)

    if env.check_indices():
        if backend == "cpu":
            args[-1] = CHECK_THEN_RUN
        else:
            # Debug mode on the GPU: the cpu build follows every index on host copies of the tables (a
            # sync) before the kernel runs; the caches are only measured, so they are stand-ins.
            entry("cpu")(*host_check_args(args))
    entry(backend)(*args)


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
    page_slots: int | None = None,
    speculative: bool = False,
    resident_index: ResidentIndex | None = None,
    policy: str = "lru",
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
        ``K`` and ``H``: any ``1 <= K <= H < 32768`` whose scratch fits shared memory; each new
        ``(K, H)`` compiles once at first use (:data:`SWAP_IN`).
    num_real_reqs : torch.Tensor, optional
        int32 ``[1]``: rows at or beyond it are padding. Default: every row is real.
    miss_src, miss_dst, miss_count : torch.Tensor, optional
        The miss plan, all or none: int64 ``[bs, >= K]``, int64 or int32 ``[bs, >= K]``, int32 ``[bs]``;
        ``(miss_src[b, m], miss_dst[b, m])`` is the (host slot, device slot) of the m-th miss.
    counters : torch.Tensor, optional
        int64 ``[3]``: ``(hits, misses, bytes)`` added to on the device, without a host sync.
    block_size : int, optional
        GPU threads per request (a multiple of 32 in [32, 1024]); default :func:`default_block_size`.
    page_slots : None
        Generic layout: must be None (see :func:`load_cache_to_device_buffer_dsv4_mla`).
    speculative : bool
        False (default): every real row names its own request; two real rows naming one request
        (which would race on its tables) are refused: ``ValueError`` for host-readable tables, and
        on the device, without a host sync, every such row comes out all -1 and changes nothing.
        True: the rows of one request (MTP draft tokens, speculative decoding) are served by one
        block in batch order, each on the tables the previous one left, which equals running them
        one call after another; a token several of them miss is loaded once, and each row's slots
        stay its own while the request's rows select at most ``H`` distinct tokens.
    resident_index : ResidentIndex, optional
        Selects the indexed kernel (:mod:`sparsekv.jit_kernel.hisparse_index`): hits by a direct
        map from position to slot, the LRU order in the index's queue, ``O(K)`` table work per step
        instead of ``O(H)``; the same results. ``lru_slots`` is then checked but neither read nor
        written (the order is :meth:`ResidentIndex.lru_order`). Default: the scanning kernel.
    policy : str
        The replacement policy, one of :data:`SWAP_IN_POLICIES`: ``"lru"`` (default, sglang's, as
        above), ``"recent_lru"`` or ``"near_lru"``: the misses take first the non-hit slots that
        are not protected, then the protected ones (a token in the last 256 positions, and for
        ``"near_lru"`` one within 16 positions of a requested token), each group in LRU order; the
        LRU order is updated as for LRU; or any ``(protect_recent, protect_near)`` pair (each pair
        compiles once). Either kernel, with the same results (the indexed one keeps its walk
        ``O(K)``: :mod:`~sparsekv.jit_kernel.hisparse_index`). ``tools/hisparse_sim.py`` compares
        them with Belady's optimum.

    Raises
    ------
    TypeError
        A tensor has the wrong dtype (the message names it).
    ValueError
        Wrong shape, stride or device; an argument the kernel writes (``top_k_device_locs``,
        ``device_buffer_tokens``, ``lru_slots``, ``device_buffer``, the plan, ``counters``) sharing
        memory with any other argument (the message names both); a 0-dim optional tensor;
        ``H < K``; ``(K, H)`` whose per-request scratch exceeds the GPU's 227 KiB of shared memory
        (:func:`swap_in_shared_bytes`; raised before anything compiles); two real rows naming one
        request without ``speculative`` (host-readable tables); an unknown ``policy``.
    IndexError
        With ``SPARSEKV_CHECK_INDICES=1``: an index the kernel would follow is out of range (checked
        before anything is written; ``ValueError`` for an LRU row that is not a permutation, a
        request named by two real rows, or a device slot named by two hot slots, which could receive
        two copies: distinct ``device_buffer_locs`` are otherwise the caller's duty). Without it the
        kernel skips out-of-range entries instead of faulting.
    """
    _load(False, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
          top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k, hot_buffer_size,
          num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size, page_slots, speculative,
          resident_index, policy)


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
    page_slots: int | None = None,
    speculative: bool = False,
    resident_index: ResidentIndex | None = None,
    policy: str = "lru",
) -> None:
    """:func:`load_cache_to_device_buffer_mla` for the DSV4 C4 layout, paged on both sides.

    Differences: ``host_cache`` and ``device_buffer`` are uint8 ``[pages, V4.page_bytes(P)]`` page
    rows of ``P = page_slots`` token slots (value records, then scale records;
    :mod:`sparsekv.kv_layout` ``V4``; 37,440 bytes for ``P = 64``); slot ``s`` is page
    ``s // P``, offset ``s % P``; ``item_size_bytes`` must be 584; ``device_buffer_tokens`` /
    ``device_buffer_locs`` are ``[max_reqs, H + P]``. ``top_k_tokens`` and ``seq_lens`` are
    compressed (C4) positions and lengths. ``page_slots`` is one of
    :data:`~sparsekv.kv_layout.C4_PAGE_SLOTS` (32, 64, 128 for full-token page sizes
    128, 256, 512); default: read off ``device_buffer``'s page-row bytes.
    """
    _load(True, top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
          top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_top_k, hot_buffer_size,
          num_real_reqs, miss_src, miss_dst, miss_count, counters, block_size, page_slots, speculative,
          resident_index, policy)


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
    page_slots: int | None = None,
) -> None:
    """Replay a recorded miss plan into another layer's buffers (layers sharing one top-k index).

    For ``b < num_real_reqs[0]`` and ``m < miss_count[b]``: the token at host slot ``miss_src[b, m]``
    is copied to device slot ``miss_dst[b, m]``. The slot and LRU tables are the anchor layer's, so
    nothing but ``device_buffer`` changes. Entries with an out-of-range slot (the swap-in records -1
    for a copy it skipped) are skipped, unless ``SPARSEKV_CHECK_INDICES=1`` rejects them.

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
    page_slots : int, optional
        DSV4 only: slots per C4 page, as for :func:`load_cache_to_device_buffer_dsv4_mla`.

    Raises
    ------
    TypeError, ValueError
        Wrong dtype, shape, stride or device (the message names the argument); ``device_buffer``
        sharing memory with another argument; a host-readable plan naming one device slot twice
        with different host slots (on the device, distinct destinations are the caller's duty).
    IndexError
        With ``SPARSEKV_CHECK_INDICES=1``: a planned entry out of range, negative ones included.
    """
    _copy_planned(miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer, item_size_bytes,
                  is_dsv4_layout, page_slots)


@kernel_op("copy_cache_planned_mla", mutates_args=("device_buffer",))
def _copy_planned(miss_src: torch.Tensor, miss_dst: torch.Tensor, miss_count: torch.Tensor, num_real_reqs: torch.Tensor,
                  host_cache: torch.Tensor, device_buffer: torch.Tensor, item_size_bytes: int, is_dsv4_layout: bool,
                  page_slots: int | None) -> None:
    backend = backend_of(miss_src)
    values = _layout_values(is_dsv4_layout, _page_slots(is_dsv4_layout, page_slots, device_buffer))
    module = PLANNED.module(backend=backend, **values)
    args = [miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer, item_size_bytes, RUN]
    if env.check_indices():
        if backend == "cpu":
            args[-1] = CHECK_THEN_RUN
        else:
            host = [_stand_in(a) if i in (4, 5) else a.cpu() if isinstance(a, torch.Tensor) else a
                    for i, a in enumerate(args[:-1])]
            PLANNED.module(backend="cpu", **values).copy_cache_planned(*host, CHECK_ONLY)
    module.copy_cache_planned(*args)

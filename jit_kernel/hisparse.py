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
import inspect

import torch

from sparsekv import env
from sparsekv.jit_kernel.build.registry import KernelFamily, backend_of, register
from sparsekv.jit_kernel.hisparse_copy import transfer_cache_dsv4_mla, transfer_pages_dsv4_mla
from sparsekv.jit_kernel.hisparse_index import INDEXED, ResidentIndex, check_resident_index_on_device
from sparsekv.jit_kernel.hisparse_params import (
    LAYOUTS,
    SHARED_MEMORY_LIMIT,
    SWAP_IN_PARAMS,
    SWAP_IN_POLICIES,
    WARP,
    default_block_size,
    layout_type,
    log2_ceil,
    near_bucket_bytes,
    policy_protections,
    swap_in_template_args,
)
from sparsekv.jit_kernel.torch_op import (
    check_no_conflicting_destinations,
    first_true,
    index_checks_on_device,
    kernel_op,
)
from sparsekv.kv_layout import C4_PAGE_SLOTS, V4

__all__ = [
    "CHECK_THEN_RUN",
    "COUNTERS",
    "LAYOUTS",
    "PLANNED",
    "RUN",
    "SHARED_MEMORY_LIMIT",
    "SWAP_IN",
    "SWAP_IN_ARGS",
    "SWAP_IN_POLICIES",
    "check_plan_on_device",
    "check_swap_in_on_device",
    "copy_cache_planned_mla",
    "default_block_size",
    "load_cache_to_device_buffer_dsv4_mla",
    "load_cache_to_device_buffer_mla",
    "policy_protections",
    "swap_in_args",
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


def _scratch_too_large(k: int, h: int, need: int) -> str:
    return (f"sparsekv: hisparse num_top_k={k}, hot_buffer_size={h} need {need} bytes of per-request scratch "
            f"(10 * 2**ceil(log2(2 * num_top_k)) + 2 * hot_buffer_size + 2 * num_top_k + ..., + 6 * "
            f"hot_buffer_size for a protected policy, + 12 * 2**ceil(log2(2 * num_top_k)) with protect_near), over the "
            f"{SHARED_MEMORY_LIMIT} bytes (227 KiB) of shared memory a GPU block can have on sm_90/sm_100; "
            f"lower num_top_k or hot_buffer_size")


#: ``SwapIn<K, H, BlockSize, Layout[, ProtectRecent, ProtectNear]>`` arguments (the scratch grows with ``H``).
_complete_swap_in = functools.partial(
    swap_in_template_args, "hisparse", slot_limit=_MAX_SLOTS, hot_why="at least num_top_k; int16 slot ids",
    shared_bytes=swap_in_shared_bytes, too_large=_scratch_too_large)


def _complete_planned(*, layout: str = "generic", page_slots: int | None = None) -> tuple:
    """``CopyPlanned<Layout>`` arguments."""
    return (layout_type("hisparse_planned", layout, page_slots),)


SWAP_IN = register(
    KernelFamily(
        name="hisparse",
        header="hisparse.cuh",
        exports={"load_cache_to_device_buffer": "sparsekv::hisparse::load_cache_to_device_buffer"},
        kernels=("sparsekv::hisparse::SwapIn",),
        params=SWAP_IN_PARAMS,
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


#: ``index_check`` modes of the C++ entries (``IndexCheck`` in ``csrc/include/sparsekv/ffi.h``) that the
#: wrappers pass: run, or validate every index then run (host-readable tables).
RUN, CHECK_THEN_RUN = 0, 1

#: Positional arguments of the C++ swap-in entry, in order (see :func:`swap_in_args`).
SWAP_IN_ARGS = ("top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs", "host_cache",
                "device_buffer", "top_k_device_locs", "req_pool_indices", "seq_lens", "lru_slots", "item_size_bytes",
                "num_real_reqs", "miss_src", "miss_dst", "miss_count", "counters", "index_check", "speculative")


def swap_in_args(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
                 top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_real_reqs=None,
                 miss_src=None, miss_dst=None, miss_count=None, counters=None, index_check: int = RUN,
                 speculative: bool = False) -> list:
    """The argument list of the C++ entry ``load_cache_to_device_buffer`` (the one place its order is
    written: the wrapper, the tests and the benchmark all build it here; the wrapper passes every
    argument by position, a keyword call costing a dict on the decode path). Optional tensors stay None."""
    return [top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache, device_buffer,
            top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes, num_real_reqs, miss_src,
            miss_dst, miss_count, counters, index_check, speculative]


def _load(
    is_dsv4_layout: bool,
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
    """Both public swap-ins (``is_dsv4_layout``: which): checks the Python-object arguments and unpacks the
    resident index into the op's tensors. The one place their arguments are written."""
    if type(speculative) is not bool:  # noqa: E721 - bool has no subclass
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
    page_slots = _page_slots(is_dsv4_layout, page_slots, device_buffer)
    args = swap_in_args(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
                        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots, item_size_bytes,
                        num_real_reqs, miss_src, miss_dst, miss_count, counters, RUN, speculative)
    family = SWAP_IN
    if index_slot_of is not None:
        # The indexed entries take the index tables right after lru_slots.
        at = SWAP_IN_ARGS.index("lru_slots") + 1
        args[at:at] = [index_slot_of, index_queue, index_queue_pos]
        family = INDEXED
    # swap_in_module's and indexed_module's instance, by position (SWAP_IN_PARAMS: both families' order).
    layout, layout_page_slots = ("dsv4", page_slots) if is_dsv4_layout else ("generic", None)
    module = family.module_for(top_k_tokens, num_top_k, hot_buffer_size, layout, layout_page_slots, block_size,
                               protect_recent, protect_near)
    on_device = index_checks_on_device(top_k_tokens)
    tables = (top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, req_pool_indices, seq_lens,
              lru_slots, num_real_reqs) if on_device else ()
    if on_device and _tables_fit(*tables, host_cache, device_buffer, num_top_k, hot_buffer_size):
        rows = check_swap_in_on_device(*tables, host_cache, device_buffer, hot_buffer_size=hot_buffer_size,
                                       page_slots=page_slots, speculative=speculative)
        if index_slot_of is not None and index_queue.dim() == 2 and index_queue.shape[1] == 2 * hot_buffer_size:
            check_resident_index_on_device(ResidentIndex(index_slot_of, index_queue, index_queue_pos), rows,
                                           device_buffer_tokens)
    elif not on_device and env.check_indices():
        args[-2] = CHECK_THEN_RUN  # index_check: host-readable tables, the entry checks every index itself
    module.load_cache_to_device_buffer(*args)


def _tables_fit(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, req_pool_indices, seq_lens,
                lru_slots, num_real_reqs, host_cache, device_buffer, num_top_k, hot_buffer_size) -> bool:
    """Whether the swap-in's tables have the dtypes, ranks, shapes and device its entry requires, so the
    device index check can read them; when not, the check is skipped and the entry names the argument."""
    tensors = [(top_k_tokens, (torch.int32,)), (device_buffer_tokens, (torch.int32,)),
               (device_buffer_locs, (torch.int32,)), (host_cache_locs, (torch.int64,)), (lru_slots, (torch.int16,)),
               (req_pool_indices, _INDEX_DTYPES), (seq_lens, _INDEX_DTYPES)]
    if num_real_reqs is not None:
        tensors.append((num_real_reqs, (torch.int32,)))
    rows, columns = device_buffer_tokens.shape if device_buffer_tokens.dim() == 2 else (-1, -1)
    return (all(t.dtype in dtypes and t.device == top_k_tokens.device for t, dtypes in tensors)
            and host_cache.dim() == device_buffer.dim() == 2
            and top_k_tokens.dim() == 2 and top_k_tokens.shape[1] == num_top_k
            and req_pool_indices.shape == seq_lens.shape == top_k_tokens.shape[:1]
            and device_buffer_locs.shape == (rows, columns) and columns > hot_buffer_size
            and lru_slots.shape == (rows, hot_buffer_size)
            and host_cache_locs.dim() == 2 and host_cache_locs.shape[0] == rows
            and (num_real_reqs is None or num_real_reqs.shape == (1,)))


_INDEX_DTYPES = (torch.int32, torch.int64)


def _index_error(name: str, row: int, col: int, value: int, limit: int, why: str) -> IndexError:
    # The words of the header's index_error.
    return IndexError(f"sparsekv: argument `{name}`[{row}, {col}] = {value} is out of range [0, {limit}) ({why})")


def _num_real(num_real_reqs: torch.Tensor | None, batch: int) -> int:
    """The real batch rows (a host sync), checked as the header's ``check_range`` does."""
    num_real = batch if num_real_reqs is None else int(num_real_reqs[0])
    if not 0 <= num_real <= batch:
        raise ValueError(f"sparsekv: argument `num_real_reqs` must be in [0, {batch}], got {num_real}")
    return num_real


def _slots(cache: torch.Tensor, page_slots: int | None) -> int:
    """Token slots of a host or device cache of the layout (``page_slots`` None: one per row)."""
    return cache.shape[0] * (page_slots or 1)


def check_swap_in_on_device(top_k_tokens: torch.Tensor, device_buffer_tokens: torch.Tensor,
                            host_cache_locs: torch.Tensor, device_buffer_locs: torch.Tensor,
                            req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, lru_slots: torch.Tensor,
                            num_real_reqs: torch.Tensor | None, host_cache: torch.Tensor, device_buffer: torch.Tensor,
                            *, hot_buffer_size: int, page_slots: int | None = None,
                            speculative: bool = False) -> torch.Tensor:
    """Validate every index the swap-in would follow, with torch on the tables' own device (the CUDA
    path with ``SPARSEKV_CHECK_INDICES=1``; a few host syncs). The C++ entry checks host-readable
    tables the same way (``validate_swap_in`` in ``csrc/include/sparsekv/swap_in.h``), with the same exception types
    and messages; where several entries are bad, each rule is checked over the whole batch in the
    order below, so the one named may differ from the entry's row-by-row walk.

    Of the real rows (``b < num_real_reqs[0]``): the request row is in range; no request is named
    twice unless ``speculative``; on the fast path (``n <= H``) each requested token's device slot is
    in range; on the slow path ``n`` fits ``host_cache_locs``, the LRU row is a permutation of
    ``0..H-1``, the device slots of columns ``0..H`` are in range, the host slot of each requested
    token that is neither the newest nor held is in range, and no device slot is named by two hot
    slots (columns ``0..H`` of the slow-path requests), which could receive two copies. The caches
    are only measured (``page_slots``: slots per page row, None for the generic layout).

    Returns
    -------
    torch.Tensor
        The request rows of the real slow-path batch rows, in batch order (what the resident-index
        check reads).

    Raises
    ------
    IndexError
        An index out of range (the message names the argument, position and value).
    ValueError
        ``num_real_reqs`` out of range, an LRU row that is not a permutation, a request named twice,
        or a device slot named twice.
    """
    hot, (max_reqs, _), max_len = hot_buffer_size, device_buffer_tokens.shape, host_cache_locs.shape[1]
    device_slots, host_slots = _slots(device_buffer, page_slots), _slots(host_cache, page_slots)
    num_real = _num_real(num_real_reqs, top_k_tokens.shape[0])
    rids = req_pool_indices[:num_real].long()
    bad = first_true((rids < 0) | (rids >= max_reqs))
    if bad is not None:
        raise _index_error("req_pool_indices", bad[0], 0, int(rids[bad[0]]), max_reqs, "a real batch row")
    # Row b repeats the request of an earlier row.
    again = torch.tril(rids[:, None] == rids[None, :], diagonal=-1).any(dim=1)
    twice = None if speculative else first_true(again)
    if twice is not None:
        raise ValueError(f"sparsekv: argument `req_pool_indices` names request row {int(rids[twice[0]])} twice among "
                         f"the real batch rows (rows of one request, such as MTP draft tokens, go through the "
                         f"speculative swap-in, which serves them in batch order)")
    n, top_k, locs = seq_lens[:num_real].long()[:, None], top_k_tokens[:num_real].long(), device_buffer_locs[rids]
    columns = torch.arange(top_k.shape[1], device=top_k.device)
    # Fast path: the slot of every requested token (tok < n <= H, inside the row).
    asked = (n <= hot) & (columns < n) & (top_k >= 0) & (top_k < n)
    slot = locs.gather(1, torch.where(asked, top_k, 0))
    bad = first_true(asked & ((slot < 0) | (slot >= device_slots)))
    if bad is not None:
        b, i = bad
        raise _index_error("device_buffer_locs", int(rids[b]), int(top_k[b, i]), int(slot[b, i]), device_slots,
                           "the slot of a requested token")
    slow = (n > hot)[:, 0]
    bad = first_true(slow & (n[:, 0] > max_len))
    if bad is not None:
        raise IndexError(f"sparsekv: argument `seq_lens`[{bad[0]}] = {int(n[bad[0]])} exceeds the columns of "
                         f"`host_cache_locs` ({max_len})")
    lru = lru_slots[rids].long()
    order = torch.sort(lru, dim=1, stable=True).indices
    repeated = torch.zeros_like(lru, dtype=torch.bool)
    repeated.scatter_(1, order[:, 1:], lru.gather(1, order[:, 1:]) == lru.gather(1, order[:, :-1]))
    bad = first_true(slow[:, None] & ((lru < 0) | (lru >= hot) | repeated))
    if bad is not None:
        b, j = bad
        raise ValueError(f"sparsekv: argument `lru_slots`[{int(rids[b])}] must be a permutation of 0..{hot - 1} "
                         f"(entry {j} = {int(lru[b, j])})")
    hot_locs = locs[:, : hot + 1].long()
    bad = first_true(slow[:, None] & ((hot_locs < 0) | (hot_locs >= device_slots)))
    if bad is not None:
        b, j = bad
        raise _index_error("device_buffer_locs", int(rids[b]), j, int(hot_locs[b, j]), device_slots, "a hot slot")
    # Slow path: the host slot of every requested token that is neither the newest nor held.
    held = torch.sort(device_buffer_tokens[rids, :hot], dim=1).values
    found = held.gather(1, torch.searchsorted(held, top_k.to(held.dtype)).clamp(max=hot - 1)) == top_k
    missing = slow[:, None] & (top_k >= 0) & (top_k < n - 1) & ~found
    host = host_cache_locs[rids].gather(1, torch.where(missing, top_k, 0))
    bad = first_true(missing & ((host < 0) | (host >= host_slots)))
    if bad is not None:
        b, i = bad
        raise _index_error("host_cache_locs", int(rids[b]), int(top_k[b, i]), int(host[b, i]), host_slots,
                           "the host slot of a missing token")
    # Distinct device slots over columns 0..H of the slow-path requests (each counted once), sorted
    # by (slot, request row) as the header pairs them.
    first = slow & ~again
    keys = torch.sort((hot_locs[first] * max_reqs + rids[first, None]).reshape(-1)).values
    twice = first_true(keys[1:] // max_reqs == keys[:-1] // max_reqs)
    if twice is not None:
        (k,) = twice
        raise ValueError(f"sparsekv: argument `device_buffer_locs` names device slot {int(keys[k]) // max_reqs} twice "
                         f"(request rows {int(keys[k]) % max_reqs} and {int(keys[k + 1]) % max_reqs}, columns "
                         f"0..hot_buffer_size): two misses could be copied onto one slot")
    return rids[slow]


def load_cache_to_device_buffer_mla(*args, **kwargs) -> None:
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
    try:
        _load(False, *args, **kwargs)
    except TypeError as error:
        _named_against(load_cache_to_device_buffer_mla, args, kwargs, error)


def load_cache_to_device_buffer_dsv4_mla(*args, **kwargs) -> None:
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
    try:
        _load(True, *args, **kwargs)
    except TypeError as error:
        _named_against(load_cache_to_device_buffer_dsv4_mla, args, kwargs, error)


def _named_against(public, args: tuple, kwargs: dict, error: TypeError) -> None:
    """Re-raise ``error``, a ``TypeError`` that ``_load(flag, *args, **kwargs)`` raised for a public swap-in:
    arguments that do not fit its signature are named against the public function, not ``_load``.
    Binding them only after a TypeError keeps the call path free of it (a ``try`` costs nothing)."""
    try:
        inspect.signature(public).bind(*args, **kwargs)
    except TypeError as unbound:
        raise TypeError(f"sparsekv: {public.__name__}(): {unbound}") from None
    raise error


# Both take _load's arguments after the layout flag: what help() and inspect show.
load_cache_to_device_buffer_mla.__signature__ = load_cache_to_device_buffer_dsv4_mla.__signature__ = \
    inspect.signature(_load).replace(parameters=tuple(inspect.signature(_load).parameters.values())[1:])


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
    on_device = index_checks_on_device(miss_src)
    if on_device and _plan_fits(miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer):
        check_plan_on_device(miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer,
                             page_slots=values.get("page_slots"))
    elif not on_device and env.check_indices():
        args[-1] = CHECK_THEN_RUN  # a host-readable plan: the entry checks every entry itself
    module.copy_cache_planned(*args)


def _plan_fits(miss_src, miss_dst, miss_count, num_real_reqs, host_cache, device_buffer) -> bool:
    """Whether a plan has the dtypes, ranks, shapes and device its entry requires (see :func:`_tables_fit`)."""
    tensors = [(miss_src, (torch.int64,)), (miss_dst, _INDEX_DTYPES), (miss_count, (torch.int32,)),
               (num_real_reqs, (torch.int32,))]
    return (all(t.dtype in dtypes and t.device == miss_src.device for t, dtypes in tensors)
            and miss_src.dim() == 2 and miss_dst.shape == miss_src.shape and miss_count.shape == miss_src.shape[:1]
            and num_real_reqs.shape == (1,) and host_cache.dim() == device_buffer.dim() == 2)


def check_plan_on_device(miss_src: torch.Tensor, miss_dst: torch.Tensor, miss_count: torch.Tensor,
                         num_real_reqs: torch.Tensor, host_cache: torch.Tensor, device_buffer: torch.Tensor, *,
                         page_slots: int | None = None) -> None:
    """Validate every entry of a recorded miss plan with torch on its own device (the CUDA path of
    :func:`copy_cache_planned_mla` with ``SPARSEKV_CHECK_INDICES=1``; a few host syncs), as the C++ entry
    checks a host-readable plan (``validate_plan`` in ``csrc/hisparse.cuh``, same messages): for the real
    rows, ``miss_count`` in ``[0, W]``; each planned ``(miss_src, miss_dst)`` in range, the first bad
    entry in row-major order named; no destination twice with different sources. The caches are only
    measured (``page_slots``: slots per page row, None for the generic layout).

    Raises
    ------
    IndexError
        A count or slot out of range (the message names the argument, position and value).
    ValueError
        ``num_real_reqs`` out of range, or a destination named twice with different sources.
    """
    width, host_slots, device_slots = miss_src.shape[1], _slots(host_cache, page_slots), _slots(device_buffer,
                                                                                              page_slots)
    num_real = _num_real(num_real_reqs, miss_src.shape[0])
    count = miss_count[:num_real].long()
    bad = first_true((count < 0) | (count > width))
    if bad is not None:
        raise _index_error("miss_count", bad[0], 0, int(count[bad[0]]), width + 1, "a plan row")
    planned = torch.arange(width, device=count.device) < count[:, None]
    src, dst = miss_src[:num_real], miss_dst[:num_real].long()
    bad_src, bad_dst = planned & ((src < 0) | (src >= host_slots)), planned & ((dst < 0) | (dst >= device_slots))
    bad = first_true(bad_src | bad_dst)
    if bad is not None:  # an entry's source is checked before its destination, as in the header
        b, m = bad
        if bool(bad_src[b, m]):
            raise _index_error("miss_src", b, m, int(src[b, m]), host_slots, "a planned copy")
        raise _index_error("miss_dst", b, m, int(dst[b, m]), device_slots, "a planned copy")
    check_no_conflicting_destinations(dst[planned], src[planned], "miss_dst", "miss_src")

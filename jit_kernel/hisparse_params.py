"""The template values the two HiSparse swap-in families share: layouts, block size, replacement policies.

The scanning swap-in (:mod:`sparsekv.jit_kernel.hisparse`, ``csrc/hisparse.cuh``) and the indexed
one (:mod:`sparsekv.jit_kernel.hisparse_index`, ``csrc/hisparse_index.cuh``) take the same
``layout`` / ``page_slots``, ``block_size`` and ``protect_recent`` / ``protect_near`` values and
check them the same way. Both wrappers import them from here, so neither imports the other for them.
"""

from __future__ import annotations

from collections.abc import Callable

from sparsekv.checks import as_int, int_in, one_of
from sparsekv.kv_layout import C4_PAGE_SLOTS

__all__ = [
    "LAYOUTS",
    "SHARED_MEMORY_LIMIT",
    "SWAP_IN_PARAMS",
    "SWAP_IN_POLICIES",
    "WARP",
    "check_block_size",
    "check_protections",
    "default_block_size",
    "layout_type",
    "log2_ceil",
    "near_bucket_bytes",
    "policy_protections",
    "swap_in_template_args",
]

#: Token layouts of the swap-in's caches: ``"generic"`` MLA rows, or ``"dsv4"`` C4 pages of V4 tokens.
LAYOUTS = ("generic", "dsv4")
#: The template parameters of both swap-in families (:func:`swap_in_template_args` completes them).
SWAP_IN_PARAMS = ("num_top_k", "hot_buffer_size", "layout", "page_slots", "block_size", "protect_recent",
                  "protect_near")
#: Shared memory one block may use on sm_90 / sm_100 (227 KiB): the bound on the GPU path's scratch.
SHARED_MEMORY_LIMIT = 227 * 1024
#: Threads of a GPU warp (the block size's unit and the scratch's per-warp counters).
WARP = 32
_MAX_PROTECT_NEAR = 4096  # the headers' bound: 2 S + 1 table lookups per non-hit slot

#: Replacement policies of the swap-in, both kernels: ``(protect_recent, protect_near)`` template
#: arguments. ``"lru"`` is sglang's; the protected ones evict the non-hit slots whose token lies in
#: the last ``protect_recent`` positions or within ``protect_near`` of a requested token only after
#: every other one (the model: ``sparsekv.testing.hisparse_policy.swap_in_step``; the simulator's
#: ``recent_lru`` and ``near_lru`` with the same numbers).
SWAP_IN_POLICIES = {"lru": (0, 0), "recent_lru": (256, 0), "near_lru": (256, 16)}


def log2_ceil(n: int) -> int:
    """``ceil(log2(n))`` for ``n >= 1`` (0 for 1): the headers' ``log2_ceil``."""
    return max(0, (n - 1).bit_length())


def default_block_size(num_top_k: int) -> int:
    """GPU threads per request: the power of two covering ``num_top_k``, clamped to ``[64, 1024]``."""
    return min(1024, max(64, 1 << log2_ceil(num_top_k)))


def near_bucket_bytes(num_top_k: int, protect_near: int) -> int:
    """Bytes of the headers' ``NearBuckets<T, S>`` (both kernels' scratch under a policy with
    ``protect_near = S > 0``): three int32 per hash cell, ``12 T`` with ``T = 2 ** ceil(log2(2 K))``."""
    return 12 * (1 << log2_ceil(2 * num_top_k)) if protect_near > 0 else 0


def check_block_size(family: str, block_size: int | None, num_top_k: int) -> int:
    """``block_size``, or :func:`default_block_size` when None; ``TypeError`` unless an int, ``ValueError``
    unless a multiple of 32 in [32, 1024]."""
    block = default_block_size(num_top_k) if block_size is None else block_size
    block = as_int(block, "block_size", owner=family)
    if block % WARP or not WARP <= block <= 1024:
        raise ValueError(f"sparsekv: {family} argument `block_size` must be a multiple of 32 in [32, 1024], "
                         f"got {block_size!r}")
    return block


def layout_type(family: str, layout: str, page_slots: int | None) -> str:
    """The C++ layout struct of ``layout`` (``page_slots``: dsv4 only, one of ``C4_PAGE_SLOTS``)."""
    one_of(layout, "layout", LAYOUTS, owner=family)
    if layout == "generic":
        if page_slots is not None:
            raise ValueError(f"sparsekv: {family} argument `page_slots` applies to layout 'dsv4' only, got "
                             f"{page_slots!r} with layout 'generic'")
        return "sparsekv::hisparse::LinearRows"
    one_of(page_slots, "page_slots", C4_PAGE_SLOTS, owner=family)
    return f"sparsekv::hisparse::Dsv4C4<{page_slots}>"


def check_protections(family: str, protect_recent: int, protect_near: int) -> tuple[int, int]:
    """The policy's template values, checked: ``protect_recent >= 0``, ``protect_near`` in [0, 4095]."""
    recent = int_in(protect_recent, "protect_recent", 0, (1 << 30) - 1, owner=family)
    near = int_in(protect_near, "protect_near", 0, _MAX_PROTECT_NEAR - 1, why="2 S + 1 lookups per slot", owner=family)
    return recent, near


def policy_protections(policy: object) -> tuple[int, int]:
    """``(protect_recent, protect_near)`` of ``policy``: a name in :data:`SWAP_IN_POLICIES`, or the pair
    itself (two ints; their ranges are checked with the instance, before anything compiles);
    else ``ValueError`` naming the argument."""
    if isinstance(policy, tuple) and len(policy) == 2 and all(type(v) is int for v in policy):
        return policy
    if isinstance(policy, str) and policy in SWAP_IN_POLICIES:
        return SWAP_IN_POLICIES[policy]
    raise ValueError(f"sparsekv: hisparse argument `policy` must be one of {tuple(SWAP_IN_POLICIES)} or a "
                     f"(protect_recent, protect_near) pair of ints, got {policy!r}")


def swap_in_template_args(family: str, *, num_top_k: int, hot_buffer_size: int, layout: str = "generic",
                          page_slots: int | None = None, block_size: int | None = None, protect_recent: int = 0,
                          protect_near: int = 0, slot_limit: int, hot_why: str,
                          shared_bytes: Callable[[int, int, int, int, int], int],
                          too_large: Callable[[int, int, int], str]) -> tuple:
    """``<K, H, BlockSize, Layout[, ProtectRecent, ProtectNear]>`` of either swap-in family: checks the
    ranges (``1 <= K <= H < slot_limit``, ``hot_why`` saying what bounds ``H``), derives the block size,
    and bounds the GPU path's per-request scratch, ``shared_bytes(K, H, BlockSize, W, S)``, by
    :data:`SHARED_MEMORY_LIMIT` (``too_large(K, H, need)`` words the ``ValueError``). LRU (both
    protections 0) keeps the four-argument form."""
    k = int_in(num_top_k, "num_top_k", 1, slot_limit - 1, why="int16 slot ids", owner=family)
    h = int_in(hot_buffer_size, "hot_buffer_size", k, slot_limit - 1, why=hot_why, owner=family)
    block = check_block_size(family, block_size, k)
    recent, near = check_protections(family, protect_recent, protect_near)
    need = shared_bytes(k, h, block, recent, near)
    if need > SHARED_MEMORY_LIMIT:
        raise ValueError(too_large(k, h, need))
    layout_struct = layout_type(family, layout, page_slots)
    return (k, h, block, layout_struct) if recent == near == 0 else (k, h, block, layout_struct, recent, near)

"""The generic send as a pure plan: ``(src_addr, dst_addr, nbytes)`` runs, nothing moved.

For each region pair (same item length on both sides) and each index pair ``(s, d)``, item ``s``
of the source region goes to item ``d`` of the destination region::

    src_ptr + s * item_len  ->  dst_ptr + d * item_len,   item_len bytes

Runs where both indices advance by one are merged into one transfer (``coalesce=True``): a
request's pages are mostly consecutive, so a 1M-token request's 4096 pages per region usually
become a handful of large writes. Everything is checked before a plan is returned: equal index
counts, every index inside both regions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INDEX_DTYPE = np.int64


def _as_indices(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"sparsekv: argument `{name}` must be a 1-D sequence of integers, got {arr.dtype}{arr.shape}")
    return arr.astype(INDEX_DTYPE, copy=False)


def coalesce_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs where both ``src`` and ``dst`` advance by exactly one.

    Returns
    -------
    tuple of np.ndarray
        int64 ``(src_starts, dst_starts, lengths)``, one entry per run, in input order.

    Examples
    --------
    >>> coalesce_runs(np.array([4, 5, 6, 9]), np.array([0, 1, 2, 3]))
    (array([4, 9]), array([0, 3]), array([3, 1]))
    """
    if src.size == 0:
        empty = np.zeros(0, dtype=INDEX_DTYPE)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths.astype(INDEX_DTYPE)


def check_index_pairs(src_indices, dst_indices) -> tuple[np.ndarray, np.ndarray]:
    """The two index lists as int64 arrays.

    Raises
    ------
    TypeError
        Not 1-D integer sequences.
    ValueError
        Different lengths, or a negative index.
    """
    src, dst = _as_indices("src_indices", src_indices), _as_indices("dst_indices", dst_indices)
    if src.size != dst.size:
        raise ValueError(f"sparsekv: index length mismatch: {src.size} source and {dst.size} destination indices")
    if src.size and (src.min() < 0 or dst.min() < 0):
        raise ValueError("sparsekv: transfer indices must be non-negative")
    return src, dst


def plan_transfer(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], item_lens: Sequence[int],
                  src_indices, dst_indices, *, src_lens: Sequence[int], dst_lens: Sequence[int],
                  coalesce: bool = True) -> np.ndarray:
    """The writes of the generic send for one index list over several region pairs.

    Parameters
    ----------
    src_ptrs, dst_ptrs, item_lens, src_lens, dst_lens : sequence of int
        Per region pair: base addresses, item bytes, and each side's region bytes.
    src_indices, dst_indices : 1-D integer sequences
        Item indices, paired by position; the same for every region pair.
    coalesce : bool
        Merge consecutive index runs into one write each.

    Returns
    -------
    np.ndarray
        uint64 ``[N, 3]``: ``(src_addr, dst_addr, nbytes)`` per write, region pair by region pair.

    Raises
    ------
    ValueError
        Lists of different lengths (regions or indices), a negative index.
    IndexError
        An index whose item lies outside its region, on either side.
    """
    if not len(src_ptrs) == len(dst_ptrs) == len(item_lens) == len(src_lens) == len(dst_lens):
        raise ValueError("sparsekv: plan_transfer needs one pointer, item length and region length per region pair")
    src, dst = check_index_pairs(src_indices, dst_indices)
    if coalesce:
        src_start, dst_start, count = coalesce_runs(src, dst)
    else:
        src_start, dst_start, count = src, dst, np.ones_like(src)
    # Vectorized over regions: a request's plan is on the per-request path of every transfer.
    items = np.asarray(item_lens, dtype=np.uint64).reshape(-1, 1)
    if src.size:
        for side, idx, lens in (("source", src, src_lens), ("destination", dst, dst_lens)):
            top = int(idx.max())
            outside = np.flatnonzero((top + 1) * items[:, 0] > np.asarray(lens, dtype=np.uint64))
            if outside.size:
                r = int(outside[0])
                item, length = int(item_lens[r]), int(lens[r])
                raise IndexError(f"sparsekv: {side} index {top} is outside region {r} "
                                 f"({length} B = {length // item} items of {item} B)")
    rows = np.empty((len(item_lens), src_start.size, 3), dtype=np.uint64)
    rows[:, :, 0] = np.asarray(src_ptrs, dtype=np.uint64).reshape(-1, 1) + src_start.astype(np.uint64) * items
    rows[:, :, 1] = np.asarray(dst_ptrs, dtype=np.uint64).reshape(-1, 1) + dst_start.astype(np.uint64) * items
    rows[:, :, 2] = count.astype(np.uint64) * items
    return rows.reshape(-1, 3)

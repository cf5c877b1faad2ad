"""Torch reference of the HiSparse swap-in and the miss-plan replay.

Row by row it runs the plain-Python policy (:mod:`sparsekv.testing.hisparse_policy`) on the request's
tables, maps hot slots to device locations and copies token bytes with torch indexing, through the
layout views of :mod:`sparsekv.kv_layout` for DSV4. It works on copies and returns the
expected state, so a test compares the kernel's in-place results with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.kv_layout import V4
from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step

# ``page_slots`` below: None for generic rows (one token per row), else the slots of a DSV4 C4 page.


def token_bytes(cache: torch.Tensor, slot: int, *, page_slots: int | None) -> torch.Tensor:
    """The bytes of token slot ``slot`` of a cache: one row, or the value then scale record of a DSV4 page."""
    if page_slots is None:
        return cache[slot]
    page, offset = divmod(slot, page_slots)
    value = V4.value_view(cache, page_slots)[page, offset]
    scale = V4.scale_view(cache, page_slots)[page, offset]
    return torch.cat([value, scale])


def write_token(cache: torch.Tensor, slot: int, data: torch.Tensor, *, page_slots: int | None) -> None:
    """Write ``data`` (the bytes :func:`token_bytes` returns) into token slot ``slot`` of ``cache``."""
    if page_slots is None:
        cache[slot] = data
        return
    page, offset = divmod(slot, page_slots)
    V4.value_view(cache, page_slots)[page, offset] = data[: V4.value_bytes]
    V4.scale_view(cache, page_slots)[page, offset] = data[V4.value_bytes :]


def cache_slots(cache: torch.Tensor, *, page_slots: int | None) -> int:
    """Token slots of a cache: rows, or pages x ``page_slots``."""
    return cache.shape[0] * (1 if page_slots is None else page_slots)


def _copy_token(dst: torch.Tensor, d: int, src: torch.Tensor, s: int, page_slots: int | None) -> bool:
    # The kernel skips a copy with an out-of-range slot instead of faulting; so does the reference.
    if not (0 <= s < cache_slots(src, page_slots=page_slots) and 0 <= d < cache_slots(dst, page_slots=page_slots)):
        return False
    write_token(dst, d, token_bytes(src, s, page_slots=page_slots).to(dst.device), page_slots=page_slots)
    return True


@dataclass
class SwapInExpected:
    """The state after one swap-in step, as the reference computes it."""

    top_k_device_locs: torch.Tensor
    device_buffer_tokens: torch.Tensor
    lru_slots: torch.Tensor
    device_buffer: torch.Tensor
    miss_count: torch.Tensor
    #: Per batch row, the ``(host slot, device slot)`` pairs of the miss plan, in miss order.
    plan: list[list[tuple[int, int]]]
    #: ``(hits, misses, bytes)`` of the step.
    counters: tuple[int, int, int]


def load_cache_to_device_buffer_reference(
    top_k_tokens: torch.Tensor,
    device_buffer_tokens: torch.Tensor,
    host_cache_locs: torch.Tensor,
    device_buffer_locs: torch.Tensor,
    host_cache: torch.Tensor,
    device_buffer: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    lru_slots: torch.Tensor,
    item_size_bytes: int,
    hot_buffer_size: int,
    *,
    num_real_reqs: int | None = None,
    page_slots: int | None = None,
    protect_recent: int = 0,
    protect_near: int = 0,
) -> SwapInExpected:
    """Expected result of ``load_cache_to_device_buffer_{dsv4_}mla`` on the same inputs (not modified).

    Arguments as for the kernel wrapper; ``num_real_reqs`` is a plain int here; ``page_slots`` is None
    for the generic layout, else the DSV4 C4 page's slot count; ``protect_recent`` / ``protect_near``:
    the replacement policy (``swap_in_step``'s; both 0: LRU). LRU rows of the
    requests in the batch must be permutations of ``0..H-1`` and real rows must name distinct requests.
    """
    hot = hot_buffer_size
    bs, num_top_k = top_k_tokens.shape
    num_real = bs if num_real_reqs is None else num_real_reqs
    out = torch.full((bs, num_top_k), -1, dtype=torch.int32)
    tokens = device_buffer_tokens.cpu().clone()
    lru = lru_slots.cpu().clone()
    device = device_buffer.cpu().clone()
    host = host_cache.cpu()
    locs = device_buffer_locs.cpu()
    host_locs = host_cache_locs.cpu()
    miss_count = torch.zeros(bs, dtype=torch.int32)
    plan: list[list[tuple[int, int]]] = [[] for _ in range(bs)]
    hits = misses = copies = 0
    for b in range(num_real):
        rid = int(req_pool_indices[b])
        seq_len = int(seq_lens[b])
        buffer = HotBuffer(tokens=tokens[rid, :hot].tolist(), lru=lru[rid].tolist())
        step = swap_in_step(buffer, top_k_tokens[b].tolist(), seq_len, protect_recent=protect_recent,
                            protect_near=protect_near)
        tokens[rid, :hot] = torch.tensor(buffer.tokens, dtype=tokens.dtype)
        lru[rid] = torch.tensor(buffer.lru, dtype=lru.dtype)
        out[b] = torch.tensor([int(locs[rid, s]) if s >= 0 else -1 for s in step.slots], dtype=torch.int32)
        for token, slot in step.misses:
            src = int(host_locs[rid, token]) if token < host_locs.shape[1] else -1
            dst = int(locs[rid, slot])
            plan[b].append((src, dst))
            copies += _copy_token(device, dst, host, src, page_slots)
        miss_count[b] = len(step.misses)
        hits += step.hits
        misses += len(step.misses)
    return SwapInExpected(top_k_device_locs=out, device_buffer_tokens=tokens, lru_slots=lru, device_buffer=device,
                          miss_count=miss_count, plan=plan,
                          counters=(hits, misses, copies * item_size_bytes))


def copy_cache_planned_reference(plan: list[list[tuple[int, int]]], host_cache: torch.Tensor,
                                 device_buffer: torch.Tensor, *, page_slots: int | None = None) -> torch.Tensor:
    """``device_buffer`` (a copy) after replaying ``plan``: per row, ``(host slot, device slot)`` pairs."""
    device = device_buffer.cpu().clone()
    host = host_cache.cpu()
    for row in plan:
        for src, dst in row:
            _copy_token(device, dst, host, src, page_slots)
    return device

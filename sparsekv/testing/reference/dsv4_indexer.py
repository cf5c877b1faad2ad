"""fp64 torch references for the DSV4 lightning indexer (:mod:`sparsekv.jit_kernel.dsv4_indexer`):
keys decoded from the cache bytes, scores ``sum_h w relu(q . k)`` over the causally visible
entries, the top-k selection (ascending positions, ties toward the lower position) with -1
padding, and the page-table transform."""

from __future__ import annotations

import torch

from sparsekv.kv_layout import INDEXER_HEAD_DIM, INDEXER_LAYOUTS
from sparsekv.testing.reference.dsv4_quant import decode_fp4_blocks


def decode_indexer_keys(k_cache: torch.Tensor, slots: torch.Tensor, page_slots: int, layout: str) -> torch.Tensor:
    """float64 ``[N, 128]`` keys stored in ``slots`` of a paged indexer cache (``"fp8"`` or ``"fp4"``)."""
    cache_layout = INDEXER_LAYOUTS[layout]
    slots = slots.to(torch.int64)
    if slots.numel() == 0:
        return torch.zeros(0, INDEXER_HEAD_DIM, dtype=torch.float64)
    page, offset = torch.div(slots, page_slots, rounding_mode="floor"), slots % page_slots
    values = cache_layout.value_view(k_cache, page_slots)[page, offset]
    scales = cache_layout.scale_view(k_cache, page_slots)[page, offset]
    if layout == "fp8":
        codes = values.contiguous().view(torch.float8_e4m3fn).to(torch.float64)
        return codes * scales.contiguous().view(torch.float32).to(torch.float64)
    return decode_fp4_blocks(values, scales)


def visible_entry_count(positions: torch.Tensor) -> torch.Tensor:
    """int64 count of C4 entries a query at raw position ``t`` sees, counted from the entries' spans.

    Entry ``i`` pools tokens ``4i .. 4i + 3``; it exists once its last token ``4i + 3`` is at or
    before ``t``. So the count is the number of ``i >= 0`` with ``4i + 3 <= t``: none for ``t < 3``,
    else ``(t - 3) // 4 + 1``.
    """
    t = positions.cpu().to(torch.int64)
    return torch.where(t >= 3, torch.div(t - 3, 4, rounding_mode="floor") + 1, torch.zeros_like(t))


def entry_slots(page_table_row: torch.Tensor, n: int, page_slots: int) -> torch.Tensor:
    """int64 cache slots of logical entries ``0..n-1`` through one page-table row."""
    i = torch.arange(n)
    return page_table_row.to(torch.int64)[i // page_slots] * page_slots + i % page_slots


def indexer_scores_reference(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                             positions: torch.Tensor, *, page_slots: int, layout: str, width: int) -> torch.Tensor:
    """float64 ``[B, width]`` scores; entries past ``min((t + 1) // 4, width)`` are -inf."""
    batch = q.shape[0]
    scores = torch.full((batch, width), float("-inf"), dtype=torch.float64)
    visible = visible_entry_count(positions).clamp(max=width)
    for b in range(batch):
        n = int(visible[b])
        keys = decode_indexer_keys(k_cache.cpu(), entry_slots(page_table[b].cpu(), n, page_slots), page_slots, layout)
        logits = q[b].cpu().to(torch.float64) @ keys.T  # [heads, n]
        scores[b, :n] = weights[b].cpu().to(torch.float64) @ logits.clamp_min(0)
    return scores


def score_order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys that order float32 scores as the kernels do: by bit pattern made monotone (larger
    float, larger key; NaN with the sign bit clear above +inf)."""
    bits = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)


def indexer_topk_reference(scores: torch.Tensor, positions: torch.Tensor, num_top_k: int) -> torch.Tensor:
    """int64 ``[B, num_top_k]``: the ``min(num_top_k, visible)`` largest scores of each row's visible prefix,
    equal scores taken lower position first, written in ascending position, -1 padded. The one answer
    both backends give."""
    visible = visible_entry_count(positions).clamp(max=scores.shape[1])
    out = torch.full((scores.shape[0], num_top_k), -1, dtype=torch.int64)
    for b in range(scores.shape[0]):
        n = int(visible[b])
        keys = score_order_keys(scores[b, :n].cpu().float())
        picked = torch.sort(keys, descending=True, stable=True).indices[: min(num_top_k, n)].sort().values
        out[b, : picked.numel()] = picked
    return out

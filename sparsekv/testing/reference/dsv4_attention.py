"""fp64 torch reference for DSV4 sparse decode attention with a sink (:mod:`sparsekv.jit_kernel.dsv4_attention`).

Rows are dequantized from the cache bytes by :func:`sparsekv.testing.reference.dsv4_quant.dequantize_fp8_ds_mla`
(value space), gathered by index (-1 and any slot outside the cache dropped, repeats kept), and
``out = softmax(l) @ kv * sigmoid(lse - sink)`` with ``l = softmax_scale * q . kv`` is evaluated in
float64; a row with no valid entry gives ``out = 0``, ``lse = +inf``.
"""

from __future__ import annotations

import torch

from sparsekv.testing.reference.dsv4_quant import DIM, dequantize_fp8_ds_mla


def _rows(cache: torch.Tensor, slots: torch.Tensor, page_slots: int) -> torch.Tensor:
    valid = slots[(slots >= 0) & (slots < cache.shape[0] * page_slots)].to(torch.int64)
    return dequantize_fp8_ds_mla(cache, valid, page_slots)


def sparse_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    page_slots: int,
    *,
    softmax_scale: float = 512**-0.5,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_page_slots: int | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(out [B, H, 512], lse [B, H])`` of the contract in :mod:`sparsekv.jit_kernel.dsv4_attention`."""
    batch, heads, _ = q.shape
    if topk_length is not None:  # entries past a row's length are not candidates
        past = torch.arange(indices.shape[1])[None, :] >= topk_length.cpu().to(torch.int64)[:, None]
        indices = torch.where(past, torch.full((), -1, dtype=indices.dtype), indices.cpu())
    out = torch.zeros(batch, heads, DIM, dtype=torch.float64)
    lse = torch.full((batch, heads), float("inf"), dtype=torch.float64)
    sink64 = sink.to(torch.float64).cpu()
    for b in range(batch):
        kv = _rows(kv_cache.cpu(), indices[b].cpu(), page_slots)
        if extra_kv_cache is not None:
            kv = torch.cat([kv, _rows(extra_kv_cache.cpu(), extra_indices[b].cpu(), extra_page_slots)])
        if kv.shape[0] == 0:
            continue
        logits = softmax_scale * (q[b].cpu().to(torch.float64) @ kv.T)
        lse[b] = torch.logsumexp(logits, dim=1)
        out[b] = torch.softmax(logits, dim=1) @ kv * torch.sigmoid(lse[b] - sink64)[:, None]
    return out, lse

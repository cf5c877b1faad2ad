"""fp64 torch reference of the DSV4 compressors (one shot over a whole sequence).

Entry ``i`` of ratio ``m`` is, per channel, ``sum_j softmax_j(score_j + ape_j) * kv_j`` over its
window's slots: C128 slot ``j`` = token ``128 i + j``; C4 slots 0-3 = tokens ``4(i-1)..4i-1`` on the
first ``d`` channels (masked for ``i = 0``) and slots 4-7 = tokens ``4i..4i+3`` on the last ``d``.
"""

from __future__ import annotations

import torch


def compress_pool_reference(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int,
                            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[T // ratio, d]`` entries of ``kv``, ``score`` ``[T, coff * d]`` and ``ape`` ``[ratio, coff * d]``.

    Computed in ``dtype``: float64 is the test oracle, float32 the benchmark baseline.
    """
    if ratio not in (4, 128):
        raise ValueError(f"ratio must be 4 or 128, got {ratio}")
    kv, score, ape = kv.to(dtype), score.to(dtype), ape.to(dtype)
    t = kv.shape[0]
    n = t // ratio
    if ratio == 128:
        values = kv[: n * 128].reshape(n, 128, kv.shape[1])
        logits = score[: n * 128].reshape(n, 128, kv.shape[1]) + ape
    else:
        d = kv.shape[1] // 2
        if n == 0:
            return torch.zeros(0, d, dtype=dtype, device=kv.device)
        kv_w = kv[: n * 4].reshape(n, 4, 2 * d)
        logit_w = score[: n * 4].reshape(n, 4, 2 * d) + ape
        # A halves of the previous window (none before entry 0), then the own window's B halves.
        a_values = torch.cat([kv.new_zeros(1, 4, d), kv_w[:-1, :, :d]])
        a_logits = torch.cat([kv.new_full((1, 4, d), float("-inf")), logit_w[:-1, :, :d]])
        values = torch.cat([a_values[:n], kv_w[:, :, d:]], dim=1)
        logits = torch.cat([a_logits[:n], logit_w[:, :, d:]], dim=1)
    weights = torch.softmax(logits, dim=1)
    return (weights * values).sum(dim=1)


def online_fold_reference(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """float64 C128 entries by merging per-token (max, sum, acc) states in a random grouping order.

    The merge of two states is ``m = max(m1, m2)``, ``S = S1 e^(m1-m) + S2 e^(m2-m)``,
    ``acc = acc1 e^(m1-m) + acc2 e^(m2-m)``; the entry is ``acc / S``. Any grouping gives the same
    value up to rounding, which is what this reference exercises (a balanced tree).
    """
    kv, logits = kv.double(), score.double()
    n, width = kv.shape[0] // 128, kv.shape[1]
    logits = logits[: n * 128].reshape(n, 128, width) + ape.double()
    values = kv[: n * 128].reshape(n, 128, width)
    states = [(logits[:, j], torch.ones_like(logits[:, j]), values[:, j]) for j in range(128)]
    while len(states) > 1:
        merged = []
        for a, b in zip(states[0::2], states[1::2]):
            m = torch.maximum(a[0], b[0])
            fa, fb = torch.exp(a[0] - m), torch.exp(b[0] - m)
            merged.append((m, a[1] * fa + b[1] * fb, a[2] * fa + b[2] * fb))
        states = merged
    _, s, acc = states[0]
    return acc / s

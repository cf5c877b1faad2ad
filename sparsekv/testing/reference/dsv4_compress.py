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


def plan_raw_reference(rings: list[list[int]], starts: list[int], lengths: list[int], ratio: int, ring_size: int,
                       span: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tables of one raw-ring step of ``CompressorState``, planned on the host event by event and
    slot by slot: ``sources [E, W]``, ``writes [M, 2]``, ``anchors [E]``, ``event_requests [E]`` (int64).

    The planner ``CompressorState`` ran before it planned on the device: the oracle of the device
    plan and the baseline of its benchmark. Position ``p`` of request ``b`` lives in ring row
    ``rings[b][p // span] * ring_size + p % ring_size`` (``span=None``: ``rings[b][0]``).
    """
    win = 8 if ratio == 4 else ratio

    def ring_row(ring_ids: list[int], pos: int) -> int:
        return ring_ids[0 if span is None else pos // span] * ring_size + pos % ring_size

    sources, writes, anchors, event_requests = [], [], [], []
    row0 = 0
    for b, (ring_ids, s, n) in enumerate(zip(rings, starts, lengths)):
        e = s + n
        for i in range(s // ratio, e // ratio):  # entries whose last token is in [s, e)
            first = ratio * i - (4 if ratio == 4 else 0)
            slots = []
            for q in range(first, first + win):
                if q < 0:
                    slots.append(-1)
                elif q >= s:
                    slots.append(row0 + q - s)
                else:
                    slots.append(-2 - ring_row(ring_ids, q))
            sources.append(slots)
            anchors.append(ratio * i)
            event_requests.append(b)
        for q in range(max(s, e - ring_size), e):
            writes.append((row0 + q - s, ring_row(ring_ids, q)))
        row0 += n
    return (torch.tensor(sources, dtype=torch.int64).reshape(-1, win),
            torch.tensor(writes, dtype=torch.int64).reshape(-1, 2), torch.tensor(anchors, dtype=torch.int64),
            torch.tensor(event_requests, dtype=torch.int64))

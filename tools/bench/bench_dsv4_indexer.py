"""Benchmark the lightning indexer (scores + top-k, FP8 and FP4 keys) against torch (``--backend cpu|cuda``).

For one query row (64 heads, 128 dims) seeing N indexer entries through a shuffled page table of
64-entry pages, with the FP8 (132 B) and the FP4 (68 B) key layouts, top-k 512:

* ``kernel``: :func:`lightning_indexer` (the header kernels: scores, then top-k through the page
  table), given its score and output buffers;
* ``torch``: the same step in torch: decode the keys
  (``sparsekv.testing.reference.dsv4_indexer.decode_indexer_keys``), float32 matmul, relu, weighted
  sum over heads, ``torch.topk``, measured in the same run.

Before timing, the kernel's scores are checked against torch's (within 1e-4) and its top-k against
``torch.topk`` of the same scores (the same set of values). ``bench_dsv4_attention.py`` times the
scores and top-k apart, with the Triton twins; this one times the call a decode step makes. The cpu
backend runs on one host thread and torch is set to one thread too (``threads``). Prints JSON;
``--plot PNG`` draws latency per case.
"""

from __future__ import annotations

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4_indexer import lightning_indexer
from sparsekv.kv_layout import INDEXER_LAYOUTS
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import device_name, kernel_sweep, timer, timing_fields
from sparsekv.testing.reference.dsv4_indexer import decode_indexer_keys
from sparsekv.testing.strategies.dsv4_indexer import write_indexer_keys

HEADS, DIM, PAGE, TOP_K = 64, 128, 64, 512
CASES = tuple((n, layout) for n in (1 << 14, 1 << 16) for layout in ("fp8", "fp4"))
QUICK_CASES = ((1 << 12, "fp8"), (1 << 12, "fp4"))


def run_case(entries: int, layout: str, repeats: int, backend: str) -> dict:
    device = device_of(backend)
    gen = torch.Generator().manual_seed(entries)
    pages = entries // PAGE
    cache = torch.zeros(pages, INDEXER_LAYOUTS[layout].page_bytes(PAGE), dtype=torch.uint8)
    write_indexer_keys(torch.randn(entries, DIM, generator=gen), cache, torch.arange(entries), PAGE, layout)
    page_table = torch.randperm(pages, generator=gen).int()[None, :]
    slots = (page_table[0].long()[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)  # entry i's cache slot
    cache, page_table = cache.to(device), page_table.to(device)
    positions = torch.tensor([4 * entries - 1], device=device)  # sees every entry
    q = torch.randn(1, HEADS, DIM, generator=gen).to(device)
    weights = (torch.rand(1, HEADS, generator=gen) * (DIM * 64) ** -0.5).to(device)
    scores = torch.empty(1, entries, device=device)
    tokens = torch.empty(1, TOP_K, dtype=torch.int32, device=device)
    token_slots = torch.empty_like(tokens)

    def kernel():
        return lightning_indexer(q, weights, cache, page_table, positions, TOP_K, layout=layout, scores=scores,
                                 out=tokens, out_slots=token_slots, impl="header")

    def torch_step():
        keys = decode_indexer_keys(cache, slots.to(device), PAGE, layout).float()
        torch_scores = weights[0] @ torch.relu(q[0] @ keys.T)
        return torch_scores, torch.topk(torch_scores, TOP_K, sorted=False).indices

    kernel()
    torch_scores, _ = torch_step()
    torch.testing.assert_close(scores[0], torch_scores, rtol=1e-4, atol=1e-4)
    expected = torch.topk(scores[0], TOP_K, sorted=False).values.sort().values
    if not torch.equal(scores[0, tokens[0].long()].sort().values, expected):
        raise SystemExit(f"bench_dsv4_indexer: the kernel's top-k differs from torch.topk at {entries} {layout}")

    time_it = timer(backend)
    ours = time_it(kernel, repeats=repeats)
    baseline = time_it(torch_step, repeats=repeats)
    scores_cost = roofline.indexer_scores(1, entries, HEADS, PAGE, q_bytes=q.element_size(),
                                          key_bytes=INDEXER_LAYOUTS[layout].bytes_per_token)
    topk_cost = roofline.indexer_topk(1, entries, TOP_K)  # the step: scores, then their top-k
    step = roofline.Cost(scores_cost.bytes + topk_cost.bytes, scores_cost.flops, scores_cost.math)
    return {"case": f"{entries >> 10}k {layout}", "entries": entries, "layout": layout, "top_k": TOP_K,
            "kernel_us": ours.median_s * 1e6, "torch_us": baseline.median_s * 1e6,
            "key_bytes": entries * INDEXER_LAYOUTS[layout].bytes_per_token,
            "kernel_vs_torch": baseline.median_s / ours.median_s, **timing_fields("kernel", ours),
            **roofline.fields(step, ours.median_s, device_name(backend))}


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]), name="dsv4_indexer lightning_indexer",
                 baseline="torch: decode keys, fp32 matmul + relu + weighted sum, torch.topk (same run)",
                 cases=CASES, quick_cases=QUICK_CASES, run_case=run_case,
                 notes=dict(heads=HEADS, page_slots=PAGE, top_k=TOP_K),
                 one_thread=True,  # the cpu backend runs on one thread: compare like with like
                 plot=dict(label_key="case", value_keys=("kernel_us", "torch_us"), ylabel="latency (us, log)",
                           log=True))


if __name__ == "__main__":
    main()

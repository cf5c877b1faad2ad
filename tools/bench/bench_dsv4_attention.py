"""Benchmark DSV4 sparse decode attention and the lightning indexer + top-k (``--backend cpu`` or
``cuda``), with the DSV4-Flash decode cost per layer at 1M context on paper.

Measured, each against a baseline timed in the same run on the same inputs:

* ``attention``: :func:`sparse_decode_attention` (cpu: one thread, one split) and its raw module
  call vs the fp64 torch reference (the one the tests use, on the host) and a float32 torch path on
  the backend's device (dequantize the gathered rows, two batched matmuls), B in {1, 32}, K in
  {512, 2048}, 64 heads (DSV4-Flash), C4 pages of 64 slots. Outputs are checked against the
  reference before timing.
* ``indexer``: :func:`indexer_scores` over 64k and 256k visible entries (FP8 132 B cache, 64 heads)
  vs float32 torch (dequantize, matmul, relu, weighted sum); :func:`indexer_topk` (given its workspace,
  as an engine gives it: the header splits a row over several CTAs at small batch; k = 512, 1024,
  2048) vs ``torch.topk`` on the same scores, set-checked.

* ``op overhead``: what the ``sparsekv::`` custom-op layer costs per call on a tiny call (B1 K8, given
  ``out`` and ``lse``): the raw module call vs the eager op call (the public wrapper) vs the same
  wrapper compiled with ``torch.compile(fullgraph=True, backend="eager")``; on cuda also a CUDA-graph
  replay of the call vs the eager call.

Each kernel row also times the Triton twin (``impl="triton"``, column ``triton_us``): on the GPU
with CUDA events, on the cpu backend under the Triton interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported), whose timings are not speed (``notes.triton_timing`` says which).

On paper per implementation (``notes.paper_per_impl``), at batch 64, top-k 512, 64 heads (attention)
and 64 rows of 64k C4 entries (indexer): bytes, FLOPs, HBM round trips of each KV row, and the H100 /
H200 roofline time. On paper (``notes.paper``): bytes and FLOPs per decode step per layer for
DSV4-Flash at 1M context (CSA/C4: indexer + top-k + attention over 512 + 128 entries; HCA/C128:
attention over all 8,192 compressed + 128 window entries), the H200 roofline time of each, and what
a GPU top-k must do to beat sglang's ~15 us at 256k candidates.

* ``prefill`` (cuda): the same kernels serving 4k prefill tokens as rows (128 heads, top-k 2048 of a
  64k-entry C4 cache), header and Triton, with the roofline; on paper on every backend
  (``notes.paper_prefill``).
* ``peer`` (``--peer flashmla=PATH``, cuda only): FlashMLA's sparse decode, built by
  ``tools/peers/build_flashmla.sh`` (PATH: the library or its folder), and ours (header and Triton)
  on identical inputs: bf16 ``q``, a C4 cache of distinct rows with ``top_k`` slots per row and
  ``topk_length``, the 128-entry SWA window as the extra cache, the sink; B in {1, 8, 64, 128}, K in
  {512, 1024, 2048}, 64 and 128 heads. FlashMLA's output is checked against the fp64 reference (two
  rows per case, within FlashMLA's tolerance) before timing, which also checks our reading of its
  layout; each row prints ours / FlashMLA (``header_vs_flashmla``, ``triton_vs_flashmla``).

cuda: tensors on the GPU, every figure timed with CUDA events. Prints JSON (``--json``), plots
latencies (``--plot``), ``--quick`` runs a short sweep.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict

import torch
from tqdm import tqdm

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4_attention import ATTENTION, sparse_decode_attention
from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk, topk_workspace_ints
from sparsekv.kv_layout import INDEXER_FP8, V4
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import bar_plot, device_name, open_sweep, time_call, timer, timing_fields
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.reference.dsv4_quant import dequantize_fp8_ds_mla
from sparsekv.testing.strategies.dsv4_attention import random_rows, v4_cache
from sparsekv.testing.strategies.dsv4_indexer import write_indexer_keys

HEADS, INDEXER_HEADS, PAGE = 64, 64, 64
BATCHES, TOPKS = (1, 8, 64, 128), (512, 1024, 2048)
#: The most V4 records an attention case draws on the host (the device cache tiles them).
HOST_ROWS = 8192

# DSV4-Flash (reference §1.1) and an H200 (dense tensor-core peaks, HBM3e bandwidth).
FLASH = {"heads": 64, "head_dim": 512, "indexer_heads": 64, "indexer_dim": 128, "index_topk": 512, "window": 128,
         "csa_layers": 21, "hca_layers": 20}
H200 = roofline.GPUS["H200"]
# Dense peaks: bf16 tensor cores, float32 FMA on CUDA cores (what the header's cuda kernels use).
GPUS = {name: roofline.GPUS[name] for name in ("H100", "H200")}


def paper_per_impl(batch: int = 64, top_k: int = 512, heads: int = 64, c4_entries: int = 1 << 16) -> dict:
    """Bytes, FLOPs, HBM round trips per KV row and the H100/H200 roofline of each implementation.

    Attention: the header's cuda kernel and the Triton twin both gather each row once per 64 heads
    and run both products on bf16 tensor cores (the header on mma.sync, the twin on tl.dot).
    Indexer scores: the same bytes (every visible key once), CUDA-core float32 against bf16 tensor
    cores. Top-k: both read the score row once from HBM; the later passes come from L2.
    """
    kv = batch * top_k * V4.bytes_per_token
    q_out = batch * heads * 512 * 2 * 2  # bf16 q in, bf16 out
    attn_flops = 4 * batch * heads * 512 * top_k
    index_bytes = batch * c4_entries * (INDEXER_FP8.bytes_per_token + 4)  # keys + the fp32 score written
    index_flops = 2 * batch * 64 * 128 * c4_entries
    impls = {
        "attention_header": {"bytes": kv + q_out, "flops": attn_flops, "math": "bf16_flops",
                             "kv_row_round_trips": -(-heads // 64),
                             "design": "64 heads per 256-thread CTA, 32-row tiles, mma.sync m16n8k16 with ldmatrix, "
                                       "two splits at batch 64 (128 CTAs, one per SM)"},
        "attention_triton": {"bytes": kv + q_out, "flops": attn_flops, "math": "bf16_flops",
                             "kv_row_round_trips": -(-heads // 64),
                             "design": "64 heads per program, 32-row tiles, 8 warps, tl.dot (wgmma / tcgen05), 2 "
                                       "splits at batch 64 (128 programs, one per SM); at batch 1-3 16 heads per "
                                       "program, 16-row tiles, 4 warps, mma.sync (batch 1: 160 programs, 2 per SM)"},
        "indexer_scores_header": {"bytes": index_bytes, "flops": index_flops, "math": "fp32_flops",
                                  "kv_row_round_trips": 1, "design": "one warp per entry, CUDA cores"},
        "indexer_scores_triton": {"bytes": index_bytes, "flops": index_flops, "math": "bf16_flops",
                                  "kv_row_round_trips": 1,
                                  "design": "query resident over 512 entries per program, 64-key tiles, tl.dot"},
        "indexer_topk_header": {"bytes": batch * c4_entries * 4, "flops": 0, "math": "fp32_flops",
                                "kv_row_round_trips": 5,
                                "design": "1024 threads per row, 4 x 8-bit histograms + write"},
        "indexer_topk_triton": {"bytes": batch * c4_entries * 4, "flops": 0, "math": "fp32_flops",
                                "kv_row_round_trips": 4, "design": "4 warps per row, 11+11+10-bit histograms + write"},
    }
    for impl in impls.values():
        for gpu, peak in GPUS.items():
            t_mem, t_math = impl["bytes"] / peak.hbm_bytes_per_s, impl["flops"] / getattr(peak, impl["math"])
            impl[f"{gpu}_roofline_us"] = max(t_mem, t_math) * 1e6
            impl[f"{gpu}_bound"] = "memory" if t_mem >= t_math else "math"
    return {"batch": batch, "top_k": top_k, "heads": heads, "indexer_entries_per_row": c4_entries,
            "gpus": {name: asdict(gpu) for name, gpu in GPUS.items()},
            "impls": impls,
            "target": "attention within 2x of roofline on the GPU: one gather of each row per 64 heads and "
                      "tensor-core products (both implementations) make it memory-bound; 64 programs on 132 SMs "
                      "with one 9 KiB tile in flight each is the remaining gap (two tiles in flight per program "
                      "closes it: tuning needs a GPU session)"}


def paper(context: int = 1 << 20) -> dict:
    """Bytes and FLOPs per decode step (one query token) per layer, and the H200 roofline time."""
    f = FLASH
    c4, c128 = context // 4, context // 128
    attn_flops = lambda n: 2 * 2 * f["heads"] * f["head_dim"] * n  # noqa: E731  (q.k and p.v, 2 FLOPs per MAC)
    q_bytes = f["heads"] * f["head_dim"] * 2

    def roofline(nbytes: float, flops: float, peak: float) -> dict:
        t_mem, t_math = nbytes / H200.hbm_bytes_per_s, flops / peak
        return {"bytes": nbytes, "flops": flops, "memory_us": t_mem * 1e6, "math_us": t_math * 1e6,
                "roofline_us": max(t_mem, t_math) * 1e6, "bound": "memory" if t_mem >= t_math else "math"}

    indexer_flops = 2 * f["indexer_heads"] * f["indexer_dim"] * c4
    csa_entries = f["index_topk"] + f["window"]
    hca_entries = c128 + f["window"]
    layers = {
        "csa_indexer_fp8": roofline(c4 * INDEXER_FP8.bytes_per_token + c4 * 4, indexer_flops, H200.fp8_flops),
        "csa_indexer_fp4": roofline(c4 * 68 + c4 * 4, indexer_flops, H200.fp8_flops),
        "csa_topk_256k_scores": roofline(4 * c4 * 2, 0.0, H200.fp8_flops),
        "csa_attention": roofline(csa_entries * V4.bytes_per_token + q_bytes, attn_flops(csa_entries),
                                  H200.bf16_flops),
        "hca_attention": roofline(hca_entries * V4.bytes_per_token + q_bytes, attn_flops(hca_entries),
                                  H200.bf16_flops),
    }
    csa_total = sum(layers[k]["roofline_us"] for k in ("csa_indexer_fp8", "csa_topk_256k_scores", "csa_attention"))
    return {
        "context": context, "c4_entries": c4, "c128_entries": c128, "h200": asdict(H200), "per_layer": layers,
        "per_step_all_layers_us": (csa_total * f["csa_layers"]
                                   + layers["hca_attention"]["roofline_us"] * f["hca_layers"]),
        "note": ("Per CSA layer the indexer dominates: it must read every visible key (34.6 MB FP8) while attention "
                 "reads only 640 rows (0.37 MB); the FP4 cache halves the indexer's bytes. Roofline times ignore "
                 "launch latency (2-4 us per kernel), which dominates every part except the indexer."),
        "gpu_topk": (
            "sglang's radix top-k takes ~15 us for 256k candidates at batch 1; its bytes are 1 MB of fp32 scores, "
            "0.2 us at HBM speed, so it is latency-bound. Our cuda TopK (one 1024-thread block per row, 4 passes of "
            "an 8-bit histogram + 1 output pass over the row, all from L2) reads ~5 MB through ONE SM (~0.1-0.2 TB/s) "
            "and would take ~25-50 us: it does not beat 15 us as written. To beat it: (1) spread a long row over a "
            "thread-block cluster of 8-16 CTAs that merge histograms through distributed shared memory, so each pass "
            "runs at ~2 TB/s (0.5 us per MB); (2) take the first, coarse 11-12-bit histogram in the indexer-score "
            "epilogue (the score kernel touches every score anyway: no extra pass, no extra launch); (3) after it, "
            "compact the <= a few thousand candidates of the threshold bin into shared memory and finish the select "
            "on chip; (4) launch with PDL / in a CUDA graph. That is one fused pass + one compaction pass over 1 MB "
            "(~1 us) plus cluster barriers and scans (~2-3 us): ~4-5 us, below 15 us because the work is then bound "
            "by on-chip latency, not by one SM's share of L2 bandwidth. Batch > ~100 rows fills the GPU with one "
            "block per row and needs no cluster."),
    }


class AttentionCase:
    """B rows of K random slots (about 1/8 repeated within a row) into a C4 cache of B * K distinct
    rows, bf16 queries (the serving dtype), float32 output.

    The cache's records are drawn for at most :data:`HOST_ROWS` rows on the host and tiled on the
    device to B * K distinct rows: every slot a kernel reads is its own HBM bytes, as in serving."""

    def __init__(self, batch: int, k: int, backend: str, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        slots = batch * k
        device = device_of(backend)
        drawn = min(slots, HOST_ROWS)
        host_cache = v4_cache(random_rows(drawn, g), PAGE)
        self.cache = host_cache.to(device).repeat(-(-slots // drawn), 1)
        self.host_cache = host_cache
        self.indices = torch.randint(0, slots, (batch, k), generator=g, dtype=torch.int32).to(device)
        self.q = torch.randn(batch, HEADS, 512, generator=g).to(torch.bfloat16).to(device)
        self.sink = torch.randn(HEADS, generator=g).to(device)
        self.out = torch.empty(batch, HEADS, 512, device=device)
        self.lse = torch.empty(batch, HEADS, device=device)
        self.module = ATTENTION.module(backend=backend, q_dtype=torch.bfloat16)
        self.batch, self.k, self.drawn = batch, k, drawn

    def kernel(self, impl: str = "header"):
        return sparse_decode_attention(self.q, self.cache, self.indices, self.sink, PAGE, out=self.out, lse=self.lse,
                                       impl=impl)

    def raw(self):
        self.module.sparse_decode_attention(self.q, self.cache, self.indices, self.sink, PAGE, 512**-0.5, None, None,
                                            -1, self.out, self.lse, None, None, None, 1, None)

    def reference(self, rows: int | None = None):
        """The fp64 reference of the first ``rows`` query rows (all by default), on the host."""
        rows = self.batch if rows is None else rows
        # The tiled cache repeats the drawn records: slot s holds drawn record s % drawn.
        indices = self.indices[:rows].cpu() % self.drawn
        return sparse_decode_attention_reference(self.q[:rows].cpu().float(), self.host_cache, indices,
                                                 self.sink.cpu(), PAGE)

    def torch_fp32(self):
        rows = dequantize_fp8_ds_mla(self.cache, self.indices.reshape(-1).long(), PAGE).float()
        kv = rows.reshape(self.indices.shape[0], self.indices.shape[1], 512)
        logits = torch.bmm(self.q.float(), kv.transpose(1, 2)) * 512**-0.5
        lse = torch.logsumexp(logits, dim=2)
        return torch.bmm(torch.softmax(logits, dim=2), kv) * torch.sigmoid(lse - self.sink)[..., None], lse

    def cost(self) -> roofline.Cost:
        return roofline.attention(self.batch, self.k, HEADS, q_bytes=2, out_bytes=4)


class IndexerCase:
    """B query rows, each seeing ``entries`` FP8 indexer keys of its own through a shuffled page table.

    One block of ``entries`` keys is written on the host and tiled on the device, one copy per row:
    every row reads its own HBM bytes."""

    def __init__(self, entries: int, backend: str, batch: int = 1, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        pages = entries // PAGE
        device = device_of(backend)
        cache = torch.zeros(pages, INDEXER_FP8.page_bytes(PAGE), dtype=torch.uint8)
        write_indexer_keys(torch.randn(entries, 128, generator=g), cache, torch.arange(entries), PAGE, "fp8")
        self.cache = cache.to(device).repeat(batch, 1)
        self.page_table = torch.stack([row * pages + torch.randperm(pages, generator=g)
                                       for row in range(batch)]).int().to(device)
        self.positions = torch.full((batch,), 4 * entries - 1, device=device)
        self.q = torch.randn(batch, INDEXER_HEADS, 128, generator=g).to(torch.bfloat16).to(device)
        self.weights = (torch.rand(batch, INDEXER_HEADS, generator=g) * (128 * 64) ** -0.5).to(device)
        self.scores = torch.empty(batch, entries, device=device)
        self.entries, self.batch = entries, batch

    def kernel_scores(self, impl: str = "header"):
        return indexer_scores(self.q, self.weights, self.cache, self.page_table, self.positions, page_slots=PAGE,
                              out=self.scores, impl=impl)

    def torch_scores(self, row: int = 0):
        """One row's scores in float32 torch (dequantize, matmul, relu, weighted sum)."""
        values = INDEXER_FP8.value_view(self.cache, PAGE)[self.page_table[row].long()].reshape(-1, 128)
        scales = INDEXER_FP8.scale_view(self.cache, PAGE)[self.page_table[row].long()].reshape(-1, 4)
        keys = values.view(torch.float8_e4m3fn).float() * scales.contiguous().view(torch.float32)
        return (self.weights[row] @ torch.relu(self.q[row].float() @ keys.T))[None, :]


def op_overhead(backend: str, time_it) -> dict:
    """Per-call cost of the op layer: raw module call, eager op call, compiled op call (and, on cuda, graph replay)."""
    case = AttentionCase(1, 8, backend)

    def eager():
        return sparse_decode_attention(case.q, case.cache, case.indices, case.sink, PAGE, out=case.out, lse=case.lse,
                                       impl="header")

    compiled = torch.compile(eager, fullgraph=True, backend="eager")
    expected = [t.clone() for t in eager()]
    if not all(torch.equal(a, b) for a, b in zip(compiled(), expected)):
        raise RuntimeError("the compiled op call disagrees with the eager one")
    raw_s, eager_s, compiled_s = (time_it(fn).median_s for fn in (case.raw, eager, compiled))
    row = {"case": "op overhead B1 K8", "raw_us": raw_s * 1e6, "eager_op_us": eager_s * 1e6,
           "compiled_op_us": compiled_s * 1e6, "op_layer_us": (eager_s - raw_s) * 1e6,
           "compiled_vs_eager": eager_s / compiled_s}
    if backend == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        graph.replay()
        if not torch.equal(case.out, expected[0]):
            raise RuntimeError("the replayed graph disagrees with the eager call")
        replay_s = time_it(graph.replay).median_s
        row.update(graph_replay_us=replay_s * 1e6, speedup_replay_vs_eager=eager_s / replay_s)
    return row


#: Prefill served by the decode kernel, each query token a row: 4k tokens, 128 heads, top-k 2048 of a
#: 64k-entry C4 cache (a 256k-token context).
PREFILL = {"tokens": 4096, "heads": 128, "top_k": 2048, "c4_entries": 1 << 16}


def prefill_paper() -> dict:
    """The prefill case's roofline: every token gathers its own 2048 rows (the bytes as read, an upper
    bound; the 64k distinct rows are 38 MB, so most gathers can hit L2) and does 4 * 128 * 512 FLOPs per
    row: math-bound on bf16 tensor cores."""
    p = PREFILL
    return {**p, **roofline.fields(roofline.attention(p["tokens"], p["top_k"], p["heads"])),
            "distinct_kv_bytes": p["c4_entries"] * V4.bytes_per_token}


def prefill_row(time_it, device: str) -> dict:
    """The prefill case on the GPU: header and Triton, timed, the Triton output checked on two tokens."""
    p = PREFILL
    g = torch.Generator().manual_seed(2)
    cache = v4_cache(random_rows(p["c4_entries"], g), PAGE).cuda()
    indices = torch.randint(0, p["c4_entries"], (p["tokens"], p["top_k"]), generator=g, dtype=torch.int32).cuda()
    q = torch.randn(p["tokens"], p["heads"], 512, generator=g).bfloat16().cuda()
    sink = torch.randn(p["heads"], generator=g).cuda()
    out = torch.empty(p["tokens"], p["heads"], 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(p["tokens"], p["heads"], device="cuda")
    row = {"case": f"prefill T{p['tokens']} H{p['heads']} K{p['top_k']}", **p}
    for impl in ("header", "triton"):
        call = functools.partial(sparse_decode_attention, q, cache, indices, sink, PAGE, out=out, lse=lse, impl=impl)
        call()
        ref_out, _ = sparse_decode_attention_reference(q[:2].cpu(), cache.cpu(), indices[:2].cpu(), sink.cpu(), PAGE)
        torch.testing.assert_close(out[:2].cpu().double(), ref_out, rtol=2.0**-7,
                                   atol=1e-2 * max(1.0, float(ref_out.abs().max())))
        timing = time_it(call)
        row.update(timing_fields("kernel" if impl == "header" else "triton", timing))
    row.update(roofline.fields(roofline.attention(p["tokens"], p["top_k"], p["heads"]),
                               min(row["kernel_us"], row["triton_us"]) / 1e6, device))
    return row


#: The SWA window DSV4 attends beside the top-k (the peer cases' extra cache).
WINDOW = 128
PEER_CASES = [(b, k, h) for h in (64, 128) for k in (512, 1024, 2048) for b in (1, 8, 64, 128)]
PEER_QUICK = [(1, 512, 64), (64, 512, 64), (64, 2048, 128)]
#: FlashMLA's own test tolerances (out, lse) against its fp32 reference.
FLASHMLA_TOL = ({"atol": 1e-3, "rtol": 2.01 / 128}, {"atol": 1e-6, "rtol": 8.01 / 65536})


class PeerCase:
    """The inputs FlashMLA and ours both take: bf16 ``q`` of ``heads`` heads, ``k`` distinct C4 slots per
    row (``topk_length`` = k) out of ``cache``, the SWA window of each row in ``window`` as the extra
    cache, a sink."""

    def __init__(self, batch: int, k: int, heads: int, cache: torch.Tensor, window: torch.Tensor, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        device = cache.device
        slots = cache.shape[0] * PAGE
        self.args = {
            "q": torch.randn(batch, heads, 512, generator=g).bfloat16().to(device), "kv_cache": cache,
            "indices": torch.randperm(slots, generator=g)[:batch * k].view(batch, k).int().to(device),
            "sink": torch.randn(heads, generator=g).to(device), "page_slots": PAGE,
            "extra_kv_cache": window, "extra_page_slots": PAGE,
            "extra_indices": torch.randperm(window.shape[0] * PAGE, generator=g)[:batch * WINDOW].view(batch, WINDOW)
            .int().to(device),
            "topk_length": torch.full((batch,), k, dtype=torch.int32, device=device)}
        self.out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(batch, heads, device=device)

    def ours(self, impl: str):
        return sparse_decode_attention(**self.args, out=self.out, lse=self.lse, impl=impl)

    def peer(self, library):
        a = self.args
        library(a["q"], a["kv_cache"], a["indices"], a["sink"], PAGE, self.out, self.lse,
                extra_kv_cache=a["extra_kv_cache"], extra_indices=a["extra_indices"], extra_page_slots=PAGE,
                topk_length=a["topk_length"])
        return self.out, self.lse

    @functools.cached_property
    def checked_rows(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The first and last rows and their fp64 reference ``(out, lse)``."""
        rows = [0, self.out.shape[0] - 1]
        a = {name: value[rows].cpu() if name in ("q", "indices", "extra_indices", "topk_length") else value
             for name, value in self.args.items()}
        return rows, *sparse_decode_attention_reference(
            a["q"], a["kv_cache"].cpu(), a["indices"], a["sink"].cpu(), PAGE, extra_kv_cache=a["extra_kv_cache"].cpu(),
            extra_indices=a["extra_indices"], extra_page_slots=PAGE, topk_length=a["topk_length"])

    def check(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """``out``/``lse`` against the fp64 reference on the first and last rows, within FlashMLA's tolerance."""
        rows, ref_out, ref_lse = self.checked_rows
        torch.testing.assert_close(out[rows].cpu().double(), ref_out, **FLASHMLA_TOL[0])
        torch.testing.assert_close(lse[rows].cpu().double(), ref_lse, **FLASHMLA_TOL[1])


def peer_rows(path: str, cases, time_it, bar, device: str) -> list[dict]:
    """FlashMLA (the peer library at ``path``) and ours on identical inputs, one row per case."""
    from sparsekv.testing.flashmla_peer import FlashMLAPeer

    library = FlashMLAPeer(path)
    biggest = max(b * k for b, k, _ in cases)
    g = torch.Generator().manual_seed(1)
    cache = v4_cache(random_rows(biggest, g), PAGE).cuda()  # every row distinct: no L2 reuse across rows
    window = v4_cache(random_rows(max(b for b, _, _ in cases) * WINDOW, g), PAGE).cuda()
    rows = []
    for batch, k, heads in cases:
        bar.update()
        case = PeerCase(batch, k, heads, cache, window)
        case.check(*case.peer(library))
        peer = time_it(functools.partial(case.peer, library))
        row = {"case": f"peer B{batch} K{k} H{heads}", "batch": batch, "top_k": k, "heads": heads, "window": WINDOW,
               **timing_fields("flashmla", peer)}
        for impl in ("header", "triton"):
            case.check(*case.ours(impl))
            row.update(timing_fields(impl, time_it(functools.partial(case.ours, impl))))
            row[f"{impl}_vs_flashmla"] = row[f"{impl}_us"] / row["flashmla_us"]
        row.update(roofline.fields(roofline.attention(batch, k + WINDOW, heads), peer.median_s, device))
        rows.append(row)
    return rows


def check_topk(tokens: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    for row in range(min(scores.shape[0], 2)):
        expected = torch.topk(scores[row], k, sorted=False).values.sort().values
        if not torch.equal(scores[row, tokens[row].long()].sort().values, expected):
            raise RuntimeError("indexer_topk disagrees with torch.topk")


def serving_cases(backend: str, quick: bool) -> dict:
    """The cases of each part: on the cuda backend the serving shapes (batch 1, 8, 64, 128; top-k
    512, 1024, 2048; C4 lengths 4k, 64k, 256k), ``--quick`` the ones the issue's targets name; on the
    cpu backend a few single-row cases (the host kernels take seconds at serving shapes)."""
    if backend == "cuda" and not quick:
        lengths = (1 << 12, 1 << 16, 1 << 18)
        return {"attention": [(b, k) for b in BATCHES for k in TOPKS],
                "indexer": [(b, e) for b in BATCHES for e in lengths],
                "topk": [(b, e, k) for b in BATCHES for e in lengths for k in TOPKS if k <= e]}
    if backend == "cuda":
        return {"attention": [(1, 512), (64, 512), (128, 2048)], "indexer": [(1, 1 << 16), (64, 1 << 16), (1, 1 << 18)],
                "topk": [(1, 1 << 16, 512), (1, 1 << 18, 512), (64, 1 << 16, 2048)]}
    if quick:
        return {"attention": [(1, 512)], "indexer": [(1, 1 << 16)], "topk": [(1, 1 << 16, 512)]}
    return {"attention": [(b, k) for b in (1, 32) for k in (512, 2048)], "indexer": [(1, 1 << 16), (1, 1 << 18)],
            "topk": [(1, e, k) for e in (1 << 16, 1 << 18) for k in TOPKS]}


def main() -> None:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="append", default=[], metavar="flashmla=PATH",
                        help="time a peer beside ours on the same inputs (cuda): flashmla=PATH, the library "
                             "tools/peers/build_flashmla.sh built or its folder")
    run = open_sweep(parser, stem="dsv4_attention",
                     name="DSV4 sparse decode attention and lightning indexer",
                     baseline="torch (fp64 reference / fp32 torch; torch.topk)", repeats=5,
                     one_thread=True, baseline_threads=1)  # the cpu backend runs on one thread: like with like
    args, result, repeats = run.args, run.result, run.repeats
    peers = dict(spec.split("=", 1) if "=" in spec else (spec, "") for spec in args.peer)
    if set(peers) - {"flashmla"} or not all(peers.values()):
        parser.error(f"--peer takes flashmla=PATH, got {args.peer}")
    if peers and args.backend != "cuda":
        parser.error("--peer runs FlashMLA's kernels: it needs --backend cuda")
    if args.backend == "cpu":  # the Triton twins run on CPU tensors only under the interpreter (read at import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    interpreted = args.backend == "cpu"
    device = device_name(args.backend)
    # The interpreter takes seconds per call at these shapes: one sample, and it is not speed.
    time_triton = functools.partial(time_call, repeats=1, warmup=0, min_time_s=0.0) if interpreted else \
        functools.partial(timer(args.backend), repeats=repeats, warmup=1)
    time_it = functools.partial(timer(args.backend), repeats=repeats, warmup=1, min_time_s=0.0)
    result.notes.update({"heads": HEADS, "page_slots": PAGE, "q_dtype": "bfloat16", "device": device,
                         "triton_timing": ("Triton interpreter on the CPU: NOT speed (numpy per program op), "
                                           "one sample, the first attention case and the top-k only (the "
                                           "indexer scores take minutes per call there); run --backend cuda "
                                           "for GPU figures") if interpreted else
                         "GPU, as notes.timer says", "paper": paper(), "paper_per_impl": paper_per_impl(),
                         "paper_prefill": prefill_paper(),
                         "roofline": "bytes, flops, *_roofline_us and measured_over_roofline (the kernel's device "
                                     "time over the roofline of the GPU it ran on): sparsekv.testing.roofline"})
    cases = serving_cases(args.backend, args.quick)
    peer_cases = (PEER_QUICK if args.quick else PEER_CASES) if peers else []
    bar = tqdm(total=sum(len(v) for v in cases.values()) + len(peer_cases) + 1 + (args.backend == "cuda"),
               desc="bench_dsv4_attention", unit="case", disable=None)
    bar.update()
    # Microsecond calls: each sample loops for 20 ms, so the op layer's cost is not lost in timer noise.
    result.rows.append(op_overhead(args.backend, functools.partial(time_it, min_time_s=0.02)))
    for batch, k in cases["attention"]:
        bar.update()
        case = AttentionCase(batch, k, args.backend)
        checked = min(batch, 2)  # the fp64 reference of every row would take longer than the sweep
        out, _ = case.kernel()
        ref_out, _ = case.reference(checked)
        torch.testing.assert_close(out[:checked].cpu().double(), ref_out, rtol=2e-4, atol=2e-4)
        row = {"case": f"attention B{batch} K{k}", "batch": batch, "top_k": k}
        if not interpreted or (batch, k) == cases["attention"][0]:
            triton_out, _ = case.kernel("triton")
            # The twin's documented bf16-q tolerance: q enters the tensor cores as is, p rounded to bf16 once.
            torch.testing.assert_close(triton_out[:checked].cpu().double(), ref_out, rtol=0,
                                       atol=1e-2 * max(1.0, float(ref_out.abs().max())))
            row.update(timing_fields("triton", time_triton(functools.partial(case.kernel, "triton"))))
        kernel = time_it(case.kernel)
        row.update(timing_fields("kernel", kernel))
        row.update(timing_fields("raw", time_it(case.raw)))
        if batch <= 32:  # the host fp64 reference: the baseline of the cpu sweep
            row["reference_fp64_us"] = time_call(case.reference, repeats=repeats, warmup=1,
                                                 min_time_s=0.0).median_s * 1e6
        row.update(timing_fields("torch_fp32", time_it(case.torch_fp32)))
        row["speedup_vs_torch_fp32"] = row["torch_fp32_us"] / row["kernel_us"]
        row["kernel_gflops"] = case.cost().flops / kernel.median_s / 1e9
        row.update(roofline.fields(case.cost(), kernel.median_s, device))
        result.rows.append(row)
    for batch, entries in cases["indexer"]:
        bar.update()
        case = IndexerCase(entries, args.backend, batch)
        scores = case.kernel_scores().clone()
        torch.testing.assert_close(scores[:1], case.torch_scores(), rtol=1e-4, atol=1e-4)
        row = {"case": f"indexer B{batch} {entries >> 10}k", "batch": batch, "entries": entries}
        if not interpreted:  # minutes per call in the interpreter at 64k entries
            torch.testing.assert_close(case.kernel_scores("triton").clone(), scores, rtol=1e-4, atol=1e-4)
            row.update(timing_fields("triton", time_triton(functools.partial(case.kernel_scores, "triton"))))
        kernel = time_it(case.kernel_scores)
        row.update(timing_fields("kernel", kernel))
        if batch == 1:
            row.update(timing_fields("torch_fp32", time_it(case.torch_scores)))
            row["speedup_vs_torch_fp32"] = row["torch_fp32_us"] / row["kernel_us"]
        row.update(roofline.fields(roofline.indexer_scores(batch, entries, INDEXER_HEADS), kernel.median_s, device))
        result.rows.append(row)
    scored = {}
    for batch, entries, k in cases["topk"]:
        bar.update()
        if (batch, entries) not in scored:
            scored.clear()  # one score table at a time: 128 rows of 256k are 128 MB
            case = IndexerCase(entries, args.backend, batch)
            scored[batch, entries] = (case.kernel_scores().clone(), case.positions)
        scores, positions = scored[batch, entries]
        out = torch.empty(batch, k, dtype=torch.int32, device=scores.device)
        # Given a workspace, as an engine gives it: the header splits a row over several CTAs at small batch.
        workspace = torch.empty(max(1, topk_workspace_ints(batch, entries, k)), dtype=torch.int32,
                                device=scores.device)
        tokens, _ = indexer_topk(scores, positions, k, out=out, workspace=workspace)
        check_topk(tokens, scores, k)
        if not torch.equal(indexer_topk(scores, positions, k)[0], tokens):
            raise RuntimeError("the header's top-k differs with and without its workspace")
        if not torch.equal(indexer_topk(scores, positions, k, impl="triton")[0], tokens):
            raise RuntimeError("the Triton top-k disagrees with the header's")
        row = {"case": f"top-k {k} of {entries >> 10}k B{batch}", "batch": batch, "entries": entries, "top_k": k}
        row.update(timing_fields("triton", time_triton(functools.partial(indexer_topk, scores, positions, k, out=out,
                                                                         workspace=workspace, impl="triton"))))
        kernel = time_it(functools.partial(indexer_topk, scores, positions, k, out=out, workspace=workspace))
        row.update(timing_fields("kernel", kernel))
        row.update(timing_fields("torch_topk", time_it(functools.partial(torch.topk, scores, k, sorted=False))))
        row["speedup_vs_torch_topk"] = row["torch_topk_us"] / row["kernel_us"]
        row.update(roofline.fields(roofline.indexer_topk(batch, entries, k), kernel.median_s, device))
        result.rows.append(row)
    if args.backend == "cuda":
        bar.update()
        result.rows.append(prefill_row(time_it, device))
    if peers:
        result.rows.extend(peer_rows(peers["flashmla"], peer_cases, time_it, bar, device))
    bar.close()
    run.report(lambda r, path: bar_plot(
        r, path, label_key="case",
        value_keys=("kernel_us", "triton_us", "header_us", "flashmla_us", "reference_fp64_us", "torch_fp32_us",
                    "torch_topk_us", "raw_us",
                    "eager_op_us", "compiled_op_us", "graph_replay_us"),
        ylabel="latency (us, log)", log=True))


if __name__ == "__main__":
    main()

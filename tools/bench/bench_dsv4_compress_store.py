"""Benchmark the fused compress-store (pool + norm + RoPE + quantize + store) on one backend against fp32 torch.

Cases (d = 512, the main compressor, into 584-byte V4 pages of 64 slots), for T in {4k, 64k} raw
tokens (``--quick``: 4k only; 3 repeats, else 7), ratio 4 and 128: one prefill chunk of T tokens
through ``CompressorState.extend`` with a ``StoreTarget`` (pool + RMSNorm + RoPE/YaRN + FP8 quantize + store
in one pass, then the ring tail), against

* ``two_pass``: our ``compress_pool`` kernel, then our ``norm_rope_store`` (the unfused path);
* ``torch_fp32`` (the baseline): the float32 pool reference, then the store reference
  ``norm_rope_store_reference``, which emulates the kernel's rounding order and writes bytes.

On paper, per raw token, the GPU kernels move (fp32 inputs ``kv`` and ``score``, coff = 2 for C4):

* fused pass: reads ``2 * coff * d * 4`` B (each token is read once; C4's overlapping A halves come
  from L2/shared memory), writes ``584 / ratio`` B; the ring write stores only the chunk's last
  ring rows (prefill: negligible; decode: one ``2 * coff * d * 4`` B row per token);
* unfused: the pool pass writes ``4 d / ratio`` B of float entries that the store pass reads back.

HBM round trips of the compressed-KV path: ours is **2** at decode (fused pool + norm + RoPE +
quantize + store, then the ring-row write; the state rows a decode step pools are read in the
fused pass) and **1** for a prefill chunk (plus a ring tail of at most ``ring_size`` rows). The
unfused path is 3 (pool -> float entries -> store). Each row reports the fused path's bytes, its
H100 / H200 / B200 roofline times (:func:`sparsekv.testing.roofline.compress_store`) and, on a GPU,
``measured_over_roofline``.

Each row also times the Triton twin of the fused step (``impl="triton"``, V4; its bytes checked
against the header's first where the pooled entries agree): on the GPU with CUDA events
(``triton_ms``); on the cpu backend under the Triton interpreter (``TRITON_INTERPRET=1``, set here
before triton is imported), which is NOT speed, one sample over the first 256 tokens of the 4k cases
(``triton_interpreted_ms``).

Prints JSON; ``--plot PNG`` draws the speedup over torch per case.
"""

from __future__ import annotations

import functools
import os

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4 import RopeParams, StoreTarget, compress_pool, norm_rope_store
from sparsekv.kv_layout import V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import device_name, kernel_sweep, time_call, timer, timing_fields
from sparsekv.testing.reference.dsv4_compress import compress_pool_reference
from sparsekv.testing.reference.dsv4_store import norm_rope_store_reference

D = 512
ROPE = RopeParams(160000, 16, 65536, 32, 1)
PAGE = 64
CASES = tuple((t, ratio) for t in (4096, 65536) for ratio in (4, 128))
QUICK_CASES = ((4096, 4), (4096, 128))
INTERPRETED_TOKENS = 256


def _paper(t: int, ratio: int) -> dict:
    coff = 2 if ratio == 4 else 1
    read = 2 * coff * D * 4
    fused_write = V4.bytes_per_token / ratio
    unfused = read + 2 * (4 * D / ratio) + fused_write
    return {
        "hbm_read_b_per_token": read,
        "hbm_write_b_per_token": round(fused_write, 2),
        "unfused_hbm_b_per_token": round(unfused, 2),
    }


def run_case(t: int, ratio: int, repeats: int, backend: str) -> dict:
    device = device_of(backend)
    coff = 2 if ratio == 4 else 1
    gen = torch.Generator().manual_seed(t + ratio)
    kv, score, ape = (torch.randn(shape, generator=gen).to(device)
                      for shape in ((t, coff * D), (t, coff * D), (ratio, coff * D)))
    entries = t // ratio
    weight = (torch.rand(D) + 0.5).to(device)
    cache = torch.zeros(entries // PAGE + 1, V4.page_bytes(PAGE), dtype=torch.uint8, device=device)
    ring = 2 * (8 if ratio == 4 else 128)
    state = torch.zeros(2 * ring, 2 * coff * D, device=device)
    rope = ROPE.table(t, device)  # anchors are raw positions below t
    target = StoreTarget(cache, weight, 1e-6, PAGE, rope)
    idx = torch.arange(entries, device=device)

    def fused(impl="header", tokens=t, into=target):
        comp = CompressorState(state, ape, ratio, ring_size=ring)
        comp.extend([0], [[1]], [0], kv[:tokens], score[:tokens], store=into, impl=impl,
                    entry_slots=lambda _b, anchor: anchor // ratio)

    def two_pass():
        out = compress_pool(kv, score, ape, ratio)
        norm_rope_store(out, weight, 1e-6, idx * ratio, cache, idx, PAGE, rope)

    def torch_fp32():
        out = compress_pool_reference(kv, score, ape, ratio, dtype=torch.float32)
        norm_rope_store_reference(out, weight, 1e-6, idx * ratio, cache, idx, PAGE, rope.cos, rope.sin)

    time_it = timer(backend)
    ours = time_it(fused, repeats=repeats)
    unfused = time_it(two_pass, repeats=repeats)
    base = time_it(torch_fp32, repeats=repeats)
    row = {"case": f"fused C{ratio} T={t // 1024}k", "kernel_ms": ours.median_s * 1e3,
           "two_pass_ms": unfused.median_s * 1e3, "torch_fp32_ms": base.median_s * 1e3,
           "speedup": base.median_s / ours.median_s, **_paper(t, ratio), **timing_fields("kernel", ours),
           **roofline.fields(roofline.compress_store(t, ratio, D), ours.median_s, device_name(backend))}
    tokens = t
    if backend == "cpu":  # the twin runs on CPU tensors only under the interpreter, read when triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if t > 4096:
            return row
        tokens = INTERPRETED_TOKENS  # seconds per call at 4k tokens: a prefix, one sample, not speed
    caches = {impl: torch.zeros_like(cache) for impl in ("header", "triton")}
    for impl, into in caches.items():
        fused(impl, tokens, StoreTarget(into, weight, 1e-6, PAGE, rope))
    entries = [compress_pool(kv[:tokens], score[:tokens], ape, ratio, impl=impl) for impl in ("header", "triton")]
    if torch.equal(*entries) and not torch.equal(caches["header"], caches["triton"]):
        raise SystemExit(f"bench_dsv4_compress_store: the Triton bytes differ from the header's at C{ratio}")
    triton = functools.partial(fused, "triton", tokens)
    if backend == "cpu":
        return dict(row, triton_interpreted_ms=time_call(triton, repeats=1, warmup=0, min_time_s=0.0).median_s * 1e3)
    return dict(row, triton_ms=time_it(triton, repeats=repeats).median_s * 1e3)


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]),
                 name="dsv4_compress_store prefill (d=512, V4 pages)",
                 baseline="float32 torch reference (pool, then store)", cases=CASES, quick_cases=QUICK_CASES,
                 run_case=run_case,
                 notes=dict(hbm_round_trips_fused=2, hbm_round_trips_unfused=3,
                            triton_timing=f"cuda backend: triton_ms, CUDA events; cpu backend: "
                                          f"triton_interpreted_ms, the Triton interpreter on the first "
                                          f"{INTERPRETED_TOKENS} tokens of the 4k cases, one sample, NOT speed",
                            roofline="sparsekv.testing.roofline.compress_store"),
                 plot=dict(label_key="case", value_keys=("speedup",), ylabel="speedup over float32 torch"),
                 threaded=True)


if __name__ == "__main__":
    main()

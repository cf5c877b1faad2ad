"""Benchmark the DSV4 compressor ``compress_pool`` on one backend against fp32 torch.

Cases (d = 512, the main compressor), for T in {4k, 64k} raw tokens (``--quick``: 4k only; 3
repeats, else 7), ratio 4 and 128: ``compress_pool`` (our kernel) vs the float32 torch reference
(``compress_pool_reference(..., dtype=float32)``: windows by reshape, ``softmax``, weighted sum).
The compressor fused with the store is ``bench_dsv4_compress_store``.

Each row also times the Triton twin (``impl="triton"``, checked against the header's entries
first): on the GPU with CUDA events (``triton_ms``); on the cpu backend under the Triton interpreter
(``TRITON_INTERPRET=1``, set here before triton is imported), which is NOT speed, one sample over the
first 256 tokens of the 4k cases (``triton_interpreted_ms``).

On paper (:func:`sparsekv.testing.roofline.compress`), per raw token, the GPU kernel reads
``2 * coff * d * 4`` B (fp32 ``kv`` and ``score``, coff = 2 for C4; each token is read once, C4's
overlapping A halves come from L2) and writes ``4 d / ratio`` B of float entries. Each row reports
the bytes, the H100 / H200 / B200 roofline times and, on a GPU, ``measured_over_roofline``.

Prints JSON; ``--plot PNG`` draws the speedup over torch per case.
"""

from __future__ import annotations

import functools
import os

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4 import compress_pool
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import device_name, kernel_sweep, time_call, timer, timing_fields
from sparsekv.testing.reference.dsv4_compress import compress_pool_reference

D = 512
CASES = tuple((t, ratio) for t in (4096, 65536) for ratio in (4, 128))
QUICK_CASES = ((4096, 4), (4096, 128))
INTERPRETED_TOKENS = 256


def _inputs(t: int, ratio: int, device: torch.device):
    coff = 2 if ratio == 4 else 1
    gen = torch.Generator().manual_seed(t + ratio)
    shapes = ((t, coff * D), (t, coff * D), (ratio, coff * D))
    return tuple(torch.randn(shape, generator=gen).to(device) for shape in shapes)


def run_case(t: int, ratio: int, repeats: int, backend: str) -> dict:
    kv, score, ape = _inputs(t, ratio, device_of(backend))
    time_it = timer(backend)
    ours = time_it(lambda: compress_pool(kv, score, ape, ratio, impl="header"), repeats=repeats)
    base = time_it(lambda: compress_pool_reference(kv, score, ape, ratio, dtype=torch.float32), repeats=repeats)
    row = {"case": f"pool C{ratio} T={t // 1024}k", "kernel_ms": ours.median_s * 1e3,
           "torch_fp32_ms": base.median_s * 1e3, "speedup": base.median_s / ours.median_s,
           **timing_fields("kernel", ours),
           **roofline.fields(roofline.compress(t, ratio, D), ours.median_s, device_name(backend))}
    if backend == "cpu":  # the twin runs on CPU tensors only under the interpreter, read when triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if t > 4096:
            return row
        # Over a minute per call at 4k tokens: the first INTERPRETED_TOKENS, one sample, not speed.
        kv, score = kv[:INTERPRETED_TOKENS], score[:INTERPRETED_TOKENS]
    triton = functools.partial(compress_pool, kv, score, ape, ratio, impl="triton")
    torch.testing.assert_close(triton(), compress_pool(kv, score, ape, ratio, impl="header"), atol=1e-5, rtol=1e-5)
    if backend == "cpu":
        return dict(row, triton_interpreted_ms=time_call(triton, repeats=1, warmup=0, min_time_s=0.0).median_s * 1e3)
    return dict(row, triton_ms=time_it(triton, repeats=repeats).median_s * 1e3)


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]), name="dsv4_compress compress_pool (d=512)",
                 baseline="float32 torch reference", cases=CASES, quick_cases=QUICK_CASES, run_case=run_case,
                 notes=dict(triton_timing=f"cuda backend: triton_ms, CUDA events; cpu backend: "
                                          f"triton_interpreted_ms, the Triton interpreter on the first "
                                          f"{INTERPRETED_TOKENS} tokens of the 4k cases, one sample, NOT speed"),
                 plot=dict(label_key="case", value_keys=("speedup",), ylabel="speedup over float32 torch"),
                 threaded=True)


if __name__ == "__main__":
    main()

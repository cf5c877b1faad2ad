"""Benchmark ``quantize_fp8_ds_mla`` (rows into a paged V4 cache) against a torch quantizer (``--backend cpu|cuda``).

For N rows (bf16 and float32) quantized into N random distinct slots of a 64-slot-page cache:

* ``kernel``: the public wrapper (slot checks included);
* ``torch``: ``sparsekv.testing.reference.dsv4_quant.quantize_fp8_ds_mla``, the same records
  (448 FP8 E4M3 values with one power-of-two scale per 64, 64 bf16 RoPE values) written with
  torch ops into the same slots: the test oracle, measured in the same run;
* ``triton``: the Triton twin (``impl="triton"``, 32-bit packed stores), same bytes checked: on the
  GPU with CUDA events; on the cpu backend under the Triton interpreter (``TRITON_INTERPRET=1``, set
  here before triton is imported), one sample of the cases up to 64 rows only, and NOT speed
  (``notes.triton_timing``).

The kernel's cache bytes are checked equal to torch's before anything is timed. The cpu backend
of the kernel is one host thread; torch uses ``torch.get_num_threads()`` (``threads`` says so).
Prints JSON; ``--plot PNG`` draws rows per microsecond per case.
"""

from __future__ import annotations

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4_quant import quantize_fp8_ds_mla
from sparsekv.kv_layout import V4
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import (
    INTERPRETED_ROWS,
    TRITON_TIMING,
    device_name,
    kernel_sweep,
    timer,
    timing_fields,
    triton_timer,
)
from sparsekv.testing.reference.dsv4_quant import quantize_fp8_ds_mla as quantize_reference

PAGE_SLOTS = 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CASES = tuple((n, d) for n in (1, 64, 4096, 32768) for d in DTYPES)
QUICK_CASES = ((64, "bf16"), (1024, "bf16"), (1024, "fp32"))


def run_case(n: int, dtype_name: str, repeats: int, backend: str) -> dict:
    time_triton = triton_timer(backend, repeats)  # first: on the cpu backend it turns the interpreter on
    device = device_of(backend)
    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, 512, generator=gen, device=device).to(DTYPES[dtype_name])
    pages = max(1, 2 * n // PAGE_SLOTS)
    slots = torch.randperm(pages * PAGE_SLOTS, generator=gen, device=device)[:n]
    cache = torch.zeros(pages, V4.page_bytes(PAGE_SLOTS), dtype=torch.uint8, device=device)
    expected = cache.clone()
    quantize_reference(x, expected, slots, PAGE_SLOTS)
    quantize_fp8_ds_mla(x, cache, slots, PAGE_SLOTS)
    if not torch.equal(cache, expected):
        raise SystemExit(f"bench_dsv4_quant: kernel bytes differ from the torch quantizer at N={n} {dtype_name}")

    time_it = timer(backend)
    kernel = time_it(lambda: quantize_fp8_ds_mla(x, cache, slots, PAGE_SLOTS), repeats=repeats)
    baseline = time_it(lambda: quantize_reference(x, expected, slots, PAGE_SLOTS), repeats=repeats)
    row = {"case": f"N={n} {dtype_name}", "rows": n, "dtype": dtype_name,
           "kernel_us": kernel.median_s * 1e6, "torch_us": baseline.median_s * 1e6,
           "kernel_rows_per_us": n / (kernel.median_s * 1e6), "torch_rows_per_us": n / (baseline.median_s * 1e6),
           "kernel_vs_torch": baseline.median_s / kernel.median_s, **timing_fields("kernel", kernel),
           **roofline.fields(roofline.quantize(n, x.element_size()), kernel.median_s, device_name(backend))}
    if backend == "cuda" or n <= INTERPRETED_ROWS:
        triton_cache = torch.zeros_like(cache)
        quantize_fp8_ds_mla(x, triton_cache, slots, PAGE_SLOTS, impl="triton")
        if not torch.equal(triton_cache, expected):
            raise SystemExit(f"bench_dsv4_quant: triton bytes differ from the torch quantizer at N={n} {dtype_name}")
        triton = time_triton(lambda: quantize_fp8_ds_mla(x, triton_cache, slots, PAGE_SLOTS, impl="triton"))
        row.update(triton_us=triton.median_s * 1e6, triton_rows_per_us=n / (triton.median_s * 1e6))
    return row


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]), name="dsv4_quant quantize_fp8_ds_mla",
                 baseline="torch reference quantizer (same records, same slots, same run)",
                 cases=CASES, quick_cases=QUICK_CASES, run_case=run_case,
                 notes=dict(page_slots=PAGE_SLOTS, record_bytes=V4.bytes_per_token,
                            triton_timing=TRITON_TIMING),
                 plot=dict(label_key="case", value_keys=("kernel_rows_per_us", "torch_rows_per_us",
                                                         "triton_rows_per_us"),
                           ylabel="rows per microsecond", log=True))


if __name__ == "__main__":
    main()

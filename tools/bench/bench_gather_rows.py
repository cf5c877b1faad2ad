"""Benchmark ``gather_rows`` (indexed byte-row copy) against torch doing the same move (``--backend cpu`` or ``cuda``).

For N rows of R bytes (584 B: one DSV4 token record; 4 KiB: a page-sized row), random source rows
out of 2N and a random permutation of N destination rows:

* ``kernel``: the public wrapper (index checks included);
* ``torch``: ``dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))``, the same move in two
  torch calls (what a caller without the kernel writes), measured in the same run.

The kernel's output is checked against torch's, byte for byte, before anything is timed. GB/s
counts the payload once (``N * R``). Both sides run on ``torch.get_num_threads()`` threads where
they thread at all: the cpu backend of the kernel is one host thread (``threads`` says so). Prints
JSON; ``--plot PNG`` draws GB/s per case.
"""

from __future__ import annotations

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.gather_rows import gather_rows
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import device_name, kernel_sweep, timer, timing_fields

CASES = ((1 << 12, 584), (1 << 14, 584), (1 << 16, 584), (1 << 16, 4096), (1 << 18, 584))
QUICK_CASES = ((1 << 10, 584), (1 << 14, 584))


def run_case(n: int, row_bytes: int, repeats: int, backend: str) -> dict:
    device = device_of(backend)
    gen = torch.Generator(device=device).manual_seed(n + row_bytes)
    src = torch.randint(0, 256, (2 * n, row_bytes), dtype=torch.uint8, generator=gen, device=device)
    dst = torch.zeros(n, row_bytes, dtype=torch.uint8, device=device)
    src_idx = torch.randint(0, 2 * n, (n,), generator=gen, device=device)
    dst_idx = torch.randperm(n, generator=gen, device=device)
    expected = dst.clone().index_copy_(0, dst_idx, src.index_select(0, src_idx))
    gather_rows(dst, dst_idx, src, src_idx)
    if not torch.equal(dst, expected):
        raise SystemExit(f"bench_gather_rows: kernel output differs from torch at {n} x {row_bytes} B")

    time_it = timer(backend)
    kernel = time_it(lambda: gather_rows(dst, dst_idx, src, src_idx), repeats=repeats)
    baseline = time_it(lambda: dst.index_copy_(0, dst_idx, src.index_select(0, src_idx)), repeats=repeats)
    payload = n * row_bytes
    return {"case": f"{n // 1024}k x {row_bytes} B", "rows": n, "row_bytes": row_bytes,
            "kernel_us": kernel.median_s * 1e6, "torch_us": baseline.median_s * 1e6,
            "kernel_gbps": payload / kernel.median_s / 1e9, "torch_gbps": payload / baseline.median_s / 1e9,
            "kernel_vs_torch": baseline.median_s / kernel.median_s, **timing_fields("kernel", kernel),
            **roofline.fields(roofline.gather_rows(n, row_bytes), kernel.median_s, device_name(backend))}


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]), name="gather_rows",
                 baseline="torch index_select + index_copy_ (same rows, same run)",
                 cases=CASES, quick_cases=QUICK_CASES, run_case=run_case,
                 plot=dict(label_key="case", value_keys=("kernel_gbps", "torch_gbps"), ylabel="GB/s (payload once)"))


if __name__ == "__main__":
    main()

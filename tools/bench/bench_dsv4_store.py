"""Benchmark ``norm_rope_store`` (norm + RoPE + quantize + store) against the torch store (``--backend cpu|cuda``).

For N compressed entries into N random distinct slots of a 64-slot-page cache, for each cache kind
(``V4``: 512-wide FP8 + bf16 RoPE, 584 B; ``INDEXER_FP8``: 128-wide, 132 B; ``INDEXER_FP4``:
128-wide, 68 B; the indexer kinds with the Hadamard rotation):

* ``kernel``: the public ``norm_rope_store`` (checks included);
* ``torch``: ``sparsekv.testing.reference.dsv4_store.norm_rope_store_reference``, the same steps
  with torch ops in the kernel's rounding order (the test oracle), measured in the same run;
* ``triton``: the Triton twin (``impl="triton"``, 32-bit packed stores), same bytes checked: on the
  GPU with CUDA events; on the cpu backend under the Triton interpreter, one sample of the cases up
  to 64 entries only, and NOT speed (``notes.triton_timing``).

The kernel's cache bytes are checked equal to torch's before anything is timed. The cpu backend of
the kernel is one host thread; torch uses ``torch.get_num_threads()`` (``threads`` says so). Prints
JSON; ``--plot PNG`` draws entries per microsecond per case.
"""

from __future__ import annotations

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4_store import norm_rope_store
from sparsekv.kv_layout import LAYOUTS
from sparsekv.rope import RopeParams
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
from sparsekv.testing.reference.dsv4_store import norm_rope_store_reference

PAGE_SLOTS = 64
ROPE = RopeParams(160000, 16, 65536, 32, 1)
MAX_POSITION = 1 << 16
WIDTH = {"V4": 512, "INDEXER_FP8": 128, "INDEXER_FP4": 128}
CASES = tuple((n, kind) for n in (64, 4096, 32768) for kind in WIDTH)
QUICK_CASES = ((64, "V4"), (256, "V4"), (256, "INDEXER_FP8"), (256, "INDEXER_FP4"))


def run_case(n: int, kind: str, repeats: int, backend: str) -> dict:
    time_triton = triton_timer(backend, repeats)  # first: on the cpu backend it turns the interpreter on
    device = device_of(backend)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, WIDTH[kind], generator=gen).to(device)
    weight = (1 + 0.1 * torch.randn(WIDTH[kind], generator=gen)).to(device)
    positions = torch.randint(0, MAX_POSITION, (n,), generator=gen).to(device)
    pages = max(1, 2 * n // PAGE_SLOTS)
    slots = torch.randperm(pages * PAGE_SLOTS, generator=gen)[:n].to(device)
    rope = ROPE.table(MAX_POSITION, device)
    cache = torch.zeros(pages, LAYOUTS[kind].page_bytes(PAGE_SLOTS), dtype=torch.uint8, device=device)
    expected = cache.clone()
    norm_rope_store_reference(x, weight, 1e-6, positions, expected, slots, PAGE_SLOTS, rope.cos, rope.sin, kind)
    norm_rope_store(x, weight, 1e-6, positions, cache, slots, PAGE_SLOTS, rope, kind)
    if not torch.equal(cache, expected):
        raise SystemExit(f"bench_dsv4_store: kernel bytes differ from the torch store at N={n} {kind}")

    time_it = timer(backend)
    kernel = time_it(lambda: norm_rope_store(x, weight, 1e-6, positions, cache, slots, PAGE_SLOTS, rope, kind),
                     repeats=repeats)
    baseline = time_it(lambda: norm_rope_store_reference(x, weight, 1e-6, positions, expected, slots, PAGE_SLOTS,
                                                         rope.cos, rope.sin, kind), repeats=repeats)
    row = {"case": f"N={n} {kind}", "entries": n, "cache_kind": kind,
           "kernel_us": kernel.median_s * 1e6, "torch_us": baseline.median_s * 1e6,
           "kernel_entries_per_us": n / (kernel.median_s * 1e6),
           "torch_entries_per_us": n / (baseline.median_s * 1e6),
           "kernel_vs_torch": baseline.median_s / kernel.median_s, **timing_fields("kernel", kernel),
           **roofline.fields(roofline.store(n, WIDTH[kind], LAYOUTS[kind].bytes_per_token), kernel.median_s,
                             device_name(backend))}
    if backend == "cuda" or n <= INTERPRETED_ROWS:
        triton_cache = torch.zeros_like(cache)
        norm_rope_store(x, weight, 1e-6, positions, triton_cache, slots, PAGE_SLOTS, rope, kind, impl="triton")
        if not torch.equal(triton_cache, expected):
            raise SystemExit(f"bench_dsv4_store: triton bytes differ from the torch store at N={n} {kind}")
        triton = time_triton(lambda: norm_rope_store(x, weight, 1e-6, positions, triton_cache, slots, PAGE_SLOTS,
                                                     rope, kind, impl="triton"))
        row.update(triton_us=triton.median_s * 1e6, triton_entries_per_us=n / (triton.median_s * 1e6))
    return row


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]), name="dsv4_store norm_rope_store",
                 baseline="torch reference store (same entries, same slots, same run)",
                 cases=CASES, quick_cases=QUICK_CASES, run_case=run_case,
                 notes=dict(page_slots=PAGE_SLOTS, triton_timing=TRITON_TIMING),
                 plot=dict(label_key="case", value_keys=("kernel_entries_per_us", "torch_entries_per_us",
                                                         "triton_entries_per_us"),
                           ylabel="entries per microsecond", log=True))


if __name__ == "__main__":
    main()

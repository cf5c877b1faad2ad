"""Benchmark ``norm_rope_store`` (norm + RoPE + quantize + store) against the torch store (``--backend cpu|cuda``).

For N compressed entries into N random distinct slots of a 64-slot-page cache, for each cache kind
(``V4``: 512-wide FP8 + bf16 RoPE, 584 B; ``INDEXER_FP8``: 128-wide, 132 B; ``INDEXER_FP4``:
128-wide, 68 B; the indexer kinds with the Hadamard rotation):

* ``kernel``: the public ``norm_rope_store`` (checks included);
* ``torch``: ``sparsekv.testing.reference.dsv4_store.norm_rope_store_reference``, the same steps
  with torch ops in the kernel's rounding order (the test oracle), measured in the same run.

The kernel's cache bytes are checked equal to torch's before anything is timed. The cpu backend of
the kernel is one host thread; torch uses ``torch.get_num_threads()`` (``threads`` says so). Prints
JSON; ``--plot PNG`` draws entries per microsecond per case.
"""

from __future__ import annotations

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4_store import RopeParams, norm_rope_store
from sparsekv.kv_layout import LAYOUTS
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import kernel_sweep, timer
from sparsekv.testing.reference.dsv4_store import norm_rope_store_reference

PAGE_SIZE = 64
ROPE = RopeParams(160000, 16, 65536, 32, 1)
MAX_POSITION = 1 << 16
WIDTH = {"V4": 512, "INDEXER_FP8": 128, "INDEXER_FP4": 128}
CASES = tuple((n, kind) for n in (64, 4096, 32768) for kind in WIDTH)
QUICK_CASES = ((256, "V4"), (256, "INDEXER_FP8"), (256, "INDEXER_FP4"))


def run_case(n: int, kind: str, repeats: int, backend: str) -> dict:
    device = device_of(backend)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, WIDTH[kind], generator=gen).to(device)
    weight = (1 + 0.1 * torch.randn(WIDTH[kind], generator=gen)).to(device)
    positions = torch.randint(0, MAX_POSITION, (n,), generator=gen).to(device)
    pages = max(1, 2 * n // PAGE_SIZE)
    slots = torch.randperm(pages * PAGE_SIZE, generator=gen)[:n].to(device)
    rope = ROPE.table(MAX_POSITION, device)
    cache = torch.zeros(pages, LAYOUTS[kind].page_bytes(PAGE_SIZE), dtype=torch.uint8, device=device)
    expected = cache.clone()
    norm_rope_store_reference(x, weight, 1e-6, positions, expected, slots, PAGE_SIZE, rope.cos, rope.sin, kind)
    norm_rope_store(x, weight, 1e-6, positions, cache, slots, PAGE_SIZE, rope, kind)
    if not torch.equal(cache, expected):
        raise SystemExit(f"bench_dsv4_store: kernel bytes differ from the torch store at N={n} {kind}")

    time_it = timer(backend)
    kernel = time_it(lambda: norm_rope_store(x, weight, 1e-6, positions, cache, slots, PAGE_SIZE, rope, kind),
                     repeats=repeats)
    baseline = time_it(lambda: norm_rope_store_reference(x, weight, 1e-6, positions, expected, slots, PAGE_SIZE,
                                                         rope.cos, rope.sin, kind), repeats=repeats)
    return {"case": f"N={n} {kind}", "entries": n, "cache_kind": kind,
            "kernel_us": kernel.median_s * 1e6, "torch_us": baseline.median_s * 1e6,
            "kernel_entries_per_us": n / (kernel.median_s * 1e6),
            "torch_entries_per_us": n / (baseline.median_s * 1e6),
            "kernel_vs_torch": baseline.median_s / kernel.median_s}


def main() -> None:
    kernel_sweep(CliParser(description=__doc__.splitlines()[0]), name="dsv4_store norm_rope_store",
                 baseline="torch reference store (same entries, same slots, same run)",
                 cases=CASES, quick_cases=QUICK_CASES, run_case=run_case,
                 notes=dict(page_size=PAGE_SIZE),
                 plot=dict(label_key="case", value_keys=("kernel_entries_per_us", "torch_entries_per_us"),
                           ylabel="entries per microsecond", log=True))


if __name__ == "__main__":
    main()

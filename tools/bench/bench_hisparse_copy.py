"""Benchmark the DSV4 token copy (``transfer_cache_dsv4_mla``) and page-row copy (``--backend cpu`` or ``cuda``).

For N tokens x L layers (N x L in {1k x 1, 64k x 1, 64k x 21, 1M x 1}; 1M x 21 would need ~25 GB
and does not fit in 24 GiB), random distinct source and destination slots over pools of N slots:

* ``kernel``: the public wrapper (full id validation included); ``raw``: the module call alone;
* ``torch``: the same move with torch advanced indexing on the zero-copy value/scale views
  (``sparsekv.testing.reference.hisparse_copy.transfer_tokens_``, the test oracle);
* ``memcpy``: the same byte count between two contiguous buffers, the faster of ``ctypes.memmove``
  (glibc, one core, non-temporal stores) and ``torch.Tensor.copy_`` (all threads): the bandwidth
  limit of this machine. Both are reported (``memmove_gbps``, ``copy_gbps``);
* ``pages``: the page-row copy of the same tokens as N / 64 whole pages.

With ``--backend cuda`` every buffer lives on the GPU, ``memcpy`` is a device-to-device
``Tensor.copy_`` of the same bytes, and every candidate is timed with CUDA events.

On the cpu backend everything runs on the same threads (``--threads``, default torch's): the kernel's cpu backend and
torch's indexing use ``torch.get_num_threads()``. Buffers are 2 MiB-aligned and advised for
transparent huge pages (``--no-thp`` to opt out): random slots over hundreds of MB otherwise cost a
page walk per token.

Bytes per token: 584 per layer (576 value + 8 scale) are read and 584 written; GB/s counts the
584 payload bytes once, as memcpy bandwidth does. On paper, an H200 moves a token of all L layers
device -> device in ``2 * 584 * L / 4.8 TB/s`` (read + write HBM: 0.24 ns per token-layer, so 1M
tokens of 1 layer in 0.24 ms) and host <-> device in ``584 * L / 55 GB/s`` over PCIe (10.6 ns per
token-layer, 1M tokens in 11 ms): the PCIe copy is ~44x slower, which is why HiSparse moves only the
misses of each step. Each row carries both numbers: the HBM move as the roofline columns of every
kernel benchmark (``h100_roofline_us``, ``h200_roofline_us``, ``b200_roofline_us``) and the H200's
PCIe time (``h200_pcie_us``), from the GPUs of :mod:`sparsekv.testing.roofline`.

Targets (issue 4): kernel >= 60% of memcpy bandwidth and >= 3x torch. Prints JSON; ``--plot PNG``
draws GB/s per case.
"""

from __future__ import annotations

import ctypes
import math
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.hisparse_copy import (
    HISPARSE_COPY,
    pointer_table,
    transfer_cache_dsv4_mla,
    transfer_pages_dsv4_mla,
)
from sparsekv.kv_layout import V4
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import BenchResult, Timing, bar_plot, bench_args, device_name, report, timer
from sparsekv.testing.reference.hisparse_copy import transfer_tokens_

PAGE_SLOTS = 64
CASES = ((1 << 10, 1), (1 << 16, 1), (1 << 16, 21), (1 << 20, 1))
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
QUICK_CASES = ((1 << 10, 1), (1 << 14, 1), (1 << 14, 4))


def _label(n: int, layers: int) -> str:
    return f"{n // 1024}k x {layers}" if n < 1 << 20 else f"{n >> 20}M x {layers}"


def host_buffer(shape: tuple[int, ...], thp: bool, backend: str = "cpu") -> torch.Tensor:
    """An untouched uint8 buffer starting on a 2 MiB boundary, advised for huge pages before first touch
    (cpu backend); a plain GPU allocation (cuda backend)."""
    if backend == "cuda":
        return torch.empty(shape, dtype=torch.uint8, device="cuda")
    nbytes = math.prod(shape)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    if thp:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes),
                                  ctypes.c_int(MADV_HUGEPAGE))
    return raw[start : start + nbytes].view(shape)


def run_case(n: int, layers: int, repeats: int, torch_repeats: int, thp: bool, backend: str) -> dict:
    pages = n // PAGE_SLOTS
    page_bytes = V4.page_bytes(PAGE_SLOTS)
    gen = torch.Generator(device=device_of(backend)).manual_seed(n + layers)
    src = [host_buffer((pages, page_bytes), thp, backend).random_(0, 256, generator=gen) for _ in range(layers)]
    dst = [host_buffer((pages, page_bytes), thp, backend).fill_(1) for _ in range(layers)]  # no first-write faults
    device = src[0].device
    src_ids, dst_ids = (torch.randperm(n, generator=gen, device=device) for _ in range(2))
    src_pages, dst_pages = (torch.randperm(pages, generator=gen, device=device) for _ in range(2))
    src_ptrs, dst_ptrs = pointer_table(src), pointer_table(dst)
    module = HISPARSE_COPY.module(page_slots=PAGE_SLOTS, backend=backend)
    payload = n * layers * V4.bytes_per_token
    a = host_buffer((payload,), thp, backend).fill_(1)
    b = host_buffer((payload,), thp, backend).fill_(0)

    # The kernel moves the bytes the reference moves (checked once, before anything is timed).
    expected = [t.clone() for t in dst]
    transfer_tokens_(expected, src, src_ids, dst_ids)
    transfer_cache_dsv4_mla(src_ptrs, dst_ptrs, src_ids, dst_ids, src_num_slots=n, dst_num_slots=n)
    if not all(torch.equal(x, y) for x, y in zip(expected, dst)):
        raise SystemExit(f"bench_hisparse_copy: kernel output differs from the reference at {_label(n, layers)}")
    del expected

    candidates = {
        "kernel": lambda: transfer_cache_dsv4_mla(src_ptrs, dst_ptrs, src_ids, dst_ids, src_num_slots=n,
                                                  dst_num_slots=n),
        "raw": lambda: module.transfer_tokens(src_ptrs, dst_ptrs, src_ids, dst_ids, n, n, page_bytes, page_bytes,
                                              torch.get_num_threads()),
        "copy": lambda: b.copy_(a),
        "pages": lambda: transfer_pages_dsv4_mla(src_ptrs, dst_ptrs, src_pages, dst_pages, src_num_pages=pages,
                                                 dst_num_pages=pages),
        "torch": lambda: transfer_tokens_(dst, src, src_ids, dst_ids),
    }
    if backend == "cpu":
        candidates["memmove"] = lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), payload)
    time_fn = timer(backend)
    # Round-robin: each round times every candidate back to back, so a load spike from another
    # process hits all of them alike instead of one; the median over rounds is reported.
    samples: dict[str, list[float]] = {k: [] for k in candidates}
    for r in range(repeats):
        for k, fn in candidates.items():
            if k != "torch" or r < torch_repeats:
                samples[k].append(time_fn(fn, repeats=1, warmup=int(r == 0), min_time_s=0.02).median_s)
    timings = {k: Timing(median_s=statistics.median(v), min_s=min(v), repeats=len(v)) for k, v in samples.items()}

    timings["memcpy"] = min((timings[k] for k in ("memmove", "copy") if k in timings), key=lambda t: t.median_s)
    gbps = {k: payload / t.median_s / 1e9 for k, t in timings.items()}
    pages_payload = pages * layers * page_bytes
    gbps["pages"] = pages_payload / timings["pages"].median_s / 1e9
    return {
        "case": _label(n, layers),
        "tokens": n,
        "layers": layers,
        "payload_bytes": payload,
        **{f"{k}_us": round(t.median_s * 1e6, 1) for k, t in timings.items()},
        **{f"{k}_gbps": round(v, 3) for k, v in gbps.items()},
        "kernel_tokens_per_s": round(n / timings["kernel"].median_s),
        "kernel_vs_memcpy": round(gbps["kernel"] / gbps["memcpy"], 3),
        "kernel_vs_torch": round(timings["torch"].median_s / timings["kernel"].median_s, 1),
        "raw_vs_memcpy": round(gbps["raw"] / gbps["memcpy"], 3),
        "h200_pcie_us": round(payload / roofline.GPUS["H200"].pcie_bytes_per_s * 1e6, 1),
        # The roofline columns of every kernel benchmark: the device -> device move (read + write HBM).
        **roofline.fields(roofline.Cost(2 * payload), timings["kernel"].median_s, device_name(backend)),
    }


def main() -> None:
    parser = CliParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads of the kernel's cpu backend and of torch (default: torch's)")
    parser.add_argument("--no-thp", dest="thp", action="store_false", help="do not advise huge pages")
    args = bench_args(parser)
    torch.set_num_threads(args.threads)
    cases = QUICK_CASES if args.quick else CASES
    repeats, torch_repeats = (3, 1) if args.quick else (7, 3)
    result = BenchResult(name="bench_hisparse_copy",
                         baseline="memcpy of the same bytes; torch indexing",
                         threads={"ours": args.threads if args.backend == "cpu" else "cuda",
                                  "baseline": {"copy_": args.threads, "memmove": 1, "torch": args.threads}})
    for n, layers in tqdm(cases, desc="bench_hisparse_copy", unit="case", disable=None):
        result.rows.append(run_case(n, layers, repeats, torch_repeats, args.thp, args.backend))
    result.notes = {
        "backend": args.backend,
        "timer": "CUDA events" if args.backend == "cuda" else "perf_counter",
        "bytes_per_token_layer": V4.bytes_per_token,
        "page_bytes": V4.page_bytes(PAGE_SLOTS),
        "threads": args.threads,
        "thp": (THP_MODE.read_text().strip() if THP_MODE.exists() else "n/a") if args.thp else "not advised",
        "h200_model": "hbm_us = 2 * payload / 4.8 TB/s (read + write); pcie_us = payload / 55 GB/s",
        "h100_model": "hbm_us = 2 * payload / 3.35 TB/s (read + write); PCIe as the H200's",
        "targets": {"kernel_vs_memcpy": 0.6, "kernel_vs_torch": 3},
    }
    report(result, args, lambda r, path: bar_plot(r, path, label_key="case", ylabel="GB/s (584 B per token-layer)",
                                                  value_keys=["kernel_gbps", "pages_gbps", "memcpy_gbps",
                                                              "torch_gbps"], log=True))


if __name__ == "__main__":
    main()

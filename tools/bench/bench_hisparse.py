"""Benchmark one HiSparse swap-in step (``--backend cpu`` or ``cuda``) against the plain-Python/torch model.

Sweep: (K, H) in {(512, 1024), (2048, 4096)} (plus the DSV4 C4 layout at 512/1024), batch 1 / 8 / 64,
miss rates 0.1 % / 5 % / 20 %. As in sglang's bench, every request row holds tokens ``0..H-1``
(slot i = token i), ``seq_len = H + K + 1`` (the slow path), and the top-k is the first
``K (1 - miss)`` hot tokens plus ``K * miss`` cold tokens from ``[H, H + K)``, shuffled: guaranteed
misses. Each timed call first restores the tables (and the model's state) so every round has the
same misses; the restore alone is timed too and subtracted.

Candidates, all measured in the same run on the same state:

* ``kernel``: the public wrapper ``load_cache_to_device_buffer_{,dsv4_}mla`` (cpu backend: one
  thread; cuda backend: tables and device buffer on the GPU, host cache in pinned memory, timed
  with CUDA events);
* ``raw``: the compiled module's export called directly (the wrapper's Python overhead is the gap);
* ``model`` (baseline): the plain-Python policy (:func:`sparsekv.testing.hisparse_policy.swap_in_step`,
  per request) plus one torch indexing copy of all miss tokens, in place.

Before timing, each case checks that kernel and model produce the same outputs. Item: 584 bytes
(one V4 token) for both layouts. Prints JSON (``--json``), plots latency per case (``--plot``),
``--quick`` runs a short sweep.

``--hot-sweep``: the scanning kernel (baseline) against the indexed one
(:mod:`sparsekv.jit_kernel.hisparse_index`) over H in {1k, 2k, 4k, 8k} and miss rates
{0, 0.1 %, 1 %, 10 %}, K = 512, DSV4 layout, batch 8 (``--quick``: H 1k and 8k, misses 0 and
0.1 %). The indexed kernel is timed twice: from a fresh queue (the common step) and with a queue
that must be compacted first (the step that comes once every ~(H / K) steps at most); the summary
gives each kernel's growth from H = 1k to 8k per miss rate, and each row the table bytes one request
reads and writes (``scan_table_bytes``: 8 H, the LRU row read and rewritten and each slot's token;
``indexed_table_bytes``: 16 per distinct top-k token and ~18 per miss).

On paper, H200 (one block of 512 threads per request): both kernels are latency-bound, not
bandwidth-bound (64 KiB of tables at H = 8k is 14 ns of HBM). The scan walks H / 512 chunks one
after another, each two dependent global loads (LRU entry, then its slot's token, ~0.7 us each) and
two block-wide ranks: ~1.5 us per chunk, ~3 us at H = 1k and ~24 us at H = 8k (sglang measures ~30 us
for its scan at 0.1 % misses). The indexed step is ~3 dependent loads (index, token, queue position),
a 45-stage bitonic sort of 512 keys in shared memory and the appends: ~5 us whatever H is, plus the
compaction step (~H / 512 chunks, ~24 us at 8k) at most once every H / K steps (~1.5 us amortized).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.utils.benchmark as benchmark
from tqdm import tqdm

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.hisparse import (
    load_cache_to_device_buffer_dsv4_mla,
    load_cache_to_device_buffer_mla,
    swap_in_args,
    swap_in_module,
)
from sparsekv.jit_kernel.hisparse_index import ResidentIndex
from sparsekv.kv_layout import V4, c4_page_slots
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import BenchResult, add_backend_arg, add_common_args, bar_plot, report, time_call, timer
from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step

ITEM_BYTES = V4.bytes_per_token
DSV4_PAGE_SLOTS = c4_page_slots(256)


class Case:
    """One batch of requests in the slow path, with the tables, the caches and the model's state."""

    def __init__(self, k: int, h: int, bs: int, miss_rate: float, dsv4: bool, backend: str, seed: int = 0) -> None:
        self.k, self.h, self.bs, self.dsv4 = k, h, bs, dsv4
        gen = torch.Generator().manual_seed(seed)
        columns = h + (DSV4_PAGE_SLOTS if dsv4 else 1)
        self.seq_len = h + k + 1
        host_slots, device_slots = bs * self.seq_len, bs * columns
        if dsv4:
            page = V4.page_bytes(DSV4_PAGE_SLOTS)
            self.host_cache = torch.randint(0, 256, (-(-host_slots // DSV4_PAGE_SLOTS), page), dtype=torch.uint8,
                                            generator=gen)
            self.device_buffer = torch.zeros(-(-device_slots // DSV4_PAGE_SLOTS), page, dtype=torch.uint8)
        else:
            self.host_cache = torch.randint(0, 256, (host_slots, ITEM_BYTES), dtype=torch.uint8, generator=gen)
            self.device_buffer = torch.zeros(device_slots, ITEM_BYTES, dtype=torch.uint8)
        self.host_cache_locs = torch.arange(host_slots, dtype=torch.int64).reshape(bs, self.seq_len)
        self.device_buffer_locs = torch.arange(device_slots, dtype=torch.int32).reshape(bs, columns)
        tokens = torch.full((bs, columns), -1, dtype=torch.int32)
        tokens[:, :h] = torch.arange(h, dtype=torch.int32)
        self.tokens0, self.lru0 = tokens, torch.arange(h, dtype=torch.int16).repeat(bs, 1)
        self.tokens, self.lru = tokens.clone(), self.lru0.clone()
        self.misses = round(k * miss_rate)
        rows = []
        for _ in range(bs):
            row = torch.cat([torch.arange(k - self.misses), h + torch.arange(self.misses)])
            rows.append(row[torch.randperm(k, generator=gen)])
        self.top_k = torch.stack(rows).to(torch.int32)
        self.top_k_lists = self.top_k.tolist()
        self.out = torch.empty(bs, k, dtype=torch.int32)
        self.req = torch.arange(bs, dtype=torch.int32)
        self.seq = torch.full((bs,), self.seq_len, dtype=torch.int32)
        # The model's tables as Python lists (its native form).
        self.locs_lists, self.host_locs_lists = self.device_buffer_locs.tolist(), self.host_cache_locs.tolist()
        self.model0 = [HotBuffer(tokens=list(range(h))) for _ in range(bs)]
        self.model = copy.deepcopy(self.model0)
        # The model moves bytes in host copies of the caches (its native form on any backend).
        self.model_host, self.model_device = self.host_cache, self.device_buffer.clone()
        if backend == "cuda":  # the kernel's side: tables and device buffer on the GPU, host cache pinned
            device = device_of(backend)
            for name in ("top_k", "tokens0", "lru0", "tokens", "lru", "out", "req", "seq", "host_cache_locs",
                         "device_buffer_locs", "device_buffer"):
                setattr(self, name, getattr(self, name).to(device))
            self.host_cache = self.host_cache.pin_memory()
        self.module = swap_in_module(k, h, is_dsv4_layout=dsv4, backend=backend)
        self.raw_args = swap_in_args(self.top_k, self.tokens, self.host_cache_locs, self.device_buffer_locs,
                                     self.host_cache, self.device_buffer, self.out, self.req, self.seq, self.lru,
                                     ITEM_BYTES)
        self.bytes_moved = bs * self.misses * ITEM_BYTES

    # ---- the candidates -------------------------------------------------------------
    def restore_tables(self) -> None:
        self.tokens.copy_(self.tokens0)
        self.lru.copy_(self.lru0)

    def kernel(self) -> None:
        self.restore_tables()
        fn = load_cache_to_device_buffer_dsv4_mla if self.dsv4 else load_cache_to_device_buffer_mla
        fn(self.top_k, self.tokens, self.host_cache_locs, self.device_buffer_locs, self.host_cache,
           self.device_buffer, self.out, self.req, self.seq, self.lru, ITEM_BYTES, self.k, self.h)

    def raw(self) -> None:
        self.restore_tables()
        self.module.load_cache_to_device_buffer(*self.raw_args)

    def restore_model(self) -> None:
        self.model = [HotBuffer(tokens=list(b.tokens), lru=list(b.lru)) for b in self.model0]

    def model_step(self) -> list[list[int]]:
        self.restore_model()
        out, src, dst = [], [], []
        locs, host_locs = self.locs_lists, self.host_locs_lists
        for b, buffer in enumerate(self.model):
            step = swap_in_step(buffer, self.top_k_lists[b], self.seq_len)
            out.append([locs[b][s] if s >= 0 else -1 for s in step.slots])
            src += [host_locs[b][t] for t, _ in step.misses]
            dst += [locs[b][s] for _, s in step.misses]
        self._copy(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
        return out

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if not self.dsv4:
            self.model_device[dst] = self.model_host[src]
            return
        for view in (V4.value_view, V4.scale_view):
            d, h = view(self.model_device, DSV4_PAGE_SLOTS), view(self.model_host, DSV4_PAGE_SLOTS)
            d[dst // DSV4_PAGE_SLOTS, dst % DSV4_PAGE_SLOTS] = h[src // DSV4_PAGE_SLOTS, src % DSV4_PAGE_SLOTS]

    def check(self) -> None:
        """Kernel and model agree on the outputs and on the bytes they moved."""
        self.kernel()
        kernel_out, kernel_bytes = self.out.cpu(), self.device_buffer.cpu()
        model_out = self.model_step()
        if kernel_out.tolist() != model_out or not torch.equal(kernel_bytes, self.model_device):
            raise SystemExit(f"bench_hisparse: kernel and model disagree on {self.describe()}")

    # ---- the indexed kernel (--hot-sweep) ------------------------------------------------
    def use_index(self, *, compact: bool) -> None:
        """Build the resident index of the initial tables; with ``compact`` the LRU queue sits at
        the end of its 2H entries, so the step must compact it first."""
        index = ResidentIndex.build(self.tokens0, self.lru0, self.host_cache_locs.shape[1])
        if compact:
            shift = self.h - self.k + 1  # the tail lands past 2H - K: no room for K appends
            index.queue[:, shift:shift + self.h] = index.queue[:, : self.h].clone()
            index.queue_pos[:, : self.h] += shift
            index.queue_pos[:, self.h:] += shift
        self.index0 = index
        self.index = ResidentIndex(*(t.clone() for t in (index.slot_of, index.queue, index.queue_pos)))

    def restore_index(self) -> None:
        for live, saved in ((self.index.slot_of, self.index0.slot_of), (self.index.queue, self.index0.queue),
                            (self.index.queue_pos, self.index0.queue_pos)):
            live.copy_(saved)
        self.tokens.copy_(self.tokens0)

    def indexed(self) -> None:
        self.restore_index()
        fn = load_cache_to_device_buffer_dsv4_mla if self.dsv4 else load_cache_to_device_buffer_mla
        fn(self.top_k, self.tokens, self.host_cache_locs, self.device_buffer_locs, self.host_cache,
           self.device_buffer, self.out, self.req, self.seq, self.lru, ITEM_BYTES, self.k, self.h,
           resident_index=self.index)

    def check_indexed(self) -> None:
        """The indexed kernel's outputs and bytes are the scanning kernel's."""
        self.kernel()
        scan_out, scan_bytes = self.out.clone(), self.device_buffer.clone()
        self.indexed()
        if not (torch.equal(self.out, scan_out) and torch.equal(self.device_buffer, scan_bytes)):
            raise SystemExit(f"bench_hisparse: indexed and scanning kernels disagree on {self.describe()}")

    def describe(self) -> str:
        return f"K={self.k} H={self.h} bs={self.bs} misses={self.misses} {'dsv4' if self.dsv4 else 'generic'}"


def sweep(quick: bool) -> list[tuple[int, int, bool, int, float]]:
    shapes = [(512, 1024, False), (512, 1024, True)] + ([] if quick else [(2048, 4096, False)])
    batches = [1, 8] if quick else [1, 8, 64]
    rates = [0.001, 0.2] if quick else [0.001, 0.05, 0.2]
    return [(k, h, dsv4, bs, rate) for k, h, dsv4 in shapes for bs in batches for rate in rates]


def _thread_time(fn) -> float:
    start = time.thread_time()
    fn()
    return max(time.thread_time() - start, 1e-6)


HOT_SWEEP_K = 512
HOT_SWEEP_BATCH = 8


def hot_sweep(args: argparse.Namespace) -> None:
    """Scanning vs indexed swap-in over H and miss rates (see the module docstring)."""
    hots = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192]
    rates = [0.0, 0.001] if args.quick else [0.0, 0.001, 0.01, 0.1]
    repeats = 3 if args.quick else 7
    result = BenchResult(name=f"hisparse swap-in, scanning vs indexed over H ({args.backend} backend)",
                         baseline="scan", threads={"ours": 1 if args.backend == "cpu" else "cuda",
                                                   "baseline": 1 if args.backend == "cpu" else "cuda"},
                         notes={"num_top_k": HOT_SWEEP_K, "batch": HOT_SWEEP_BATCH, "layout": "dsv4",
                                                 "backend": args.backend, "item_bytes": ITEM_BYTES,
                                                 "latency": "per step, min over repeats, table restore "
                                                            "subtracted",
                                                 "timer": "thread CPU time (torch.utils.benchmark)" if
                                                 args.backend == "cpu" else "CUDA events"})
    time_kernel = timer(args.backend)

    def best(fn) -> float:
        if args.backend == "cpu":
            # The calling thread's CPU time (the cpu backend runs the kernel on it): on a shared
            # machine wall-clock medians of these sub-millisecond calls moved several-fold between runs.
            timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, timer=time.thread_time)
            number = max(1, round(0.02 / _thread_time(fn)))
            return min(timer.timeit(number).mean for _ in range(repeats))
        return time_kernel(fn, repeats=repeats).min_s

    for h, rate in tqdm([(h, r) for h in hots for r in rates], desc="bench_hisparse --hot-sweep", unit="case"):
        case = Case(HOT_SWEEP_K, h, HOT_SWEEP_BATCH, rate, True, args.backend)
        case.use_index(compact=False)
        case.check_indexed()
        scan_s = best(case.kernel) - best(case.restore_tables)
        restore_index_s = best(case.restore_index)
        indexed_s = best(case.indexed) - restore_index_s
        case.use_index(compact=True)
        case.check_indexed()
        compact_s = best(case.indexed) - restore_index_s
        result.rows.append({
            "case": f"H{h} miss{rate:g}", "hot_buffer_size": h, "miss_rate": rate,
            "misses_per_request": case.misses, "scan_us": scan_s * 1e6, "indexed_us": indexed_s * 1e6,
            "indexed_compacting_us": compact_s * 1e6, "speedup_vs_scan": scan_s / indexed_s,
            # Per request. Scan: the LRU row read and rewritten (2 B each) and each slot's token (4 B).
            # Indexed: per distinct wanted token its index entry, token and queue position (2 + 4 + 4 B)
            # and its re-append (2 + 4 B); per miss the head's queue entry and position (2 + 4 B), the
            # evicted token (4 B), two index entries and the slot's token written (2 + 2 + 4 B).
            "scan_table_bytes": 8 * h, "indexed_table_bytes": 16 * HOT_SWEEP_K + 18 * case.misses,
        })
    growth = {}
    for rate in rates:
        rows = {r["hot_buffer_size"]: r for r in result.rows if r["miss_rate"] == rate}
        lo, hi = rows[hots[0]], rows[hots[-1]]
        growth[f"miss{rate:g}"] = {key: hi[f"{key}_us"] / lo[f"{key}_us"] for key in ("scan", "indexed")}
    result.notes[f"growth_H{hots[0]}_to_H{hots[-1]}"] = growth
    report(result, args, plot=lambda r, path: bar_plot(r, path, label_key="case",
                                                        value_keys=("scan_us", "indexed_us", "indexed_compacting_us"),
                                                        ylabel="step latency (us, log)", log=True))


def main() -> None:
    parser = CliParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    add_backend_arg(parser)
    parser.add_argument("--hot-sweep", action="store_true",
                        help="scanning vs indexed swap-in over H in {1k..8k} and miss rates {0..10%%}")
    args = parser.parse_args()
    if args.hot_sweep:
        torch.set_num_threads(1)
        hot_sweep(args)
        return
    # One thread for everything: the kernel's cpu backend runs one request after another on one
    # thread, and torch's pool would only add spin-wait noise to the table restores on a busy machine.
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 5
    result = BenchResult(name=f"hisparse swap-in step ({args.backend} backend, 1 host thread)", baseline="model",
                         threads={"ours": 1 if args.backend == "cpu" else "cuda", "baseline": 1},
                         notes={"item_bytes": ITEM_BYTES, "backend": args.backend,
                                "timer": "CUDA events" if args.backend == "cuda" else "perf_counter",
                                "latency": "per step, table restore subtracted"})
    time_kernel = timer(args.backend)
    for k, h, dsv4, bs, rate in tqdm(sweep(args.quick), desc="bench_hisparse", unit="case"):
        case = Case(k, h, bs, rate, dsv4, args.backend)
        case.check()
        # The model takes up to seconds per step at bs 64: fewer, single-call samples there.
        slow = dict(repeats=repeats, warmup=1, min_time_s=0.0)
        restore_s = time_kernel(case.restore_tables, repeats=repeats).median_s
        restore_model_s = time_call(case.restore_model, **slow).median_s
        kernel_s = time_kernel(case.kernel, repeats=repeats).median_s - restore_s
        raw_s = time_kernel(case.raw, repeats=repeats).median_s - restore_s
        model_s = time_call(case.model_step, **slow).median_s - restore_model_s
        result.rows.append({
            "case": f"K{k}/H{h}{'/dsv4' if dsv4 else ''} bs{bs} miss{rate:g}",
            "num_top_k": k, "hot_buffer_size": h, "layout": "dsv4" if dsv4 else "generic", "batch": bs,
            "miss_rate": rate, "misses_per_request": case.misses, "bytes_moved": case.bytes_moved,
            "kernel_us": kernel_s * 1e6, "raw_us": raw_s * 1e6, "model_us": model_s * 1e6,
            "speedup_vs_model": model_s / kernel_s, "kernel_gbps": case.bytes_moved / kernel_s / 1e9,
        })
    report(result, args, plot=lambda r, path: bar_plot(r, path, label_key="case",
                                                        value_keys=("kernel_us", "raw_us", "model_us"),
                                                        ylabel="step latency (us, log)", log=True))


if __name__ == "__main__":
    main()

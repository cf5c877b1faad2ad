"""Benchmark the indexed HiSparse swap-in against the scanning one (``--backend cpu`` or ``cuda``).

The scanning swap-in (baseline) against the indexed one
(:mod:`sparsekv.jit_kernel.hisparse_index`) over H in {1k, 2k, 4k, 8k} and miss rates
{0, 0.1 %, 1 %, 10 %}, K = 512, DSV4 layout, batch 8 (``--quick``: H 1k and 8k, misses 0 and
0.1 %). The indexed kernel is timed twice: from a fresh queue (the common step) and with a queue
that must be compacted first (the step that comes once every ~(H / K) steps at most). Both kernels
are also timed under ``policy="near_lru"`` (``scan_near_lru_us``, ``indexed_near_lru_us``: the
protected LRU loads what LRU loads on these top-k sets, so the columns are the policy's cost). The
summary gives each kernel's growth from H = 1k to 8k per miss rate, and each row the table bytes one request
reads and writes (``scan_table_bytes``: 8 H, the LRU row read and rewritten and each slot's token;
``indexed_table_bytes``: 16 per distinct top-k token and ~18 per miss).

On paper, H200 (one block of 512 threads per request): both kernels are latency-bound, not
bandwidth-bound (64 KiB of tables at H = 8k is 14 ns of HBM). The scan walks H / 512 chunks one
after another, each two dependent global loads (LRU entry, then its slot's token, ~0.7 us each) and
two block-wide ranks: ~1.5 us per chunk, ~3 us at H = 1k and ~24 us at H = 8k (sglang measures ~30 us
for its scan at 0.1 % misses). The indexed step is ~3 dependent loads (index, token, queue position),
a 45-stage bitonic sort of 512 keys in shared memory and the appends: ~5 us whatever H is, plus the
compaction step (~H / 512 chunks, ~24 us at 8k) at most once every H / K steps (~1.5 us amortized).

The cases are :class:`bench_hisparse.Case` (the swap-in benchmark's batch in the slow path) with the
indexed kernel's state added; before timing, each checks that the indexed kernel's outputs and bytes
are the scanning kernel's. Prints JSON (``--json``), plots latency per case (``--plot``), ``--quick``
runs a short sweep.
"""

from __future__ import annotations

import time

import torch
import torch.utils.benchmark as benchmark
from bench_hisparse import ITEM_BYTES, Case  # the sibling script: benchmarks run as files from their folder

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_dsv4_mla, load_cache_to_device_buffer_mla
from sparsekv.jit_kernel.hisparse_index import ResidentIndex
from sparsekv.testing import roofline
from sparsekv.testing.bench import Sweep, bar_plot, device_name, open_sweep, timer


class IndexedCase(Case):
    """A swap-in case that also runs the indexed kernel on the same tables."""

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

    def indexed(self, policy: str = "lru") -> None:
        self.restore_index()
        fn = load_cache_to_device_buffer_dsv4_mla if self.dsv4 else load_cache_to_device_buffer_mla
        fn(self.top_k, self.tokens, self.host_cache_locs, self.device_buffer_locs, self.host_cache,
           self.device_buffer, self.out, self.req, self.seq, self.lru, ITEM_BYTES, self.k, self.h,
           resident_index=self.index, policy=policy)

    def indexed_near_lru(self) -> None:
        self.indexed("near_lru")

    def check_indexed(self, policy: str = "lru") -> None:
        """The indexed kernel's outputs and bytes are the scanning kernel's under ``policy``."""
        self.kernel(policy)
        scan_out, scan_bytes = self.out.clone(), self.device_buffer.clone()
        self.indexed(policy)
        if not (torch.equal(self.out, scan_out) and torch.equal(self.device_buffer, scan_bytes)):
            raise SystemExit(f"bench_hisparse_index: indexed and scanning kernels disagree on {self.describe()} "
                             f"({policy})")


def _thread_time(fn) -> float:
    start = time.thread_time()
    fn()
    return max(time.thread_time() - start, 1e-6)


HOT_SWEEP_K = 512
HOT_SWEEP_BATCH = 8


def hot_sweep(run: Sweep) -> None:
    """Scanning vs indexed swap-in over H and miss rates (see the module docstring)."""
    args = run.args
    hots = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192]
    rates = [0.0, 0.001] if args.quick else [0.0, 0.001, 0.01, 0.1]
    result, repeats = run.result, run.repeats
    if args.backend == "cpu":
        result.notes["timer"] = "thread CPU time (torch.utils.benchmark)"  # see best()
    time_kernel = timer(args.backend)

    def best(fn) -> float:
        if args.backend == "cpu":
            # The calling thread's CPU time (the cpu backend runs the kernel on it): on a shared
            # machine wall-clock medians of these sub-millisecond calls moved several-fold between runs.
            timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, timer=time.thread_time)
            number = max(1, round(0.02 / _thread_time(fn)))
            return min(timer.timeit(number).mean for _ in range(repeats))
        return time_kernel(fn, repeats=repeats).min_s

    for h, rate in run.cases([(h, r) for h in hots for r in rates]):
        case = IndexedCase(HOT_SWEEP_K, h, HOT_SWEEP_BATCH, rate, True, args.backend)
        case.use_index(compact=False)
        case.check_indexed()
        case.check_indexed("near_lru")
        restore_s = best(case.restore_tables)
        scan_s = best(case.kernel) - restore_s
        scan_near_s = best(case.kernel_near_lru) - restore_s
        restore_index_s = best(case.restore_index)
        indexed_s = best(case.indexed) - restore_index_s
        indexed_near_s = best(case.indexed_near_lru) - restore_index_s
        case.use_index(compact=True)
        case.check_indexed()
        compact_s = best(case.indexed) - restore_index_s
        result.rows.append({
            "case": f"H{h} miss{rate:g}", "hot_buffer_size": h, "miss_rate": rate,
            "misses_per_request": case.misses, "scan_us": scan_s * 1e6, "indexed_us": indexed_s * 1e6,
            "indexed_compacting_us": compact_s * 1e6, "speedup_vs_scan": scan_s / indexed_s,
            # near_lru (the protected LRU), each kernel: the same loads as LRU here, so the policy's cost.
            "scan_near_lru_us": scan_near_s * 1e6, "indexed_near_lru_us": indexed_near_s * 1e6,
            "near_lru_speedup_vs_scan": scan_near_s / indexed_near_s,
            # Per request. Scan: the LRU row read and rewritten (2 B each) and each slot's token (4 B).
            # Indexed: per distinct wanted token its index entry, token and queue position (2 + 4 + 4 B)
            # and its re-append (2 + 4 B); per miss the head's queue entry and position (2 + 4 B), the
            # evicted token (4 B), two index entries and the slot's token written (2 + 2 + 4 B).
            "scan_table_bytes": 8 * h, "indexed_table_bytes": 16 * HOT_SWEEP_K + 18 * case.misses,
            **roofline.fields(roofline.swap_in(HOT_SWEEP_BATCH, HOT_SWEEP_K, HOT_SWEEP_BATCH * case.misses),
                              indexed_s, device_name(args.backend)),
        })
    growth = {}
    for rate in rates:
        rows = {r["hot_buffer_size"]: r for r in result.rows if r["miss_rate"] == rate}
        lo, hi = rows[hots[0]], rows[hots[-1]]
        growth[f"miss{rate:g}"] = {key: hi[f"{key}_us"] / lo[f"{key}_us"]
                                   for key in ("scan", "indexed", "scan_near_lru", "indexed_near_lru")}
    result.notes[f"growth_H{hots[0]}_to_H{hots[-1]}"] = growth
    run.report(lambda r, path: bar_plot(r, path, label_key="case",
                                        value_keys=("scan_us", "indexed_us", "indexed_compacting_us",
                                                    "scan_near_lru_us", "indexed_near_lru_us"),
                                        ylabel="step latency (us, log)", log=True))


def main() -> None:
    hot_sweep(open_sweep(
        CliParser(description=__doc__.splitlines()[0]), stem="hisparse_index",
        name="hisparse swap-in, scanning vs indexed over H", baseline="scan", one_thread=True,
        notes={"num_top_k": HOT_SWEEP_K, "batch": HOT_SWEEP_BATCH, "layout": "dsv4", "item_bytes": ITEM_BYTES,
               "latency": "per step, min over repeats, table restore subtracted"}))


if __name__ == "__main__":
    main()

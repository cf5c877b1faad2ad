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
* ``near_lru``: the wrapper with ``policy="near_lru"`` (the protected LRU: up to 3 bucket
  lookups per non-hit slot, a second victim order, the LRU row compacted by victim rank); here it
  loads what LRU loads, so the column is the policy's cost per step (``near_lru_over_lru``);
* ``model`` (baseline): the plain-Python policy (:func:`sparsekv.testing.hisparse_policy.swap_in_step`,
  per request) plus one torch indexing copy of all miss tokens, in place.

Before timing, each case checks that kernel and model produce the same outputs. Item: 584 bytes
(one V4 token) for both layouts. Prints JSON (``--json``), plots latency per case (``--plot``),
``--quick`` runs a short sweep.

The indexed swap-in (:mod:`sparsekv.jit_kernel.hisparse_index`) has its own benchmark,
``bench_hisparse_index.py``, built on this one's :class:`Case`.
"""

from __future__ import annotations

import copy

import torch

from sparsekv.cli import CliParser
from sparsekv.jit_kernel.hisparse import (
    load_cache_to_device_buffer_dsv4_mla,
    load_cache_to_device_buffer_mla,
    swap_in_args,
    swap_in_module,
)
from sparsekv.kv_layout import V4, c4_page_slots
from sparsekv.testing import roofline
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import bar_plot, device_name, open_sweep, time_call, timer
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

    def kernel(self, policy: str = "lru") -> None:
        self.restore_tables()
        fn = load_cache_to_device_buffer_dsv4_mla if self.dsv4 else load_cache_to_device_buffer_mla
        fn(self.top_k, self.tokens, self.host_cache_locs, self.device_buffer_locs, self.host_cache,
           self.device_buffer, self.out, self.req, self.seq, self.lru, ITEM_BYTES, self.k, self.h, policy=policy)

    def kernel_near_lru(self) -> None:
        self.kernel("near_lru")

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

    def describe(self) -> str:
        return f"K={self.k} H={self.h} bs={self.bs} misses={self.misses} {'dsv4' if self.dsv4 else 'generic'}"


def sweep(quick: bool) -> list[tuple[int, int, bool, int, float]]:
    shapes = [(512, 1024, False), (512, 1024, True)] + ([] if quick else [(2048, 4096, False)])
    batches = [1, 8] if quick else [1, 8, 64]
    rates = [0.001, 0.2] if quick else [0.001, 0.05, 0.2]
    cases = [(k, h, dsv4, bs, rate) for k, h, dsv4 in shapes for bs in batches for rate in rates]
    # The target shape (0.1 % misses, batch 64, K 512, DSV4) is in the quick sweep too.
    return cases + ([(512, 1024, True, 64, 0.001)] if quick else [])


def main() -> None:
    # One thread for everything: the kernel's cpu backend runs one request after another on one
    # thread, and torch's pool would only add spin-wait noise to the table restores on a busy machine.
    run = open_sweep(CliParser(description=__doc__.splitlines()[0]), stem="hisparse",
                     name="hisparse swap-in step ({backend} backend, 1 host thread)", baseline="model", repeats=5,
                     one_thread=True, baseline_threads=1,
                     notes={"item_bytes": ITEM_BYTES, "latency": "per step, table restore subtracted"})
    args, result, repeats = run.args, run.result, run.repeats
    time_kernel = timer(args.backend)
    for k, h, dsv4, bs, rate in run.cases(sweep(args.quick)):
        case = Case(k, h, bs, rate, dsv4, args.backend)
        case.check()
        # The model takes up to seconds per step at bs 64: fewer, single-call samples there.
        slow = dict(repeats=repeats, warmup=1, min_time_s=0.0)
        restore_s = time_kernel(case.restore_tables, repeats=repeats).median_s
        restore_model_s = time_call(case.restore_model, **slow).median_s
        kernel_s = time_kernel(case.kernel, repeats=repeats).median_s - restore_s
        raw_s = time_kernel(case.raw, repeats=repeats).median_s - restore_s
        model_s = time_call(case.model_step, **slow).median_s - restore_model_s
        near_s = time_kernel(case.kernel_near_lru, repeats=repeats).median_s - restore_s
        result.rows.append({
            "case": f"K{k}/H{h}{'/dsv4' if dsv4 else ''} bs{bs} miss{rate:g}",
            "num_top_k": k, "hot_buffer_size": h, "layout": "dsv4" if dsv4 else "generic", "batch": bs,
            "miss_rate": rate, "misses_per_request": case.misses, "bytes_moved": case.bytes_moved,
            "kernel_us": kernel_s * 1e6, "raw_us": raw_s * 1e6, "model_us": model_s * 1e6,
            "near_lru_us": near_s * 1e6, "near_lru_over_lru": near_s / kernel_s,
            "speedup_vs_model": model_s / kernel_s, "kernel_gbps": case.bytes_moved / kernel_s / 1e9,
            **roofline.fields(roofline.swap_in(bs, k, bs * case.misses, ITEM_BYTES), kernel_s,
                              device_name(args.backend)),
        })
    run.report(lambda r, path: bar_plot(r, path, label_key="case", value_keys=("kernel_us", "raw_us", "near_lru_us",
                                                                               "model_us"),
                                        ylabel="step latency (us, log)", log=True))


if __name__ == "__main__":
    main()

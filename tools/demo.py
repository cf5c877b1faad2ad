"""The main job, end to end on the CPU backend: serve the C4 layers of a DSV4-class model with HiSparse.

1. Plan: how many tokens a DSV4-Flash rank holds with HiSparse (``sparsekv plan-memory``).
2. Build a small real stack: allocator, device C4 pool, paged host pool, coordinator, with the
   production swap-in instance (top-k 512, hot buffer 1024 per request and layer).
3. Prefill four long requests (8K-20K tokens: 2K-5K C4 entries each, all longer than the hot
   buffer), back them up to the host and shrink them to their hot buffers.
4. Decode: every step writes the new C4 entry where the coordinator routes it, then resolves each
   layer's top-k (a slowly drifting set) with the JIT swap-in kernel. Every slot it returns is
   checked byte for byte against the token's bytes; misses are counted on the device.
5. Compare the kernel's loads with the pure-Python LRU model and Belady's offline optimum on the
   same trace, then finish every request and check that nothing leaked.

Everything printed is measured in this run. Exits non-zero if any check fails.

Example::

    make demo              # or, in the activated venv:
    python tools/demo.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch

from sparsekv.cli import CliParser
from sparsekv.cli import main as cli_main
from sparsekv.jit_kernel.hisparse import swap_in_module
from sparsekv.kv_layout import V4, c4_page_slots
from sparsekv.srt.managers.hisparse_coordinator import HiSparseCoordinator
from sparsekv.srt.mem_cache.allocators import HiSparseTokenToKVPoolAllocator
from sparsekv.srt.mem_cache.hisparse_device_pool import HiSparseC4DevicePool
from sparsekv.srt.streams import CpuStreams
from sparsekv.testing.hisparse_traces import RequestTrace, Trace, replay

TOP_K, HOT, C4_LAYERS, PAGE = 512, 1024, 4, 256
SLOTS = c4_page_slots(PAGE)  # C4 slots per page
PROMPTS = (16384, 12288, 20480, 8192)
DECODE_STEPS = 64
DRIFT = 0.05  # fraction of a layer's top-k replaced each step
MAX_CONTEXT = 32768


@dataclass
class Req:
    req_pool_idx: int
    kv_allocated_len: int


class DriftingTopK:
    """The indexer's choice for one (request, layer): a set that drifts, biased to recent entries."""

    def __init__(self, rng: random.Random, c4_len: int):
        self.rng = rng
        self.members = set(rng.sample(range(c4_len), TOP_K))

    def step(self, c4_len: int) -> list[int]:
        for victim in self.rng.sample(sorted(self.members), int(TOP_K * DRIFT)):
            self.members.discard(victim)
        while len(self.members) < TOP_K:
            recent = self.rng.random() < 0.5
            self.members.add(c4_len - 1 - self.rng.randrange(min(256, c4_len)) if recent
                             else self.rng.randrange(c4_len))
        picks = sorted(self.members)
        self.rng.shuffle(picks)
        return picks


def token_rows(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 584]``: value and scale bytes of V4 slots of a page buffer."""
    page, slot = slots // SLOTS, slots % SLOTS
    return torch.cat([V4.value_view(pages, SLOTS)[page, slot], V4.scale_view(pages, SLOTS)[page, slot]], dim=1)


def write_rows(pages: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    page, slot = slots // SLOTS, slots % SLOTS
    V4.value_view(pages, SLOTS)[page, slot] = rows[:, : V4.value_bytes]
    V4.scale_view(pages, SLOTS)[page, slot] = rows[:, V4.value_bytes :]


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"demo: check failed: {what}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CliParser(prog="tools/demo.py", description=__doc__.split("\n\n")[0],
                       epilog="example:\n  python tools/demo.py   (or: make demo)",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parse_args(argv)
    print("[1] Plan: DSV4-Flash, one rank, 60 GiB for KV, HiSparse host:device 2 (sparsekv plan-memory --json)")
    check(cli_main(["plan-memory", "--model", "dsv4-flash", "--kv-budget", "60GiB", "--hisparse", "2", "--json"]) == 0,
          "plan-memory")

    rng = random.Random(0)
    torch.manual_seed(0)
    req_to_token = torch.zeros(len(PROMPTS), MAX_CONTEXT, dtype=torch.int64)
    allocator = HiSparseTokenToKVPoolAllocator(sum(PROMPTS) + PAGE * len(PROMPTS), PAGE, host_to_device_ratio=2)
    device_pool = HiSparseC4DevicePool(allocator, C4_LAYERS, "cpu")
    coord = HiSparseCoordinator(type("Pool", (), {"req_to_token": req_to_token})(), allocator, device_pool,
                                top_k=TOP_K, device_buffer_size=HOT, streams=CpuStreams(), collect_counters=True)
    host_pool = coord.mem_pool_host
    # The bytes every C4 entry must have, per request and layer (what the model's compressor wrote).
    truth = [torch.randint(0, 256, (C4_LAYERS, MAX_CONTEXT // 4, V4.bytes_per_token), dtype=torch.uint8)
             for _ in PROMPTS]
    print(f"\n[2] Stack on cpu: {C4_LAYERS} C4 layers, device pool {device_pool.num_pages} pages x "
          f"{device_pool.page_bytes} B per layer, host pool {host_pool.num_pages} pages; "
          f"top-k {TOP_K}, hot buffer {HOT} (+1 page) per request and layer")

    reqs = [Req(rid, 0) for rid in range(len(PROMPTS))]
    start = time.perf_counter()
    for req, prompt in zip(reqs, PROMPTS):
        full = allocator.alloc_extend(req_to_token, req.req_pool_idx, 0, prompt)
        req.kv_allocated_len = prompt
        slots = allocator.device_slots(allocator.compressed_locs(full)).tensor
        for layer in range(C4_LAYERS):
            write_rows(device_pool.kv_buffer[layer], slots, truth[req.req_pool_idx][layer, : slots.numel()])
        coord.admit_request_into_staging(req)
    ready = coord.collect_ready_reqs()
    check([r.req_pool_idx for r in ready] == [r.req_pool_idx for r in reqs], "every staged request became ready")
    for req in reqs:
        n = coord.host_token_len(req.kv_allocated_len)
        host_slots = coord.req_to_host_pool[req.req_pool_idx, :n]
        for layer in range(C4_LAYERS):
            check(torch.equal(token_rows(host_pool.kv_buffer[layer], host_slots), truth[req.req_pool_idx][layer, :n]),
                  "host backup holds the prefill's bytes")
    stats = coord.get_token_stats()
    print(f"\n[3] Prefilled {len(PROMPTS)} requests ({sum(PROMPTS):,} tokens, {sum(PROMPTS) // 4:,} C4 entries per "
          f"layer) and backed them up to the host in {time.perf_counter() - start:.2f} s; host bytes verified. "
          f"Device now holds only the hot buffers: {stats['device_used']:,} of {stats['device_total']:,} slots; "
          f"host {stats['host_used']:,} of {stats['host_total']:,}")

    indexers = {(r.req_pool_idx, layer): DriftingTopK(rng, coord.host_token_len(r.kv_allocated_len))
                for r in reqs for layer in range(C4_LAYERS)}
    traces = {key: [] for key in indexers}
    rids = torch.tensor([r.req_pool_idx for r in reqs])
    swap_in_module(TOP_K, HOT, is_dsv4_layout=True)  # load (or build) the kernel before timing it
    checked, swap_us = 0, []
    for _ in range(DECODE_STEPS):
        out_locs = []
        for req in reqs:
            req.kv_allocated_len += 1
            out_locs.append(allocator.alloc_decode(req_to_token, req.req_pool_idx, req.kv_allocated_len))
        coord.map_last_loc_to_buffer(rids.tolist(), [r.kv_allocated_len for r in reqs], out_locs)
        for req, loc in zip(reqs, out_locs):
            if req.kv_allocated_len % 4 == 0:  # this token completed a C4 entry: the compressor writes it
                pos = req.kv_allocated_len // 4 - 1
                slot = allocator.full_to_hisparse_device_index_mapping[loc // 4].reshape(1)
                for layer in range(C4_LAYERS):
                    write_rows(device_pool.kv_buffer[layer], slot, truth[req.req_pool_idx][layer, pos : pos + 1])
        c4_lens = torch.tensor([coord.host_token_len(r.kv_allocated_len) for r in reqs], dtype=torch.int32)
        for layer in range(C4_LAYERS):
            top_k = [indexers[(r.req_pool_idx, layer)].step(int(n)) for r, n in zip(reqs, c4_lens)]
            for r, n, k in zip(reqs, c4_lens, top_k):
                traces[(r.req_pool_idx, layer)].append((int(n), k))
            top_k = torch.tensor(top_k, dtype=torch.int32)
            t0 = time.perf_counter()
            locs = coord.swap_in_selected_pages(rids, c4_lens, top_k, layer)
            swap_us.append((time.perf_counter() - t0) * 1e6)
            for b, req in enumerate(reqs):
                got = token_rows(device_pool.kv_buffer[layer], locs[b].long())
                check(bool((locs[b] >= 0).all()), "every top-k entry got a device slot")
                check(torch.equal(got, truth[req.req_pool_idx][layer, top_k[b].long()]),
                      "every returned slot holds its token's bytes")
                checked += TOP_K
    counters = coord.read_counters()
    print(f"\n[4] Decoded {DECODE_STEPS} steps x {C4_LAYERS} layers x {len(reqs)} requests: {checked:,} top-k entries, "
          f"every one byte-exact. Swap-in (cpu backend, batch {len(reqs)}): median {statistics.median(swap_us):.0f} us "
          f"per layer call; device counters: {counters['hits']:,} hits, {counters['misses']:,} misses, "
          f"{counters['bytes'] / 2**20:.1f} MiB host->device")

    trace = Trace(TOP_K, [RequestTrace(f"r{rid}-l{layer}", steps) for (rid, layer), steps in traces.items()])
    lru, belady = replay(trace, HOT, "lru"), replay(trace, HOT, "belady")
    check(lru.loads == counters["misses"], "the kernel's misses equal the pure-Python LRU model's loads")
    print(f"\n[5] Same trace, policies compared: kernel LRU {counters['misses']:,} loads (= the Python model's "
          f"{lru.loads:,}), hit rate {lru.hit_rate:.4f}; Belady's offline optimum {belady.loads:,} loads, hit rate "
          f"{belady.hit_rate:.4f} (LRU moves {lru.loads / max(belady.loads, 1):.2f}x the optimum's bytes)")

    for req in reqs:
        coord.request_finished(req)
        allocator.free_logical(req_to_token[req.req_pool_idx, : req.kv_allocated_len])
    stats = coord.get_token_stats()
    check(stats["device_used"] == 0 and stats["host_used"] == 0, "every device slot and host page was freed")
    check(allocator.logical.used_pages == set(), "every logical page was freed")
    print("\n[6] All requests finished: 0 device slots, 0 host pages, 0 logical pages still held. Demo OK.")


if __name__ == "__main__":
    main()

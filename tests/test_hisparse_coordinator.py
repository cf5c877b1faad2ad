"""HiSparseCoordinator on the CPU: prefill staging, PD direct admission, decode steps with backups and
swap-ins, and release, with the allocator's ownership invariants checked along the way.

A small "model" plays the parts outside the coordinator: it writes each C4 entry's bytes (a
deterministic pattern per request, position and layer) where the coordinator routes them, and draws
top-k sets. Every slot a swap-in returns must hold the bytes of the entry asked for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from sparsekv.srt.managers.hisparse_coordinator import HiSparseCoordinator
from sparsekv.srt.mem_cache.allocators import AllocatorExhaustedError, HiSparseTokenToKVPoolAllocator
from sparsekv.srt.mem_cache.hisparse_device_pool import HiSparseC4DevicePool
from sparsekv.srt.streams import CpuStreams
from sparsekv.testing.reference.hisparse import token_bytes, write_token

TOP_K, HOT, LAYERS = 5, 7, 2
MAX_REQS, MAX_CONTEXT = 4, 2048


@dataclass
class Req:
    req_pool_idx: int
    kv_allocated_len: int
    uid: int


@dataclass
class ReqToTokenPool:
    req_to_token: torch.Tensor


def entry_bytes(uid: int, pos: int, layer: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(uid * 1_000_003 + pos * 31 + layer)
    return torch.randint(0, 256, (584,), dtype=torch.uint8, generator=gen)


class World:
    def __init__(self, *, deferred: bool = False, size: int = 2048):
        self.pool = ReqToTokenPool(torch.zeros(MAX_REQS, MAX_CONTEXT, dtype=torch.int64))
        self.allocator = HiSparseTokenToKVPoolAllocator(size, 256, host_to_device_ratio=2)
        self.device_pool = HiSparseC4DevicePool(self.allocator, LAYERS, "cpu")
        self.coord = HiSparseCoordinator(self.pool, self.allocator, self.device_pool, top_k=TOP_K,
                                         device_buffer_size=HOT, streams=CpuStreams(deferred=deferred),
                                         collect_counters=True)
        self.host = self.coord.mem_pool_host
        self.rng = random.Random(1234)

    # -- the model's side -------------------------------------------------------------
    def write_entries(self, req: Req, positions, slots) -> None:
        for layer in range(LAYERS):
            for pos, slot in zip(positions, slots):
                write_token(self.device_pool.kv_buffer[layer], int(slot), entry_bytes(req.uid, pos, layer),
                            is_dsv4_layout=True)

    def prefill(self, req: Req, prompt_len: int) -> None:
        self.allocator.alloc_extend(self.pool.req_to_token, req.req_pool_idx, 0, prompt_len)
        req.kv_allocated_len = prompt_len
        locs = self.allocator.compressed_locs(self.pool.req_to_token[req.req_pool_idx, :prompt_len])
        self.write_entries(req, range(locs.numel()), self.allocator.device_slots(locs).tensor)

    def direct_transfer(self, req: Req, prompt_len: int) -> None:
        # PD: logical locations only; the prefill side writes the C4 entries into our host pool.
        self.allocator.alloc_extend(self.pool.req_to_token, req.req_pool_idx, 0, prompt_len, with_device=False)
        req.kv_allocated_len = prompt_len
        n = self.coord.host_token_len(prompt_len)
        host = self.coord.alloc_direct_host_slots(req, n).tensor
        for layer in range(LAYERS):
            for pos in range(n):
                write_token(self.host.kv_buffer[layer], int(host[pos]), entry_bytes(req.uid, pos, layer),
                            is_dsv4_layout=True)

    def decode_step(self, reqs: list[Req]) -> list[tuple[Req, int, list[int], list[int]]]:
        """One decode step for ``reqs``: allocate, route, write the new C4 entry, swap in every layer."""
        out_locs = []
        for req in reqs:
            req.kv_allocated_len += 1
            out_locs.append(self.allocator.alloc_decode(self.pool.req_to_token, req.req_pool_idx,
                                                        req.kv_allocated_len))
        self.coord.map_last_loc_to_buffer([r.req_pool_idx for r in reqs], [r.kv_allocated_len for r in reqs],
                                          out_locs)
        for req, loc in zip(reqs, out_locs):
            if req.kv_allocated_len % 4 == 0:
                mapping = self.allocator.full_to_hisparse_device_index_mapping
                self.write_entries(req, [req.kv_allocated_len // 4 - 1], [int(mapping[loc // 4])])
        results = []
        c4_lens = [self.coord.host_token_len(r.kv_allocated_len) for r in reqs]
        for layer in range(LAYERS):
            top_k = [self.draw_top_k(n) for n in c4_lens]
            out = self.coord.swap_in_selected_pages(
                torch.tensor([r.req_pool_idx for r in reqs]), torch.tensor(c4_lens, dtype=torch.int32),
                torch.tensor(top_k, dtype=torch.int32), layer)
            for b, req in enumerate(reqs):
                results.append((req, layer, top_k[b], out[b].tolist()))
        return results

    def draw_top_k(self, n: int) -> list[int]:
        pool = list(range(n)) + [-1, n, n + 5]
        picks = self.rng.sample(range(n), min(n, TOP_K)) if self.rng.random() < 0.7 else \
            [self.rng.choice(pool) for _ in range(TOP_K)]
        return (picks + [-1] * TOP_K)[:TOP_K]

    def check_results(self, results) -> int:
        loaded = 0
        for req, layer, top_k, out in results:
            n = self.coord.host_token_len(req.kv_allocated_len)
            for i, (tok, loc) in enumerate(zip(top_k, out)):
                fast_used = i < min(n, TOP_K) if n <= HOT else True
                if not (0 <= tok < n and fast_used):
                    assert loc == -1, (req, layer, top_k, out)
                    continue
                got = token_bytes(self.device_pool.kv_buffer[layer], loc, is_dsv4_layout=True)
                assert torch.equal(got, entry_bytes(req.uid, tok, layer)), (req.uid, tok, layer, loc)
                loaded += 1
        return loaded

    # -- invariants -------------------------------------------------------------------
    def owned_device_pages(self, req: Req) -> set[int]:
        rid = req.req_pool_idx
        if self.coord._reqs[rid].staging:
            slots = self.allocator.device_slots(self.coord._compressed_locs(req)).tensor
        else:
            slots = self.coord.req_to_device_buffer[rid]
        return set(self.allocator.device_alloc.pages_of(slots).tolist())

    def check_ownership(self, live: list[Req]) -> None:
        device = [self.owned_device_pages(r) for r in live]
        host = [set((self.coord.req_to_host_pool[r.req_pool_idx][self.coord.req_to_host_pool[r.req_pool_idx] >= 0]
                     // 64).tolist()) for r in live]
        logical = [set((self.pool.req_to_token[r.req_pool_idx, : r.kv_allocated_len] // 256).tolist()) for r in live]
        for sets, used in ((device, self.allocator.device_alloc.used_pages),
                           (logical, self.allocator.logical.used_pages)):
            assert sum(len(s) for s in sets) == len(set().union(*sets)), "a page has two owners"
            assert set().union(*sets) == used, "a page is allocated but owned by no live request (leak)"
        assert sum(len(s) for s in host) == len(set().union(*host))
        assert sum(len(s) for s in host) == self.host.num_pages - self.host.available_pages

    def finish(self, req: Req) -> None:
        self.coord.request_finished(req)
        self.allocator.free_logical(self.pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len])

    def check_all_free(self) -> None:
        assert self.allocator.device_alloc.used_pages == set()
        assert self.allocator.logical.used_pages == set()
        assert self.host.available_pages == self.host.num_pages
        assert bool((self.allocator.full_to_hisparse_device_index_mapping == -1).all())


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred-streams"])
def test_staging_then_decode_swaps_in_the_right_bytes_and_frees_everything(deferred):
    w = World(deferred=deferred)
    long_req, short_req = Req(0, 0, uid=11), Req(2, 0, uid=12)
    w.prefill(long_req, 1100)  # 275 C4 entries in 5 device pages: far more than the hot buffer
    w.prefill(short_req, 20)   # 5 entries: the fast path until it grows past H
    for req in (long_req, short_req):
        w.coord.admit_request_into_staging(req)
    w.check_ownership([long_req, short_req])
    if deferred:
        assert w.coord.collect_ready_reqs() == []  # the backup has not run yet
        w.coord.write_staging_stream.synchronize()
    used_while_staging = len(w.allocator.device_alloc.used_pages)
    assert w.coord.collect_ready_reqs() == [long_req, short_req]
    # The long prefill shrank to its hot buffer: positions 0..6 and 8..70 (pages 1-2 of the prefill)
    # plus the newest entry's slot (page 5) in column H; pages 3-4 were freed. The short one grew by a page.
    assert len(w.owned_device_pages(long_req)) == 3
    assert len(w.allocator.device_alloc.used_pages) == used_while_staging - 2 + 1
    loaded = 0
    for _ in range(45):
        loaded += w.check_results(w.decode_step([long_req, short_req]))
        w.check_ownership([long_req, short_req])
    assert loaded > 100
    counters = w.coord.read_counters()
    assert counters["misses"] > 0 and counters["hits"] > 0
    assert counters["bytes"] == 584 * counters["misses"]
    w.finish(long_req)
    w.check_ownership([short_req])
    w.finish(short_req)
    w.check_all_free()


@pytest.mark.parametrize("prompt_len", [24, 200], ids=["short-preloaded", "long-all-miss"])
def test_admit_request_direct_then_decode(prompt_len):
    w = World()
    req = Req(1, 0, uid=21)
    w.direct_transfer(req, prompt_len)
    w.coord.admit_request_direct(req)
    n = prompt_len // 4
    hot_tokens = w.coord.req_device_buffer_tokens[:, 1, :HOT]
    if n <= HOT:
        assert hot_tokens.tolist() == [list(range(HOT))] * LAYERS
    else:
        assert bool((hot_tokens == -1).all())
    w.check_ownership([req])
    loaded = 0
    for _ in range(30):
        loaded += w.check_results(w.decode_step([req]))
        w.check_ownership([req])
    assert loaded > 0
    w.finish(req)
    w.check_all_free()


def test_finishing_while_staging_frees_the_prefill():
    w = World(deferred=True)
    req, other = Req(0, 0, uid=31), Req(3, 0, uid=32)
    w.prefill(req, 600)
    w.prefill(other, 40)
    w.coord.admit_request_into_staging(req)
    w.coord.admit_request_into_staging(other)
    w.finish(req)  # waits for its backup, then frees its whole prefill and its host pages
    w.check_ownership([other])
    w.coord.write_staging_stream.synchronize()
    assert w.coord.collect_ready_reqs() == [other]
    w.finish(other)
    w.check_all_free()


def test_allocator_refuses_what_it_cannot_hold_and_a_double_free():
    w = World(size=512)  # 2 device pages, 4 logical pages of 256 tokens
    req = Req(0, 0, uid=41)
    with pytest.raises(AllocatorExhaustedError):
        w.allocator.alloc_extend(w.pool.req_to_token, 0, 0, 4 * 256 + 1)
    assert w.allocator.logical.used_pages == set() and w.allocator.device_alloc.used_pages == set()
    w.prefill(req, 256)
    pages = w.allocator.device_alloc.pages_of(w.allocator.device_slots(w.coord._compressed_locs(req)).tensor)
    w.allocator.device_alloc.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        w.allocator.device_alloc.free(pages)


def test_host_token_len_and_alloc_device_buffer_layout():
    w = World()
    assert w.coord.host_token_len(1001) == 250
    req = Req(0, 0, uid=51)
    w.prefill(req, 300)
    locs = w.coord._compressed_locs(req)
    before = w.allocator.device_slots(locs).tensor
    buffer = w.allocator.alloc_device_buffer(locs, HOT + 64).tensor
    # Positions below H keep their slots; column H is the newest entry's slot.
    assert buffer[:HOT].tolist() == before[:HOT].tolist()
    assert int(buffer[HOT]) == int(before[-1])
    assert buffer.unique().numel() == HOT + 64
    after = w.allocator.device_slots(locs).tensor
    assert after[:HOT].tolist() == before[:HOT].tolist() and int(after[-1]) == int(before[-1])
    assert bool((after[HOT:-1] == -1).all())

"""HiSparseCoordinator on the CPU: prefill staging, PD direct admission, decode steps with backups and
swap-ins, and release, with the allocator's ownership invariants checked along the way.

A small "model" plays the parts outside the coordinator: it writes each C4 entry's bytes (a
deterministic pattern per request, position and layer) where the coordinator routes them, and draws
top-k sets. Every slot a swap-in returns must hold the bytes of the entry asked for.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from sparsekv.kv_layout import DSV4_PAGE_SIZES, c4_page_slots
from sparsekv.srt.errors import RequestStateError
from sparsekv.srt.managers.hisparse_coordinator import HiSparseCoordinator
from sparsekv.srt.mem_cache.allocators import AllocatorExhaustedError, HiSparseTokenToKVPoolAllocator
from sparsekv.srt.mem_cache.dsv4_paged_host_pool import DeepSeekV4PagedHostPool
from sparsekv.srt.mem_cache.hisparse_device_pool import HiSparseC4DevicePool
from sparsekv.srt.mem_cache.hisparse_host_pool import HostPoolExhaustedError
from sparsekv.srt.mem_cache.ids import DeviceSlots, HostPages, HostSlots
from sparsekv.srt.streams import CpuStream, CpuStreams, CudaStream
from sparsekv.testing.hisparse_runtime import Req, ReqToTokenPool, changed, entry_bytes, snapshot
from sparsekv.testing.hisparse_runtime import resident_index_disagreements as index_disagreements
from sparsekv.testing.reference.hisparse import token_bytes, write_token

TOP_K, HOT, LAYERS = 5, 7, 2
MAX_REQS, MAX_CONTEXT = 4, 2048


class RecordingStream(CpuStream):
    """A host stream that keeps every tensor a submit declares in use (what a CUDA stream record_streams)."""

    def __init__(self) -> None:
        super().__init__()
        self.declared: list[torch.Tensor] = []

    def submit(self, fn, *, uses=()) -> None:
        self.declared.extend(uses)
        super().submit(fn, uses=uses)


class RecordingStreams(CpuStreams):
    def new(self) -> RecordingStream:
        return RecordingStream()


class World:
    def __init__(self, *, deferred: bool = False, size: int = 2048, host_pages: int | None = None,
                 streams: CpuStreams | None = None, page_size: int = 256, swap_in_policy: str = "lru",
                 resident_index: bool = False):
        self.pool = ReqToTokenPool(torch.zeros(MAX_REQS, MAX_CONTEXT, dtype=torch.int64))
        self.page_size = page_size
        self.slots = c4_page_slots(page_size)  # C4 slots per page, on the device and the host
        self.allocator = HiSparseTokenToKVPoolAllocator(size, page_size, host_to_device_ratio=2)
        self.device_pool = HiSparseC4DevicePool(self.allocator, LAYERS, "cpu")
        host_pool = None if host_pages is None else \
            DeepSeekV4PagedHostPool("c4", self.device_pool.kv_buffer, host_pages, page_slots=self.slots)
        self.coord = HiSparseCoordinator(self.pool, self.allocator, self.device_pool, num_top_k=TOP_K,
                                         hot_buffer_size=HOT, host_pool=host_pool,
                                         streams=streams if streams is not None else CpuStreams(deferred=deferred),
                                         collect_counters=True, swap_in_policy=swap_in_policy,
                                         resident_index=resident_index)
        self.host = self.coord.mem_pool_host
        self.rng = random.Random(1234)

    # -- the model's side -------------------------------------------------------------
    def write_entries(self, req: Req, positions, slots) -> None:
        for layer in range(LAYERS):
            for pos, slot in zip(positions, slots):
                write_token(self.device_pool.kv_buffer[layer], int(slot), entry_bytes(req.uid, pos, layer),
                            page_slots=self.slots)

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
                            page_slots=self.slots)

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
                got = token_bytes(self.device_pool.kv_buffer[layer], loc, page_slots=self.slots)
                assert torch.equal(got, entry_bytes(req.uid, tok, layer)), (req.uid, tok, layer, loc)
                loaded += 1
        return loaded

    # -- invariants -------------------------------------------------------------------
    def owned_device_pages(self, req: Req) -> set[int]:
        rid = req.req_pool_idx
        if self.coord._reqs[rid].phase == "staging":
            slots = self.allocator.device_slots(self.coord._compressed_locs(req)).tensor
        else:
            slots = self.coord.req_to_device_buffer[rid]
        return set(self.allocator.device_alloc.pages_of(slots).tolist())

    def check_ownership(self, live: list[Req]) -> None:
        device = [self.owned_device_pages(r) for r in live]
        host = [set((self.coord.req_to_host_pool[r.req_pool_idx][self.coord.req_to_host_pool[r.req_pool_idx] >= 0]
                     // self.slots).tolist()) for r in live]
        logical = [set((self.pool.req_to_token[r.req_pool_idx, : r.kv_allocated_len] // self.page_size).tolist())
                   for r in live]
        for sets, used in ((device, self.allocator.device_alloc.used_pages),
                           (logical, self.allocator.logical.used_pages)):
            assert sum(len(s) for s in sets) == len(set().union(*sets)), "a page has two owners"
            assert set().union(*sets) == used, "a page is allocated but owned by no live request (leak)"
        assert sum(len(s) for s in host) == len(set().union(*host))
        assert sum(len(s) for s in host) == self.host.num_pages - self.host.available_pages

    def finish(self, req: Req) -> None:
        self.coord.request_finished(req)
        self.allocator.free_logical(self.pool.req_to_token[req.req_pool_idx, : req.kv_allocated_len],
                                    rid=req.req_pool_idx)

    def finish_all(self, *reqs: Req) -> None:
        """Finish ``reqs`` (and free their logical pages, as the scheduler does): then every page is
        free, and finishing one of them again is refused."""
        for req in reqs:
            self.finish(req)
        self.check_all_free()
        for req in reqs:
            with pytest.raises(RequestStateError, match=f"request row {req.req_pool_idx}"):
                self.coord.request_finished(req)

    def check_all_free(self) -> None:
        assert self.allocator.device_alloc.used_pages == set()
        assert self.allocator.logical.used_pages == set()
        assert self.host.available_pages == self.host.num_pages
        assert bool((self.allocator.full_to_hisparse_device_index_mapping == -1).all())


# Refusals snapshot the world (its byte pools too): one torch thread copies them fastest here.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# DSV4 full-token page sizes: C4 pages of 32, 64 and 128 slots, end to end (allocator, host pool,
# coordinator, swap-in).
PAGE_SIZES = pytest.mark.parametrize("page_size", DSV4_PAGE_SIZES, ids=[f"page{p}" for p in DSV4_PAGE_SIZES])


@contextmanager
def refused(w: World, error: type[Exception], match: str):
    """The body must raise ``error`` (its message matching ``match``) and change nothing of the world:
    allocators, mapping, tables, queues, device and host bytes (``sparsekv.testing.hisparse_runtime.snapshot``)."""
    before = snapshot(w.coord, w.pool.req_to_token)
    with pytest.raises(error, match=match):
        yield
    assert changed(before, snapshot(w.coord, w.pool.req_to_token)) == []


@PAGE_SIZES
@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred-streams"])
def test_staging_then_decode_swaps_in_the_right_bytes_and_frees_everything(deferred, page_size):
    w = World(deferred=deferred, page_size=page_size, size=max(2048, 8 * page_size))  # at least 8 device pages
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
    # The long prefill (275 entries) shrank to its hot buffer of H + P slots: the prefill pages holding
    # positions 0..H+P-2 plus the page of the newest entry (column H); the pages between were freed.
    # The short one (5 entries) grew by a page when its buffer of H + P slots no longer fit one page.
    slots, entries = w.slots, 1100 // 4
    kept = -(-(HOT + slots - 1) // slots) + 1
    prefill_pages = -(-entries // slots)
    short_growth = 1 if HOT + slots > slots else 0
    assert len(w.owned_device_pages(long_req)) == kept
    assert len(w.allocator.device_alloc.used_pages) == used_while_staging - (prefill_pages - kept) + short_growth
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
    w.finish_all(short_req)


@pytest.mark.parametrize("resident_index", [False, True], ids=["scanning", "indexed"])
def test_a_near_lru_coordinator_swaps_in_the_right_bytes_with_its_policy(monkeypatch, resident_index):
    from sparsekv.srt.managers import hisparse_coordinator

    calls = []
    swap_in = hisparse_coordinator.load_cache_to_device_buffer_dsv4_mla

    def spy(*args, **kwargs):
        calls.append((kwargs["policy"], kwargs["resident_index"] is not None))
        swap_in(*args, **kwargs)

    monkeypatch.setattr(hisparse_coordinator, "load_cache_to_device_buffer_dsv4_mla", spy)
    w = World(swap_in_policy="near_lru", resident_index=resident_index)
    req = Req(0, 0, uid=31)
    w.prefill(req, 1100)  # 275 C4 entries, far more than the hot buffer
    w.coord.admit_request_into_staging(req)
    assert w.coord.collect_ready_reqs() == [req]
    loaded = sum(w.check_results(w.decode_step([req])) for _ in range(20))
    assert loaded > 0 and w.coord.read_counters()["misses"] > 0
    assert calls and set(calls) == {("near_lru", resident_index)}
    assert index_disagreements(w.coord) == []
    w.finish_all(req)


@PAGE_SIZES
@pytest.mark.parametrize("prompt_len", [24, 200], ids=["short-preloaded", "long-all-miss"])
def test_admit_request_direct_then_decode(prompt_len, page_size):
    w = World(page_size=page_size)
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
    w.finish_all(req)


@PAGE_SIZES
def test_finishing_while_staging_frees_the_prefill(page_size):
    w = World(deferred=True, page_size=page_size)
    req, other = Req(0, 0, uid=31), Req(3, 0, uid=32)
    w.prefill(req, 600)
    w.prefill(other, 40)
    w.coord.admit_request_into_staging(req)
    w.coord.admit_request_into_staging(other)
    w.finish(req)  # waits for its backup, then frees its whole prefill and its host pages
    w.check_ownership([other])
    w.coord.write_staging_stream.synchronize()
    assert w.coord.collect_ready_reqs() == [other]
    w.finish_all(other)


def test_allocator_refuses_what_it_cannot_hold_and_a_double_free():
    w = World(size=512)  # 2 device pages, 4 logical pages of 256 tokens
    req = Req(0, 0, uid=41)
    with pytest.raises(AllocatorExhaustedError):
        w.allocator.alloc_extend(w.pool.req_to_token, 0, 0, 4 * 256 + 1)
    assert w.allocator.logical.used_pages == set() and w.allocator.device_alloc.used_pages == set()
    w.prefill(req, 256)
    pages = w.allocator.device_alloc.pages_of(w.allocator.device_slots(w.coord._compressed_locs(req)).tensor)
    with refused(w, RequestStateError, "belongs to request row 0"):  # only row 0's own release frees them
        w.allocator.device_alloc.free(pages)
    w.allocator.device_alloc.free(pages, owner=0)
    with pytest.raises(ValueError, match="not allocated"):
        w.allocator.device_alloc.free(pages, owner=0)


def test_host_token_len_and_alloc_device_buffer_layout():
    w = World()
    assert w.coord.host_token_len(1001) == 250
    req = Req(0, 0, uid=51)
    w.prefill(req, 300)
    locs = w.coord._compressed_locs(req)
    before = w.allocator.device_slots(locs).tensor
    buffer = w.allocator.alloc_device_buffer(locs, HOT + 64, rid=0).tensor
    # Positions below H keep their slots; column H is the newest entry's slot.
    assert buffer[:HOT].tolist() == before[:HOT].tolist()
    assert int(buffer[HOT]) == int(before[-1])
    assert buffer.unique().numel() == HOT + 64
    after = w.allocator.device_slots(locs).tensor
    assert after[:HOT].tolist() == before[:HOT].tolist() and int(after[-1]) == int(before[-1])
    assert bool((after[HOT:-1] == -1).all())


def test_a_hot_buffer_that_does_not_fit_stops_collection_and_keeps_the_rest_queued():
    w = World(size=768)  # 3 device pages
    first, second = Req(0, 0, uid=61), Req(1, 0, uid=62)
    for req in (first, second):
        w.prefill(req, 16)  # 4 C4 entries: a device page each
        w.coord.admit_request_into_staging(req)
    # The first hot buffer (7 + 64 slots) grows into the last free page; the second cannot grow yet.
    assert w.coord.collect_ready_reqs() == [first]
    assert [queued for _, queued in w.coord.ack_staging_queue] == [second]
    assert w.coord._reqs[second.req_pool_idx].phase == "staging"
    w.check_ownership([first, second])
    w.check_results(w.decode_step([first]))
    w.finish(first)
    assert w.coord.collect_ready_reqs() == [second]
    w.check_results(w.decode_step([second]))
    w.finish_all(second)


def test_a_step_whose_backups_do_not_fit_in_the_host_pool_changes_nothing():
    w = World(host_pages=3)
    a, b = Req(0, 0, uid=71), Req(1, 0, uid=72)
    for req in (a, b):
        w.direct_transfer(req, 256)  # 64 C4 entries: one host page each, one page left
        w.coord.admit_request_direct(req)
    for _ in range(4):
        w.check_results(w.decode_step([a, b]))
    # Token 261 backs up entry 64 of both requests: a new host page each, one free.
    out_locs = []
    for req in (a, b):
        req.kv_allocated_len += 1
        out_locs.append(w.allocator.alloc_decode(w.pool.req_to_token, req.req_pool_idx, req.kv_allocated_len))
    with refused(w, HostPoolExhaustedError, "host pages"):
        w.coord.map_last_loc_to_buffer([0, 1], [261, 261], out_locs)
    w.finish(b)
    w.coord.map_last_loc_to_buffer([0], [261], out_locs[:1])  # now it fits; entry 64 reaches the host
    w.coord.decode_backup_stream.synchronize()
    host_slot = int(w.coord.req_to_host_pool[0, 64])
    for layer in range(LAYERS):
        assert torch.equal(token_bytes(w.host.kv_buffer[layer], host_slot, page_slots=w.slots),
                           entry_bytes(a.uid, 64, layer))
    w.finish_all(a)


@pytest.mark.parametrize("other", ["unknown", "staging"])
def test_a_row_not_admitted_for_decode_is_refused_before_any_row_changes(other):
    w = World()
    req = Req(0, 0, uid=81)
    w.direct_transfer(req, 24)
    w.coord.admit_request_direct(req)
    if other == "staging":
        staged = Req(3, 0, uid=82)
        w.prefill(staged, 40)
        w.coord.admit_request_into_staging(staged)
    req.kv_allocated_len += 1  # 25: the first step, whose backup of entry 5 is skipped
    loc = w.allocator.alloc_decode(w.pool.req_to_token, 0, req.kv_allocated_len)
    with refused(w, ValueError, "request row 3 is not admitted"):
        w.coord.map_last_loc_to_buffer([0, 3], [25, 41], [loc, 0])


@pytest.mark.parametrize("rows, seq_lens, locs, message", [
    ([0], [25, 26], [0], "equal lengths"),
    ([0, 0], [25, 25], [0, 0], "names a request row twice"),
])
def test_malformed_decode_routing_is_refused_before_any_row_changes(rows, seq_lens, locs, message):
    w = World()
    req = Req(0, 0, uid=83)
    w.direct_transfer(req, 24)
    w.coord.admit_request_direct(req)
    with refused(w, ValueError, message):
        w.coord.map_last_loc_to_buffer(rows, seq_lens, locs)


def test_side_stream_copies_declare_the_id_tensors_they_read(monkeypatch):
    # On a GPU the ids are built on the compute stream and read by a copy on a side stream; the
    # stream must be told (record_stream) or the caching allocator can reuse their memory while the
    # copy still reads it. CPU streams cannot show the race, so the test checks the declaration.
    w = World(streams=RecordingStreams())
    read = []
    backup = w.host.backup_from_device_all_layer

    def spy(host_indices, device_indices):
        read.append((host_indices.tensor, device_indices.tensor))
        backup(host_indices, device_indices)

    monkeypatch.setattr(w.host, "backup_from_device_all_layer", spy)
    req = Req(0, 0, uid=91)
    w.prefill(req, 40)
    w.coord.admit_request_into_staging(req)
    assert w.coord.collect_ready_reqs() == [req]
    for _ in range(9):  # tokens 41..49: the first step's backup is skipped, then entries 10 and 11
        w.decode_step([req])
    staging, decode = w.coord.write_staging_stream.declared, w.coord.decode_backup_stream.declared
    assert len(read) == 3
    for i, tensors in enumerate(read):
        declared = staging if i == 0 else decode
        assert all(any(t is d for d in declared) for t in tensors)
    w.finish_all(req)


def test_cuda_stream_submit_records_the_cuda_tensors_it_uses_even_when_fn_fails():
    class CudaLooking:  # what submit touches of a CUDA tensor
        is_cuda = True

        def __init__(self) -> None:
            self.streams = []

        def record_stream(self, stream) -> None:
            self.streams.append(stream)

    side = torch.cuda.Stream() if torch.cuda.is_available() else object()  # no stream switch without CUDA
    stream, ids, host_ids = CudaStream(side), CudaLooking(), torch.arange(3)
    ran = []
    stream.submit(lambda: ran.append(1), uses=(ids, host_ids))
    assert ran == [1] and ids.streams == [side]

    def fails():
        raise RuntimeError("launch failed after queuing part of the work")

    with pytest.raises(RuntimeError, match="launch failed"):
        stream.submit(fails, uses=(ids,))
    assert ids.streams == [side, side]


def test_a_prefill_not_on_the_device_is_refused_before_host_pages_are_taken():
    w = World()
    req = Req(0, 0, uid=101)
    w.allocator.alloc_extend(w.pool.req_to_token, 0, 0, 16, with_device=False)  # logical locations only
    req.kv_allocated_len = 16
    with pytest.raises(ValueError, match="not on the device"):
        w.coord.admit_request_into_staging(req)
    assert w.host.available_pages == w.host.num_pages and bool((w.coord.req_to_host_pool[0] == -1).all())
    assert 0 not in w.coord._reqs and w.coord.ack_staging_queue == []
    w.coord.alloc_direct_host_slots(req, 4)  # now a direct transfer: staging is the wrong door
    free, row = w.host.available_pages, w.coord.req_to_host_pool[0].clone()
    with pytest.raises(RequestStateError, match="direct transfer"):
        w.coord.admit_request_into_staging(req)
    assert w.host.available_pages == free and torch.equal(w.coord.req_to_host_pool[0], row)
    assert w.coord.ack_staging_queue == []


def test_a_failed_staging_backup_frees_its_host_pages_and_admits_nothing(monkeypatch):
    w = World()
    req = Req(0, 0, uid=111)
    w.prefill(req, 300)

    def fails(host_indices, device_indices):
        raise RuntimeError("backup failed")

    monkeypatch.setattr(w.host, "backup_from_device_all_layer", fails)
    with pytest.raises(RuntimeError, match="backup failed"):
        w.coord.admit_request_into_staging(req)
    assert w.host.available_pages == w.host.num_pages
    assert bool((w.coord.req_to_host_pool[0] == -1).all()) and int(w.coord.req_to_host_pool_allocated_len[0]) == 0
    assert 0 not in w.coord._reqs and w.coord.ack_staging_queue == []
    monkeypatch.undo()
    w.coord.admit_request_into_staging(req)  # the prefill is still the caller's and can be admitted again
    assert w.coord.collect_ready_reqs() == [req]
    w.finish_all(req)


def test_request_finished_can_be_retried_after_a_free_fails(monkeypatch):
    w = World()
    req = Req(0, 0, uid=121)
    w.prefill(req, 300)
    w.coord.admit_request_into_staging(req)
    assert w.coord.collect_ready_reqs() == [req]
    free = w.host.free
    calls = []

    def fails_once(slots, *, owner):
        calls.append(slots)
        if len(calls) == 1:
            raise RuntimeError("free failed")
        free(slots, owner=owner)

    monkeypatch.setattr(w.host, "free", fails_once)
    with pytest.raises(RuntimeError, match="free failed"):
        w.coord.request_finished(req)
    assert 0 in w.coord._reqs  # still admitted: the retry below releases what is left
    assert w.allocator.held_phase(0) == "decode"  # and its row still held against other frees
    w.finish_all(req)
    with pytest.raises(ValueError, match="request row 0 is not admitted"):
        w.coord.request_finished(req)


@given(hot=st.integers(1, 200), count=st.integers(0, 330))
@example(hot=7, count=66)  # the newest entry's page (not the swapped-in one) has the spare slots
@example(hot=100, count=130)
def test_alloc_device_buffer_hands_out_distinct_slots_of_pages_it_owns(hot, count):
    allocator = HiSparseTokenToKVPoolAllocator(4096, 256)
    req_to_token = torch.zeros(1, 2048, dtype=torch.int64)
    locs = allocator.compressed_locs(allocator.alloc_extend(req_to_token, 0, 0, 4 * count))
    before = allocator.device_slots(locs).tensor
    need = hot + 64
    buffer = allocator.alloc_device_buffer(locs, need, rid=0).tensor
    assert buffer.numel() == need and buffer.unique().numel() == need
    assert set(allocator.device_alloc.pages_of(buffer).tolist()) == allocator.device_alloc.used_pages
    kept = min(count, hot)
    assert buffer[:kept].tolist() == before[:kept].tolist()
    if count > hot:
        assert int(buffer[hot]) == int(before[-1])


# ---- misuse: each a case a careless caller found; refused before anything changes ------------


def test_admit_request_direct_twice_or_while_staging_is_a_request_state_error():
    w = World()
    req, staged = Req(0, 0, uid=131), Req(1, 0, uid=132)
    w.direct_transfer(req, 24)
    w.coord.admit_request_direct(req)
    w.prefill(staged, 40)
    w.coord.admit_request_into_staging(staged)
    for again in (req, staged):
        with refused(w, RequestStateError, f"request row {again.req_pool_idx}"):
            w.coord.admit_request_direct(again)
    assert w.coord.collect_ready_reqs() == [staged]
    w.finish_all(req, staged)


def test_admit_request_into_staging_twice_is_refused_and_the_queue_keeps_flowing():
    w = World()
    req, behind = Req(0, 0, uid=141), Req(1, 0, uid=142)
    w.prefill(req, 40)
    w.prefill(behind, 40)
    w.coord.admit_request_into_staging(req)
    with refused(w, RequestStateError, "request row 0"):
        w.coord.admit_request_into_staging(req)
    w.coord.admit_request_into_staging(behind)
    assert w.coord.collect_ready_reqs() == [req, behind]
    with pytest.raises(RequestStateError, match="request row 0"):  # decoding now: still not twice
        w.coord.admit_request_into_staging(req)
    w.finish_all(req, behind)


def test_admit_request_direct_beyond_the_host_entries_is_refused_before_the_hot_buffer():
    w = World()
    req = Req(0, 0, uid=151)
    w.direct_transfer(req, 200)  # 50 host entries
    req.kv_allocated_len = 600   # claims 150
    with refused(w, ValueError, "kv_allocated_len"):
        w.coord.admit_request_direct(req)
    req.kv_allocated_len = 200
    w.coord.admit_request_direct(req)
    w.check_results(w.decode_step([req]))
    w.finish_all(req)


def test_map_last_loc_to_buffer_refuses_a_negative_location_and_a_bad_second_row():
    w = World()
    a, b = Req(0, 0, uid=161), Req(1, 0, uid=162)
    for req in (a, b):
        w.direct_transfer(req, 24)
        w.coord.admit_request_direct(req)
        w.check_results(w.decode_step([req]))  # the skipped first backup is behind us
    with refused(w, IndexError, "out_cache_loc"):
        w.coord.map_last_loc_to_buffer([0], [28], [-4])  # would turn the mapping's -1 sentinel into a slot
    for _ in range(2):
        w.check_results(w.decode_step([a, b]))  # to 27 tokens: the next step backs up entry 6
    a.kv_allocated_len, b.kv_allocated_len = 28, 28
    loc_a = w.allocator.alloc_decode(w.pool.req_to_token, 0, 28)
    loc_b = w.allocator.alloc_decode(w.pool.req_to_token, 1, 28)
    for bad in (-4, w.allocator.size_full + 10 * 256 + 3, loc_b - 1, 1.5, True, loc_a):  # loc_a: row 0's
        with refused(w, (IndexError, ValueError, TypeError), "out_cache_loc"):
            w.coord.map_last_loc_to_buffer([0, 1], [28, 28], [loc_a, bad])
    w.coord.map_last_loc_to_buffer([0, 1], [28, 28], [loc_a, loc_b])
    w.finish_all(a, b)


def test_alloc_extend_refuses_a_bad_row_or_a_prefix_the_row_does_not_hold():
    w = World()
    with refused(w, IndexError, "rid"):
        w.allocator.alloc_extend(w.pool.req_to_token, 99, 0, 300)
    with refused(w, ValueError, "prefix_len"):  # row 0 holds nothing to continue
        w.allocator.alloc_extend(w.pool.req_to_token, 0, 10, 300)
    for args, error, name in [((0, 300, 10), ValueError, "seq_len"), ((0, 0, MAX_CONTEXT + 1), ValueError, "seq_len"),
                              ((0, -4, 10), ValueError, "prefix_len"), ((0, 0, 10.0), TypeError, "seq_len")]:
        with refused(w, error, name):
            w.allocator.alloc_extend(w.pool.req_to_token, *args)
    with pytest.raises(TypeError, match="req_to_token"):
        w.allocator.alloc_extend(w.pool.req_to_token.float(), 0, 0, 10)
    # A prefix allocated without device slots cannot continue with them (its last device page is unknown).
    w.allocator.alloc_extend(w.pool.req_to_token, 0, 0, 10, with_device=False)
    with refused(w, ValueError, "prefix_len"):
        w.allocator.alloc_extend(w.pool.req_to_token, 0, 10, 300)


def test_collect_refuses_before_installing_any_hot_buffer_when_a_queued_prefill_lost_its_slots():
    w = World()
    first, second = Req(0, 0, uid=201), Req(1, 0, uid=202)
    for req in (first, second):
        w.prefill(req, 40)
        w.coord.admit_request_into_staging(req)
    # The scheduler frees the second prefill's device pages behind the coordinator's back (its
    # free_device_buffer is refused while the row is staging; the page allocator's is not).
    slots = w.allocator.device_slots(w.coord._compressed_locs(second))
    with refused(w, RequestStateError, "request row 1 is staging"):
        w.allocator.free_device_buffer(slots, rid=1)
    w.allocator.device_alloc.free(w.allocator.device_alloc.pages_of(slots.tensor), owner=1)
    with refused(w, ValueError, "request row 1"):  # the first is not left installed but unreported
        w.coord.collect_ready_reqs()


@pytest.mark.parametrize("change, error, match", [
    ({"num_top_k": True}, TypeError, "num_top_k"), ({"hot_buffer_size": 7.0}, TypeError, "hot_buffer_size"),
    ({"num_top_k": 0}, ValueError, "num_top_k"), ({"hot_buffer_size": TOP_K - 1}, ValueError, "hot_buffer_size"),
    ({"collect_counters": 1}, TypeError, "collect_counters"),
    ({"req_to_token_pool": ReqToTokenPool(torch.zeros(MAX_REQS, MAX_CONTEXT))}, TypeError, "req_to_token"),
    ({"allocator": object()}, TypeError, "allocator"),
    ({"swap_in_policy": "mru"}, ValueError, "`swap_in_policy` must be one of"),
])
def test_coordinator_arguments_are_checked(change, error, match):
    w = World()
    args = {"req_to_token_pool": w.pool, "allocator": w.allocator, "device_pool": w.device_pool,
            "num_top_k": TOP_K, "hot_buffer_size": HOT, **change}
    with pytest.raises(error, match=match):
        HiSparseCoordinator(**args)


def test_a_stale_row_cannot_continue_a_page_another_row_holds():
    # A row reused after its request finished still names old locations; if their page now belongs to
    # another row, continuing it would hand out that row's next locations a second time.
    w = World()
    w.allocator.alloc_extend(w.pool.req_to_token, 1, 0, 20)
    w.pool.req_to_token[0, :20] = w.pool.req_to_token[1, :20]
    for call in (lambda: w.allocator.alloc_extend(w.pool.req_to_token, 0, 20, 40),
                 lambda: w.allocator.alloc_decode(w.pool.req_to_token, 0, 21)):
        with refused(w, ValueError, "row 1"):
            call()


@pytest.mark.parametrize("call", [
    "alloc_extend", "alloc_decode", "admit_staging", "admit_direct", "alloc_direct_host_slots", "finish",
    "map_last_loc", "swap_in_layer", "host_alloc_row", "load_layer",
])
def test_negative_indices_are_refused_not_wrapped(call):
    w = World()
    last = Req(MAX_REQS - 1, 0, uid=171)  # what row -1 would wrap to
    w.prefill(last, 40)
    w.coord.admit_request_into_staging(last)
    assert w.coord.collect_ready_reqs() == [last]
    neg = Req(-1, 40, uid=172)
    host_slots = HostSlots(torch.arange(4))
    calls = {
        "alloc_extend": lambda: w.allocator.alloc_extend(w.pool.req_to_token, -1, 40, 300),
        "alloc_decode": lambda: w.allocator.alloc_decode(w.pool.req_to_token, -1, 41),
        "admit_staging": lambda: w.coord.admit_request_into_staging(neg),
        "admit_direct": lambda: w.coord.admit_request_direct(neg),
        "alloc_direct_host_slots": lambda: w.coord.alloc_direct_host_slots(neg, 4),
        "finish": lambda: w.coord.request_finished(neg),
        "map_last_loc": lambda: w.coord.map_last_loc_to_buffer([-1], [41], [0]),
        "swap_in_layer": lambda: w.coord.swap_in_selected_pages(
            torch.tensor([MAX_REQS - 1]), torch.tensor([10], dtype=torch.int32),
            torch.zeros(1, TOP_K, dtype=torch.int32), -1),
        "host_alloc_row": lambda: w.host.alloc_paged_token_slots(
            w.coord.req_to_host_pool, w.coord.req_to_host_pool_allocated_len, -1, 0, 4),
        "load_layer": lambda: w.host.load_to_device_per_layer(host_slots, DeviceSlots(torch.arange(4)), -1),
    }
    with refused(w, IndexError, "req_pool_idx|rid|layer_id|req_pool_indices"):
        calls[call]()
    w.finish_all(last)


def test_bools_floats_and_negative_counts_are_refused():
    w = World()
    alloc = w.allocator.device_alloc
    pages = alloc.alloc(2)
    with refused(w, TypeError, "pages"):
        alloc.free(torch.tensor([float(pages[0]) + 0.7]))  # would truncate to a live page
    with refused(w, TypeError, "pages"):
        alloc.free(torch.tensor([True]))
    with refused(w, TypeError, "num_pages"):
        alloc.alloc(True)
    with refused(w, TypeError, "num_pages"):
        alloc.alloc(1.0)
    with refused(w, TypeError, "num_pages"):
        w.host.alloc_page(True)
    with refused(w, ValueError, "num_tokens"):
        w.host.alloc_paged_token_slots(w.coord.req_to_host_pool, w.coord.req_to_host_pool_allocated_len, 0, 0, -5)
    with refused(w, ValueError, "num_entries"):
        w.coord.alloc_direct_host_slots(Req(0, 0, uid=181), -5)
    with refused(w, TypeError, "layer_id"):
        w.host.load_to_device_per_layer(HostSlots(torch.arange(4)), DeviceSlots(torch.arange(4)), True)
    with refused(w, TypeError, "kv_allocated_len"):
        w.coord.host_token_len(8.0)
    alloc.free(pages)
    w.check_all_free()


def test_request_finished_releases_host_slots_of_an_abandoned_direct_transfer():
    w = World()
    req = Req(2, 0, uid=191)
    w.direct_transfer(req, 300)  # host slots taken, then the transfer is abandoned before admission
    assert w.host.available_pages < w.host.num_pages
    w.finish_all(req)


def test_draft_rows_of_one_request_swap_in_together_with_their_own_bytes():
    # MTP: two rows of one request in one swap-in (the draft token sees one entry more); the rows
    # share tokens, select at most HOT distinct ones, and each gets the bytes of its own top-k.
    w = World()
    req = Req(0, 0, uid=31)
    w.prefill(req, 1100)
    w.coord.admit_request_into_staging(req)
    assert w.coord.collect_ready_reqs() == [req]
    n = w.coord.host_token_len(req.kv_allocated_len)
    rows = [[3, 40, 41, 200, -1], [41, 3, 42, 201, n - 1]]
    out = w.coord.swap_in_selected_pages(torch.tensor([req.req_pool_idx] * 2), torch.tensor([n - 1, n]),
                                         torch.tensor(rows, dtype=torch.int32), 1)
    counters = w.coord.read_counters()
    # 3 is resident since staging; 40, 41, 200 miss in the first row, then only 42 and 201 (41 and 3 hit).
    assert counters["misses"] == 5
    for b, row in enumerate(rows):
        for tok, loc in zip(row, out[b].tolist()):
            if 0 <= tok < n - 1 + b:
                got = token_bytes(w.device_pool.kv_buffer[1], loc, page_slots=w.slots)
                assert torch.equal(got, entry_bytes(req.uid, tok, 1)), (b, tok)
    w.finish_all(req)


# -- request ownership: the coordinator frees what it admitted, whatever the scheduler's fields say --


def _decoding_pair(w: World) -> tuple[Req, Req]:
    a, b = Req(0, 0, uid=31), Req(1, 0, uid=32)
    for req, length in ((a, 300), (b, 200)):
        w.prefill(req, length)
        w.coord.admit_request_into_staging(req)
    assert w.coord.collect_ready_reqs() == [a, b]
    for _ in range(5):
        w.decode_step([a, b])
    return a, b


@pytest.mark.parametrize("delta", [-1, -125])
def test_finishing_with_a_shorter_length_is_refused_and_frees_nothing(delta):
    # Once: 2 device pages and 125 mapping entries leaked.
    w = World()
    a, b = _decoding_pair(w)
    with refused(w, RequestStateError, "finishes with `req.kv_allocated_len`"):
        w.coord.request_finished(Req(a.req_pool_idx, a.kv_allocated_len + delta, a.uid))
    w.finish_all(a, b)


def test_finishing_with_a_longer_length_frees_only_its_own_pages():
    # Once: the pages and mapping entries past the request's own length (another request's) were freed.
    w = World()
    a, b = _decoding_pair(w)
    b_pages, b_buffer = w.owned_device_pages(b), w.coord.req_to_device_buffer[b.req_pool_idx].clone()
    w.coord.request_finished(Req(a.req_pool_idx, a.kv_allocated_len + 300, a.uid))
    w.allocator.free_logical(w.pool.req_to_token[a.req_pool_idx, : a.kv_allocated_len], rid=a.req_pool_idx)
    assert w.allocator.device_alloc.used_pages == b_pages
    mapping = w.allocator.full_to_hisparse_device_index_mapping
    assert bool(torch.isin(mapping[mapping >= 0], b_buffer).all())
    w.check_results(w.decode_step([b]))
    w.finish_all(b)


def test_admitting_fewer_tokens_than_were_allocated_is_refused():
    # Once: the C4 entries past the admitted length kept a device page nobody freed.
    w = World()
    for length, short in ((300, 296), (300, 256), (520, 300)):
        req = Req(0, 0, uid=41)
        w.prefill(req, length)
        with refused(w, RequestStateError, "was allocated more than"):
            w.coord.admit_request_into_staging(Req(0, short, req.uid))
        w.coord.admit_request_into_staging(req)
        w.coord.collect_ready_reqs()
        w.finish_all(req)


def test_finishing_a_staged_request_whose_pages_were_reused_frees_only_its_own():
    # The scheduler frees A's logical pages while A is staging and B reuses them. Finishing A once
    # freed B's device pages and wiped B's mapping (re-reading A's row), while A's own pages leaked.
    # free_logical now refuses a staging row; the page allocator's own free still lets it happen.
    w = World(deferred=True)
    a = Req(0, 0, uid=51)
    w.prefill(a, 300)
    w.coord.admit_request_into_staging(a)
    a_pages = w.owned_device_pages(a)
    with refused(w, RequestStateError, "request row 0 is staging"):
        w.allocator.free_logical(w.pool.req_to_token[0, :300], rid=0)
    w.allocator.logical.free(w.allocator.logical.pages_of(w.pool.req_to_token[0, :300]), owner=0)
    b = Req(0 + 1, 0, uid=52)
    w.pool.req_to_token[1] = 0
    w.prefill(b, 300)  # takes A's logical pages again: A's row and B's row name the same locations
    mapping = w.allocator.full_to_hisparse_device_index_mapping
    b_locs = w.allocator.compressed_locs(w.pool.req_to_token[1, :300])
    b_slots = mapping[b_locs].clone()
    b_pages = w.allocator.device_alloc.used_pages - a_pages
    w.coord.request_finished(a)
    assert w.allocator.device_alloc.used_pages == b_pages  # A's pages freed, B's kept
    assert torch.equal(mapping[b_locs], b_slots)  # B's entries intact; nothing names A's slots any more
    assert bool((mapping[mapping >= 0].unsqueeze(1) // w.slots != torch.tensor(sorted(a_pages))).all())
    w.coord.write_staging_stream.synchronize()
    w.coord.admit_request_into_staging(b)
    w.coord.write_staging_stream.synchronize()
    assert w.coord.collect_ready_reqs() == [b]
    w.check_results(w.decode_step([b]))
    w.finish_all(b)


@pytest.mark.parametrize("phase", ["unknown", "staging", "transfer"])
def test_swap_in_refuses_a_row_that_is_not_decoding(phase, monkeypatch):
    """With SPARSEKV_CHECK_INDICES=1 the phase is checked on host rows; without it nothing is read
    back (the call traces and captures), and the row, with no slot column set, loads nothing."""
    w = World(deferred=True)
    a = Req(0, 0, uid=61)
    if phase == "staging":
        w.prefill(a, 300)
        w.coord.admit_request_into_staging(a)
    elif phase == "transfer":
        w.direct_transfer(a, 300)
    before = snapshot(w.coord, w.pool.req_to_token)
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    out = w.coord.swap_in_selected_pages(torch.tensor([0]), torch.tensor([75], dtype=torch.int32),
                                         torch.zeros(1, TOP_K, dtype=torch.int32), 0)
    # No byte moves and nothing is allocated: at most the row's own slot tokens and LRU order change,
    # which its admission resets.
    assert bool((out == -1).all())
    assert set(changed(before, snapshot(w.coord, w.pool.req_to_token))) <= {"buffer_tokens", "lru_slots"}
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    with refused(w, RequestStateError, "request row 0 .* cannot be swapped in"):
        w.coord.swap_in_selected_pages(torch.tensor([0]), torch.tensor([75], dtype=torch.int32),
                                       torch.zeros(1, TOP_K, dtype=torch.int32), 0)
    # A padding row past num_real_reqs is not a request: never refused.
    out = w.coord.swap_in_selected_pages(torch.tensor([0]), torch.tensor([75], dtype=torch.int32),
                                         torch.zeros(1, TOP_K, dtype=torch.int32), 0,
                                         num_real_reqs=torch.zeros(1, dtype=torch.int32))
    assert bool((out == -1).all())


def _cross_request_calls(w: World, a: Req, b: Req) -> dict[str, tuple]:
    """The sweep's seven ways one request freed or overwrote another's memory (row ``a`` the victim,
    decoding; row ``b`` the other request): call -> the words the refusal must hold."""
    rtt, alloc = w.pool.req_to_token, w.allocator
    rid, other = a.req_pool_idx, b.req_pool_idx
    buffer = DeviceSlots(w.coord.req_to_device_buffer[rid].clone())
    table = w.coord.req_to_host_pool[rid]
    host_pages = torch.unique(table[table >= 0] // w.slots)
    stale = Req(2, 0, uid=99)
    rtt[2, :600] = rtt[rid, :600]  # a reused row whose table still names request a's locations
    alloc.alloc_extend(rtt, 2, 0, 40)
    return {
        "free_logical": (lambda: alloc.free_logical(rtt[rid, : a.kv_allocated_len], rid=other),
                         f"belongs to request row {rid}"),
        "free_device_buffer": (lambda: alloc.free_device_buffer(buffer, rid=other), f"belongs to request row {rid}"),
        "device allocator free": (lambda: alloc.device_alloc.free(alloc.device_alloc.pages_of(buffer.tensor)),
                                  f"belongs to request row {rid}"),
        "host free_pages": (lambda: w.host.free_pages(HostPages(host_pages)), f"belongs to request row {rid}"),
        "load into another's device slot": (lambda: w.host.load_to_device_per_layer(
            HostSlots(table[:1].clone()), DeviceSlots(buffer.tensor[:1]), 0, owner=other),
            f"belongs to request row {rid}"),
        "alloc_extend on a decoding row": (lambda: alloc.alloc_extend(rtt, rid, 0, 8),
                                           f"request row {rid} is decoding"),
        "stale too-long kv_allocated_len": (lambda: w.coord.admit_request_into_staging(Req(2, 600, stale.uid)),
                                            f"req_to_token\\[2, 40\\] = \\d+ is in request row {rid}'s page"),
    }


@pytest.mark.parametrize("case", ["free_logical", "free_device_buffer", "device allocator free", "host free_pages",
                                  "load into another's device slot", "alloc_extend on a decoding row",
                                  "stale too-long kv_allocated_len"])
def test_one_request_cannot_free_or_overwrite_another_requests_pages(case):
    # The sweep of 1077b6d: each of these freed or overwrote a live request's pages, which then could
    # not finish. Each is refused now, naming the owner, with nothing changed; both requests then
    # decode and finish with their own bytes.
    w = World()
    a, b = _decoding_pair(w)
    call, match = _cross_request_calls(w, a, b)[case]
    with refused(w, RequestStateError, match):
        call()
    w.check_results(w.decode_step([a, b]))
    locs = w.allocator.compressed_locs(w.pool.req_to_token[2, :40])  # the scheduler drops row 2's prefill
    w.allocator.free_device_buffer(w.allocator.device_slots(locs), rid=2)
    w.allocator.full_to_hisparse_device_index_mapping[locs] = -1
    w.allocator.free_logical(w.pool.req_to_token[2, :40], rid=2)
    w.finish_all(a, b)


def test_a_held_row_is_freed_only_by_its_own_release():
    w = World()
    a, b = _decoding_pair(w)
    with refused(w, RequestStateError, "request row 0 is decoding in the coordinator; free_logical must wait"):
        w.allocator.free_logical(w.pool.req_to_token[0, : a.kv_allocated_len], rid=0)
    with refused(w, RequestStateError, "request row 0 is decoding in the coordinator; its device slots are freed by"):
        w.allocator.free_device_buffer(DeviceSlots(w.coord.req_to_device_buffer[0].clone()), rid=0)
    w.coord.request_finished(a)
    assert w.allocator.held_phase(0) is None
    w.allocator.free_logical(w.pool.req_to_token[0, : a.kv_allocated_len], rid=0)  # its own finish: accepted
    w.finish_all(b)
    w.check_all_free()

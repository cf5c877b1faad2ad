"""A stateful test of the HiSparse runtime: allocator, device pool, host pool and coordinator together.

Hypothesis interleaves what a scheduler does (prefill + staging, direct PD transfers, collection,
decode steps with swap-ins, finishing) with misuse of every kind found so far (rows twice admitted,
unknown or negative rows, locations that would hit the mapping's sentinel, bools and floats for
ints, float id tensors, double frees, bad layers, exhausted pools, a finish or an admission whose
length disagrees with what was admitted or allocated, a swap-in of a row that is not decoding).
The invariants:

* a refused call raises the documented error and leaves the whole observable state unchanged
  (free lists, page owners, held rows, tables, mapping, staging queue, pending backup, device and
  host bytes): in particular a free or a write of one request's pages by another request, by no
  request, or by the owner outside its own release (``free_logical``, ``free_device_buffer``, the
  page allocators' ``free``, the host pool's ``free_pages`` / ``free``, a load into its device
  slots), an ``alloc_extend`` of a staging or decoding row, and an admission with a reused row's
  stale, too-long ``kv_allocated_len`` are refused and change no request's bytes or tables;
* after every step each page (logical, device, host) has at most one owner, the owners' pages are
  exactly the allocated ones, and free + allocated == capacity;
* every slot a swap-in returns holds the bytes of the entry asked for, and every entry that has
  reached the host holds its bytes when the request finishes;
* finishing every request at the end of a run frees everything.

The default profile runs 400 steps; ``--slow`` runs 20,000.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparsekv.srt.errors import RequestStateError
from sparsekv.srt.managers.hisparse_coordinator import HiSparseCoordinator
from sparsekv.srt.mem_cache.allocators import AllocatorExhaustedError, HiSparseTokenToKVPoolAllocator
from sparsekv.srt.mem_cache.dsv4_paged_host_pool import DeepSeekV4PagedHostPool
from sparsekv.srt.mem_cache.hisparse_device_pool import HiSparseC4DevicePool
from sparsekv.srt.mem_cache.hisparse_host_pool import HostPoolExhaustedError
from sparsekv.srt.mem_cache.ids import DeviceSlots, HostPages, HostSlots
from sparsekv.srt.streams import CpuStreams
from sparsekv.testing.hisparse_runtime import (
    Req,
    ReqToTokenPool,
    changed,
    entry_bytes,
    resident_index_disagreements,
    snapshot,
)
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.reference.hisparse import token_bytes, write_token

# Small on purpose: 4 device pages, 8 logical pages and 6 host pages run out often.
TOP_K, HOT, LAYERS = 5, 7, 2
MAX_REQS, MAX_CONTEXT, PAGE, RATIO = 4, 1024, 256, 4
DEVICE_TOKENS, HOST_PAGES = 1024, 6
DPAGE = PAGE // RATIO

ARGUMENT_ERRORS = (TypeError, ValueError, IndexError)


def with_index_checks(call):
    """``call`` under SPARSEKV_CHECK_INDICES=1: the swap-in checks a row's phase only then (off, it
    reads nothing back and a row that is not decoding loads nothing)."""
    def run():
        before = os.environ.get("SPARSEKV_CHECK_INDICES")
        os.environ["SPARSEKV_CHECK_INDICES"] = "1"
        try:
            return call()
        finally:
            if before is None:
                del os.environ["SPARSEKV_CHECK_INDICES"]
            else:
                os.environ["SPARSEKV_CHECK_INDICES"] = before
    return run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Row:
    req: Req
    phase: str       # the coordinator's phase: "transfer", "staging" or "decode"
    prompt_len: int  # entries below prompt_len // 4 reached the host at admission


class HiSparseRuntime(RuleBasedStateMachine):
    #: Swap in through the resident-token index (the indexed kernel) instead of the scanning kernel.
    RESIDENT_INDEX = False
    #: The swap-in's replacement policy (``swap_in_policy=``).
    SWAP_IN_POLICY: object = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.pool = ReqToTokenPool(torch.zeros(MAX_REQS, MAX_CONTEXT, dtype=torch.int64))
        self.allocator = HiSparseTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, host_to_device_ratio=2)
        self.device_pool = HiSparseC4DevicePool(self.allocator, LAYERS, "cpu")
        host_pool = DeepSeekV4PagedHostPool("c4", self.device_pool.kv_buffer, HOST_PAGES)
        self.coord = HiSparseCoordinator(self.pool, self.allocator, self.device_pool, num_top_k=TOP_K,
                                         hot_buffer_size=HOT, host_pool=host_pool,
                                         streams=CpuStreams(deferred=True), resident_index=self.RESIDENT_INDEX,
                                         swap_in_policy=self.SWAP_IN_POLICY)
        self.host = self.coord.mem_pool_host
        self.rows: dict[int, Row] = {}
        self.staging_order: list[int] = []
        self.next_uid = 1

    # ---- helpers ------------------------------------------------------------------

    def snap(self) -> dict[str, object]:
        return snapshot(self.coord, self.pool.req_to_token)

    def free_rows(self) -> list[int]:
        return [r for r in range(MAX_REQS) if r not in self.rows]

    def rows_in(self, *phases: str) -> list[int]:
        return [r for r, row in self.rows.items() if row.phase in phases]

    def new_req(self, rid: int, prompt_len: int) -> Req:
        self.next_uid += 1
        return Req(rid, prompt_len, uid=self.next_uid)

    def locs_of(self, rid: int, length: int | None = None) -> torch.Tensor:
        n = self.rows[rid].req.kv_allocated_len if length is None else length
        return self.allocator.compressed_locs(self.pool.req_to_token[rid, :n])

    def refused(self, call, errors, kind: str) -> None:
        """``call`` must raise one of ``errors`` and change nothing."""
        before = self.snap()
        try:
            call()
        except errors:
            pass
        else:
            raise AssertionError(f"misuse {kind!r} was accepted")
        assert changed(before, self.snap()) == [], (kind, changed(before, self.snap()))

    def write_device_entries(self, req: Req, positions, slots) -> None:
        for layer in range(LAYERS):
            for pos, slot in zip(positions, slots):
                write_token(self.device_pool.kv_buffer[layer], int(slot), entry_bytes(req.uid, pos, layer),
                            page_slots=DPAGE)

    # ---- what a scheduler does ----------------------------------------------------------

    @precondition(lambda self: len(self.rows) < MAX_REQS)
    @rule(data=st.data(), prompt_len=st.integers(1, 700), collect=st.booleans(),
          cuts=st.lists(st.integers(1, 699), max_size=2))
    def prefill_and_stage(self, data, prompt_len, collect, cuts):
        """A prefill in chunks (ending at ``cuts`` below ``prompt_len``), then staging."""
        rid = data.draw(st.sampled_from(self.free_rows()))
        ends = sorted({c for c in cuts if c < prompt_len}) + [prompt_len]
        start = 0
        for end in ends:
            before = self.snap()
            try:
                self.allocator.alloc_extend(self.pool.req_to_token, rid, start, end)
            except AllocatorExhaustedError:
                assert changed(before, self.snap()) == []
                self.abort_prefill(rid, start)
                return
            start = end
        req = self.new_req(rid, prompt_len)
        locs = self.allocator.compressed_locs(self.pool.req_to_token[rid, :prompt_len])
        self.write_device_entries(req, range(locs.numel()), self.allocator.device_slots(locs).tensor)
        if locs.numel():
            self.refused(lambda: self.coord.admit_request_direct(req), (ValueError,),
                         "admit_direct a prefill with device slots")
        if prompt_len >= RATIO:  # the last C4 entry's tokens left out: its device slot would leak
            self.refused(lambda: self.coord.admit_request_into_staging(Req(rid, prompt_len - RATIO, req.uid)),
                         (RequestStateError,), "admit_staging shorter than allocated")
        stale = -(-prompt_len // PAGE) * PAGE + 1  # one position into a page the row was never given
        if stale <= MAX_CONTEXT:  # a reused row's stale length: its table names earlier requests' pages
            self.refused(lambda: self.coord.admit_request_into_staging(Req(rid, stale, req.uid)),
                         (RequestStateError,), "admit_staging a reused row with a stale, too-long length")
        before = self.snap()
        try:
            self.coord.admit_request_into_staging(req)
        except HostPoolExhaustedError:
            assert changed(before, self.snap()) == []
            self.abort_prefill(rid, prompt_len)
            return
        self.rows[rid] = Row(req, "staging", prompt_len)
        self.staging_order.append(rid)
        if collect:  # the backup completes at once and the scheduler collects (the common case)
            self.staging_backups_complete()
            self.collect()

    def abort_prefill(self, rid: int, length: int) -> None:
        """The scheduler takes an unadmitted prefill back: device slots, mapping entries, locations."""
        locs = self.allocator.compressed_locs(self.pool.req_to_token[rid, :length])
        self.allocator.free_device_buffer(self.allocator.device_slots(locs), rid=rid)
        self.allocator.full_to_hisparse_device_index_mapping[locs] = -1
        self.allocator.free_logical(self.pool.req_to_token[rid, :length], rid=rid)

    @precondition(lambda self: len(self.rows) < MAX_REQS)
    @rule(data=st.data(), prompt_len=st.integers(1, 500), admit=st.booleans())
    def direct_transfer(self, data, prompt_len, admit):
        rid = data.draw(st.sampled_from(self.free_rows()))
        before = self.snap()
        try:
            self.allocator.alloc_extend(self.pool.req_to_token, rid, 0, prompt_len, with_device=False)
        except AllocatorExhaustedError:
            assert changed(before, self.snap()) == []
            return
        req = self.new_req(rid, prompt_len)
        n = prompt_len // RATIO
        stale = -(-prompt_len // PAGE) * PAGE + 1
        if stale <= MAX_CONTEXT:
            self.refused(lambda: self.coord.admit_request_direct(Req(rid, stale, req.uid)),
                         (RequestStateError,), "admit_direct a reused row with a stale, too-long length")
        if n:
            self.refused(lambda: self.coord.admit_request_direct(req), (ValueError,),
                         "admit_direct before the host slots")
        before = self.snap()
        try:
            host = self.coord.alloc_direct_host_slots(req, n).tensor
        except HostPoolExhaustedError:
            assert changed(before, self.snap()) == []
            self.allocator.free_logical(self.pool.req_to_token[rid, :prompt_len], rid=rid)
            return
        for layer in range(LAYERS):  # the prefill side's transfer engine
            for pos in range(n):
                write_token(self.host.kv_buffer[layer], int(host[pos]), entry_bytes(req.uid, pos, layer),
                            page_slots=DPAGE)
        self.rows[rid] = Row(req, "transfer", prompt_len)
        if admit:
            self.admit_direct_row(rid)

    @precondition(lambda self: any(row.phase == "transfer" for row in self.rows.values()))
    @rule(data=st.data())
    def admit_direct(self, data):
        self.admit_direct_row(data.draw(st.sampled_from(self.rows_in("transfer"))))

    def admit_direct_row(self, rid: int) -> None:
        before = self.snap()
        try:
            self.coord.admit_request_direct(self.rows[rid].req)
        except AllocatorExhaustedError:
            assert changed(before, self.snap()) == []
            return
        self.rows[rid].phase = "decode"

    @rule()
    def staging_backups_complete(self):
        self.coord.write_staging_stream.synchronize()

    @rule()
    def collect(self):
        ready = self.coord.collect_ready_reqs()
        rids = [r.req_pool_idx for r in ready]
        assert rids == self.staging_order[: len(rids)], "collected out of admission order"
        for rid in rids:
            self.rows[rid].phase = "decode"
        del self.staging_order[: len(rids)]

    @precondition(lambda self: any(row.phase == "decode" for row in self.rows.values()))
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 12))
    def decode_steps(self, data, seed, steps):
        rids = data.draw(st.lists(st.sampled_from(self.rows_in("decode")), min_size=1, unique=True))
        rng = random.Random(seed)
        for _ in range(steps):
            self.decode_step(rids, rng)

    def decode_step(self, rids: list[int], rng: random.Random) -> None:
        """One decode step of the rows ``rids`` (those with room left): allocate, route, write the new
        C4 entry, swap in every layer and check the bytes."""
        rids = [r for r in rids if self.rows[r].req.kv_allocated_len < MAX_CONTEXT]
        if not rids:
            return
        reqs = [self.rows[r].req for r in rids]
        new_pages = sum(r.kv_allocated_len % PAGE == 0 for r in reqs)
        if new_pages > self.allocator.logical.available_pages:
            return
        out_locs = []
        for req in reqs:
            req.kv_allocated_len += 1
            out_locs.append(self.allocator.alloc_decode(self.pool.req_to_token, req.req_pool_idx,
                                                        req.kv_allocated_len))
        before = self.snap()
        try:
            self.coord.map_last_loc_to_buffer(rids, [r.kv_allocated_len for r in reqs], out_locs)
        except HostPoolExhaustedError:
            assert changed(before, self.snap()) == []
            for req, loc in zip(reqs, out_locs):  # the scheduler retracts the step's tokens
                req.kv_allocated_len -= 1
                if req.kv_allocated_len % PAGE == 0:
                    self.allocator.logical.free(torch.tensor([loc // PAGE]), owner=req.req_pool_idx)
            return
        mapping = self.allocator.full_to_hisparse_device_index_mapping
        for req, loc in zip(reqs, out_locs):
            if req.kv_allocated_len % RATIO == 0:  # the compressor writes the new C4 entry
                self.write_device_entries(req, [req.kv_allocated_len // RATIO - 1], [int(mapping[loc // RATIO])])
        c4_lens = [self.coord.host_token_len(r.kv_allocated_len) for r in reqs]
        for layer in range(LAYERS):
            top_k = [self.draw_top_k(rng, n) for n in c4_lens]
            out = self.coord.swap_in_selected_pages(torch.tensor(rids), torch.tensor(c4_lens, dtype=torch.int32),
                                                    torch.tensor(top_k, dtype=torch.int32), layer)
            for b, req in enumerate(reqs):
                self.check_swap_in(req, layer, c4_lens[b], top_k[b], out[b].tolist())

    @staticmethod
    def draw_top_k(rng: random.Random, n: int) -> list[int]:
        picks = rng.sample(range(n), min(n, TOP_K)) if rng.random() < 0.7 else \
            [rng.choice(list(range(n)) + [-1, n, n + 5]) for _ in range(TOP_K)]
        return (picks + [-1] * TOP_K)[:TOP_K]

    def check_swap_in(self, req: Req, layer: int, n: int, top_k: list[int], out: list[int]) -> None:
        for i, (tok, loc) in enumerate(zip(top_k, out)):
            used = i < min(n, TOP_K) if n <= HOT else True  # the fast path answers the first n columns
            if not (0 <= tok < n and used):
                assert loc == -1, (req, layer, top_k, out)
                continue
            got = token_bytes(self.device_pool.kv_buffer[layer], loc, page_slots=DPAGE)
            assert torch.equal(got, entry_bytes(req.uid, tok, layer)), (req, tok, layer, loc)

    @precondition(lambda self: len(self.rows) > 0)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_row(data.draw(st.sampled_from(sorted(self.rows))))

    def finish_row(self, rid: int) -> None:
        row = self.rows[rid]
        self.coord.write_staging_stream.synchronize()
        self.coord.decode_backup_stream.synchronize()
        self.check_host_entries(row)
        self.coord.request_finished(row.req)
        self.allocator.free_logical(self.pool.req_to_token[rid, : row.req.kv_allocated_len], rid=rid)
        del self.rows[rid]
        if rid in self.staging_order:
            self.staging_order.remove(rid)

    def check_host_entries(self, row: Row) -> None:
        """Every entry the host has received by now holds its bytes: the prompt's, then each decode
        entry once the step after it backed it up."""
        rid, kv = row.req.req_pool_idx, row.req.kv_allocated_len
        on_host = max(row.prompt_len // RATIO, (kv - 1) // RATIO if row.phase == "decode" else 0)
        slots = self.coord.req_to_host_pool[rid, :on_host].tolist()
        for layer in range(LAYERS):
            for pos, slot in enumerate(slots):
                got = token_bytes(self.host.kv_buffer[layer], slot, page_slots=DPAGE)
                assert torch.equal(got, entry_bytes(row.req.uid, pos, layer)), (row, pos, layer)

    # ---- misuse: each refused with nothing changed ---------------------------------

    @rule(data=st.data(), count=st.integers(1, 4))
    def misuse(self, data, count):
        """Calls a careless caller makes, each drawn from every kind that applies now."""
        for _ in range(count):
            # Pick a group first, so the few kinds that need a live or decoding row (or another
            # request's pages) are drawn as often as the many that need nothing.
            groups = self.misuse_calls(data)
            kinds = groups[data.draw(st.sampled_from(sorted(g for g in groups if groups[g])))]
            kind = data.draw(st.sampled_from(sorted(kinds)))
            call, errors = kinds[kind]
            self.refused(call, errors, kind)

    def misuse_calls(self, data) -> dict[str, dict[str, tuple]]:
        """Misuse kinds by group (any time; on a free, a live or a decoding row): kind -> (call, errors)."""
        a, c, rtt = self.allocator, self.coord, self.pool.req_to_token
        state = (RequestStateError,)
        free = self.free_rows()
        calls = {
            # allocator
            "alloc_extend row out of range": (lambda: a.alloc_extend(rtt, MAX_REQS + 95, 0, 300), (IndexError,)),
            "alloc_extend negative row": (lambda: a.alloc_extend(rtt, -1, 0, 300), (IndexError,)),
            "alloc_extend bool row": (lambda: a.alloc_extend(rtt, True, 0, 300), (TypeError,)),
            "alloc_extend float seq_len": (lambda: a.alloc_extend(rtt, 0, 0, 300.0), (TypeError,)),
            "alloc_extend seq_len < prefix_len": (lambda: a.alloc_extend(rtt, 0, 300, 10), (ValueError,)),
            "alloc_extend beyond the table": (lambda: a.alloc_extend(rtt, 0, 0, MAX_CONTEXT + 1), (ValueError,)),
            "alloc_extend float table": (lambda: a.alloc_extend(rtt.float(), 0, 0, 8), (TypeError,)),
            "alloc_extend int with_device": (lambda: a.alloc_extend(rtt, 0, 0, 8, with_device=1), (TypeError,)),
            "alloc_extend too big": (lambda: a.alloc_extend(torch.zeros(1, 1 << 14, dtype=torch.int64), 0, 0,
                                                            1 << 14), (AllocatorExhaustedError,)),
            "alloc_decode negative row": (lambda: a.alloc_decode(rtt, -1, 5), (IndexError,)),
            "alloc_decode seq_len 0": (lambda: a.alloc_decode(rtt, 0, 0), (ValueError,)),
            "logical alloc bool": (lambda: a.logical.alloc(True), (TypeError,)),
            "device alloc float": (lambda: a.device_alloc.alloc(1.0), (TypeError,)),
            "device alloc negative": (lambda: a.device_alloc.alloc(-5), (ValueError,)),
            "device alloc too many": (lambda: a.device_alloc.alloc(a.num_device_pages), (AllocatorExhaustedError,)),
            "device free float ids": (lambda: a.device_alloc.free(torch.tensor([1.7])), (TypeError,)),
            "device free bool ids": (lambda: a.device_alloc.free(torch.tensor([True])), (TypeError,)),
            "device free reserved page": (lambda: a.device_alloc.free(torch.tensor([0])), (ValueError,)),
            "free_logical float locs": (lambda: a.free_logical(torch.tensor([256.0]), rid=0), (TypeError,)),
            "device_slots negative loc": (lambda: a.device_slots(torch.tensor([-1])), (IndexError,)),
            "free_device_buffer bare tensor": (lambda: a.free_device_buffer(torch.tensor([64]), rid=0), (TypeError,)),
            "alloc_device_buffer need too small": (lambda: a.alloc_device_buffer(torch.zeros(0, dtype=torch.int64),
                                                                                 DPAGE, rid=0), (ValueError,)),
            # host pool
            "host alloc_page bool": (lambda: self.host.alloc_page(True), (TypeError,)),
            "host alloc_page negative": (lambda: self.host.alloc_page(-1), (ValueError,)),
            "host alloc_page too many": (lambda: self.host.alloc_page(HOST_PAGES + 1), (HostPoolExhaustedError,)),
            "host free not whole pages": (lambda: self.host.free(HostSlots(torch.tensor([5]))), (ValueError,)),
            "host free_pages out of range": (lambda: self.host.free_pages(HostPages(torch.tensor([HOST_PAGES]))),
                                             (ValueError,)),
            "host alloc row negative": (lambda: self.host.alloc_paged_token_slots(
                c.req_to_host_pool, c.req_to_host_pool_allocated_len, -1, 0, 4), (IndexError,)),
            "host alloc num_tokens negative": (lambda: self.host.alloc_paged_token_slots(
                c.req_to_host_pool, c.req_to_host_pool_allocated_len, 0, 0, -5), (ValueError,)),
            "host load negative layer": (lambda: self.host.load_to_device_per_layer(
                HostSlots(torch.arange(4)), DeviceSlots(torch.arange(4)), -1), (IndexError,)),
            "host load bool layer": (lambda: self.host.load_to_device_per_layer(
                HostSlots(torch.arange(4)), DeviceSlots(torch.arange(4)), True), (TypeError,)),
            "host load layer beyond": (lambda: self.host.load_to_device_per_layer(
                HostSlots(torch.arange(4)), DeviceSlots(torch.arange(4)), LAYERS), (IndexError,)),
            "host backup slot out of range": (lambda: self.host.backup_from_device_all_layer(
                HostSlots(torch.tensor([HOST_PAGES * DPAGE])), DeviceSlots(torch.tensor([1]))), (IndexError,)),
            "host backup bare tensor": (lambda: self.host.backup_from_device_all_layer(
                torch.tensor([0]), DeviceSlots(torch.tensor([1]))), (TypeError,)),
            # coordinator, any state
            "map_last_loc length mismatch": (lambda: c.map_last_loc_to_buffer([0], [5, 6], [3]), (ValueError,)),
            "map_last_loc negative row": (lambda: c.map_last_loc_to_buffer([-1], [5], [3]), (IndexError,)),
            "map_last_loc float seq_len": (lambda: c.map_last_loc_to_buffer([0], [5.0], [3]), ARGUMENT_ERRORS),
            "map_last_loc float tensor rows": (lambda: c.map_last_loc_to_buffer(torch.tensor([0.0]), [5], [3]),
                                               (TypeError,)),
            "map_last_loc a string": (lambda: c.map_last_loc_to_buffer("0", [5], [3]), (TypeError,)),
            "swap_in negative layer": (lambda: c.swap_in_selected_pages(
                torch.tensor([0]), torch.tensor([1], dtype=torch.int32), torch.zeros(1, TOP_K, dtype=torch.int32),
                -1), (IndexError,)),
            "swap_in bool layer": (lambda: c.swap_in_selected_pages(
                torch.tensor([0]), torch.tensor([1], dtype=torch.int32), torch.zeros(1, TOP_K, dtype=torch.int32),
                True), (TypeError,)),
            "finish negative row": (lambda: c.request_finished(Req(-1, 0, 0)), (IndexError,)),
            "finish not a request": (lambda: c.request_finished(0), (TypeError,)),
            "swap_in more rows than requests": (lambda: c.swap_in_selected_pages(
                torch.zeros(MAX_REQS + 1, dtype=torch.int64), torch.ones(MAX_REQS + 1, dtype=torch.int32),
                torch.zeros(MAX_REQS + 1, TOP_K, dtype=torch.int32), 0), (ValueError,)),
            "admit bool row": (lambda: c.admit_request_into_staging(Req(True, 8, 0)), (TypeError,)),
            "admit float kv_allocated_len": (lambda: c.admit_request_direct(Req(0, 8.0, 0)), (TypeError,)),
            "host_token_len bool": (lambda: c.host_token_len(True), (TypeError,)),
        }
        groups = {"any": calls, "free row": {}, "live row": {}, "decoding row": {}, "cross request": {}}
        if free:
            calls = groups["free row"]
            free_rid = data.draw(st.sampled_from(free), label="free row")
            calls |= {
                "finish unknown row": (lambda: c.request_finished(Req(free_rid, 0, 0)), state),
                "swap_in an unknown row": (with_index_checks(lambda: c.swap_in_selected_pages(
                    torch.tensor([free_rid]), torch.ones(1, dtype=torch.int32),
                    torch.zeros(1, TOP_K, dtype=torch.int32), 0)), state),
                "map_last_loc unknown row": (lambda: c.map_last_loc_to_buffer([free_rid], [5], [3]), state),
                "alloc_extend continuing an empty row": (lambda: a.alloc_extend(rtt, free_rid, 10, 300),
                                                         (ValueError,)),
                "direct host slots negative count": (lambda: c.alloc_direct_host_slots(Req(free_rid, 0, 0), -5),
                                                     (ValueError,)),
            }
        if self.rows:
            calls = groups["live row"]
            live_rid = data.draw(st.sampled_from(sorted(self.rows)), label="live row")
            live = self.rows[live_rid]
            if live.phase in ("staging", "decode"):
                calls |= {
                    "admit_direct twice / while staging": (lambda: c.admit_request_direct(live.req), state),
                    "admit_staging twice": (lambda: c.admit_request_into_staging(live.req), state),
                    "direct host slots while admitted": (lambda: c.alloc_direct_host_slots(live.req, 4), state),
                }
            if live.phase == "transfer":
                live_held = int(c.req_to_host_pool_allocated_len[live_rid])
                beyond = Req(live_rid, min(MAX_CONTEXT, (live_held + 1) * RATIO), live.req.uid)
                calls |= {
                    "admit_direct beyond the host entries": (lambda: c.admit_request_direct(beyond), (ValueError,)),
                    "admit_staging a direct transfer": (lambda: c.admit_request_into_staging(live.req), state),
                }
            if live.phase != "decode":
                calls["map_last_loc not decoding"] = (
                    lambda: c.map_last_loc_to_buffer([live_rid], [live.req.kv_allocated_len + 1], [3]), state)
                calls["swap_in a row not decoding"] = (with_index_checks(lambda: c.swap_in_selected_pages(
                    torch.tensor([live_rid]), torch.ones(1, dtype=torch.int32),
                    torch.zeros(1, TOP_K, dtype=torch.int32), 0)), state)
            if live.req.kv_allocated_len >= 1:
                calls["finish with a shorter length"] = (
                    lambda: c.request_finished(Req(live_rid, live.req.kv_allocated_len - 1, live.req.uid)), state)
            owned = sorted(a.logical.used_pages)
            calls["logical double free"] = (lambda: a.logical.free(torch.tensor([owned[0], owned[0]])), (ValueError,))
            table = c.req_to_host_pool[live_rid]
            host_pages = sorted(set((table[table >= 0] // DPAGE).tolist()))
            if host_pages:
                calls["host double free"] = (
                    lambda: self.host.free_pages(HostPages(torch.tensor([host_pages[0]] * 2))), (ValueError,))
            calls["direct host slots beyond the table"] = (
                lambda: c.alloc_direct_host_slots(live.req, c.req_to_host_pool.shape[1]), ARGUMENT_ERRORS)
            groups["cross request"] = self.cross_request_calls(data, live_rid)
        decoding = self.rows_in("decode")
        if decoding:
            calls = groups["decoding row"]
            dec_rid = data.draw(st.sampled_from(decoding), label="decoding row")
            req = self.rows[dec_rid].req
            seq_len = req.kv_allocated_len + 1
            produces = seq_len % RATIO == 0
            # A location with the residue of a token that does (3) or does not (0) produce an entry.
            base = int(self.pool.req_to_token[dec_rid, req.kv_allocated_len - 1]) // PAGE * PAGE
            residue = RATIO - 1 if produces else 0
            bad_locs = {
                "map_last_loc negative location": (-4, (IndexError,)),
                "map_last_loc location beyond the mapping": (self.allocator.size_full + 10 * PAGE + 3, (IndexError,)),
                "map_last_loc float location": (float(base + residue), (TypeError,)),
                "map_last_loc bool location": (True, (TypeError,)),
                "map_last_loc wrong residue": (base + RATIO - 1 - residue, (ValueError,)),
            }
            unowned = [p for p in range(1, a.logical.num_pages) if not a.logical.is_allocated(p)]
            if unowned:
                bad_locs["map_last_loc unallocated page"] = (unowned[0] * PAGE + residue, (ValueError,))
            others = [r for r in decoding if r != dec_rid]
            if others:  # the other row's newest location has the right residue but the wrong owner
                other_last = int(self.pool.req_to_token[others[0], self.rows[others[0]].req.kv_allocated_len - 1])
                other_loc = other_last // PAGE * PAGE + residue
                bad_locs["map_last_loc another row's location"] = (other_loc, (ValueError,))
            first = [others[0]] if others else []
            first_seq = [self.rows[others[0]].req.kv_allocated_len] if others else []
            first_loc = [int(self.pool.req_to_token[others[0], self.rows[others[0]].req.kv_allocated_len - 1])] \
                if others else []
            for kind, (loc, errors) in bad_locs.items():
                calls[kind] = (lambda loc=loc: c.map_last_loc_to_buffer(first + [dec_rid], first_seq + [seq_len],
                                                                        first_loc + [loc]), errors)
            calls["map_last_loc row twice"] = (
                lambda: c.map_last_loc_to_buffer([dec_rid, dec_rid], [seq_len] * 2, [3, 3]), (ValueError,))
            far = MAX_CONTEXT - RATIO + 1  # completes an entry far beyond what the host holds
            if (far - 1) // RATIO - 1 > int(c.req_to_host_pool_allocated_len[dec_rid]) and \
                    not c._reqs[dec_rid].skip_first_backup:
                calls["map_last_loc skipping host entries"] = (
                    lambda: c.map_last_loc_to_buffer([dec_rid], [far], [base]), (ValueError,))
            buffer = c.req_to_device_buffer[dec_rid].clone()
            calls["alloc_device_buffer entry twice"] = (
                lambda: a.alloc_device_buffer(torch.tensor([0, 0]), HOT + DPAGE, rid=dec_rid), (ValueError,))
            calls["device double free of a hot buffer"] = (
                lambda: a.device_alloc.free(torch.cat([a.device_alloc.pages_of(buffer)] * 2)), (ValueError,))
        return groups

    def cross_request_calls(self, data, rid: int) -> dict[str, tuple]:
        """Frees and writes of live row ``rid``'s pages by another row, or by no row, or by ``rid``
        itself outside its own release: each refused (a RequestStateError naming the owner or the
        phase), so no other request's bytes or tables change."""
        a, c, rtt = self.allocator, self.coord, self.pool.req_to_token
        state = (RequestStateError,)
        row = self.rows[rid]
        other = data.draw(st.sampled_from([r for r in range(MAX_REQS) if r != rid]), label="other row")
        full = rtt[rid, : row.req.kv_allocated_len].clone()
        logical_pages = a.logical.pages_of(full)
        calls = {
            "free_logical another row's pages": (lambda: a.free_logical(full, rid=other), state),
            "free_logical a held row's pages before its finish": (lambda: a.free_logical(full, rid=rid), state),
            "logical free of a live row's pages without an owner": (lambda: a.logical.free(logical_pages), state),
        }
        table = c.req_to_host_pool[rid]
        host_pages = torch.unique(table[table >= 0] // DPAGE)
        if host_pages.numel():
            calls |= {
                "host free_pages of a live row's pages": (lambda: self.host.free_pages(HostPages(host_pages)), state),
                "host free_pages of a live row's pages for another row": (
                    lambda: self.host.free_pages(HostPages(host_pages), owner=other), state),
                "host free of a live row's slots for another row": (
                    lambda: self.host.free(HostPages(host_pages[:1]).slots(DPAGE), owner=other), state),
            }
        if row.phase == "staging":
            slots = a.device_slots(self.locs_of(rid)).tensor
        elif row.phase == "decode":
            slots = c.req_to_device_buffer[rid].clone()
        else:
            slots = torch.empty(0, dtype=torch.int64)
        if slots.numel():
            device_pages = a.device_alloc.pages_of(slots)
            calls |= {
                "free_device_buffer another row's slots": (lambda: a.free_device_buffer(DeviceSlots(slots), rid=other),
                                                           state),
                "free_device_buffer a held row's slots before its finish": (
                    lambda: a.free_device_buffer(DeviceSlots(slots), rid=rid), state),
                "device free of a live row's pages": (lambda: a.device_alloc.free(device_pages), state),
                "device free of a live row's pages for another row": (
                    lambda: a.device_alloc.free(device_pages, owner=other), state),
                "host load into a live row's device slot": (lambda: self.host.load_to_device_per_layer(
                    HostSlots(torch.tensor([0])), DeviceSlots(slots[:1]), 0), state),
                "host load into a live row's device slot for another row": (
                    lambda: self.host.load_to_device_per_layer(HostSlots(torch.tensor([0])), DeviceSlots(slots[-1:]),
                                                               LAYERS - 1, owner=other), state),
            }
        if row.phase in ("staging", "decode"):
            kv = row.req.kv_allocated_len
            calls["alloc_extend a staging or decoding row from 0"] = (lambda: a.alloc_extend(rtt, rid, 0, 8), state)
            if kv < MAX_CONTEXT:
                calls["alloc_extend appending to a staging or decoding row"] = (
                    lambda: a.alloc_extend(rtt, rid, kv, kv + 1), state)
        return calls

    # ---- invariants ---------------------------------------------------------------

    @invariant()
    def pages_have_one_owner_and_add_up(self):
        c, a = self.coord, self.allocator
        for alloc, reserved in ((a.logical, {0}), (a.device_alloc, {0}), (self.host.page_alloc, set())):
            free, used = torch.cat([alloc._free, *alloc._released]).tolist(), alloc.used_pages
            assert len(set(free)) == len(free) and not set(free) & used and not (set(free) | used) & reserved
            assert len(free) + len(used) == alloc.num_pages - len(reserved) and len(free) == alloc.available_pages
        assert self.host.page_alloc.num_pages == HOST_PAGES == self.host.num_pages
        host_used = self.host.page_alloc.used_pages

        logical, device, host = [], [], []
        for rid, row in self.rows.items():
            kv = row.req.kv_allocated_len
            logical.append(set((self.pool.req_to_token[rid, :kv] // PAGE).tolist()))
            if row.phase == "staging":
                slots = a.device_slots(self.locs_of(rid)).tensor
                assert bool((slots >= 0).all()) and slots.unique().numel() == slots.numel()
            elif row.phase == "decode":
                slots = c.req_to_device_buffer[rid]
                assert slots.unique().numel() == slots.numel() == HOT + DPAGE
                mapped = a.full_to_hisparse_device_index_mapping[self.locs_of(rid)]
                assert bool(torch.isin(mapped[mapped >= 0], slots).all()), "an entry maps outside its hot buffer"
            else:
                slots = torch.empty(0, dtype=torch.int64)
            device.append(set(a.device_alloc.pages_of(slots).tolist()))
            held = int(c.req_to_host_pool_allocated_len[rid])
            table = c.req_to_host_pool[rid]
            assert bool((table[:held] >= 0).all()) and bool((table[held:] == -1).all()) and held % DPAGE == 0
            host.append(set((table[:held] // DPAGE).tolist()))
        for owners, used, alloc in ((logical, a.logical.used_pages, a.logical),
                                    (device, a.device_alloc.used_pages, a.device_alloc),
                                    (host, host_used, self.host.page_alloc)):
            assert sum(len(s) for s in owners) == len(set().union(*owners)), "a page has two owners"
            assert set().union(*owners) == used, "an allocated page no live request owns (a leak), or the reverse"
            for rid, pages in zip(self.rows, owners):  # each page records the request row that holds it
                assert {alloc.owner_of(p) for p in pages} <= {rid}, (alloc.name, rid, pages)
        assert a._held_rows == {rid: row.phase for rid, row in self.rows.items()}
        for rid in range(MAX_REQS):
            if rid not in self.rows:
                assert int(c.req_to_host_pool_allocated_len[rid]) == 0
                assert bool((c.req_to_device_buffer[rid] == -1).all())

    @invariant()
    def the_resident_index_agrees_with_the_slot_tokens(self):
        assert resident_index_disagreements(self.coord) == []

    @invariant()
    def phases_match_the_coordinator(self):
        phases = {rid: s.phase for rid, s in self.coord._reqs.items()}
        assert phases == {rid: row.phase for rid, row in self.rows.items()}
        assert [q.req_pool_idx for _, q in self.coord.ack_staging_queue] == self.staging_order
        live = [self.locs_of(rid) for rid in self.rows]
        mapping = self.allocator.full_to_hisparse_device_index_mapping.clone()
        if live:
            mapping[torch.cat(live)] = -1
        assert bool((mapping == -1).all()), "a mapping entry outside every live request"

    def teardown(self):
        for rid in sorted(self.rows):
            self.finish_row(rid)
        a = self.allocator
        assert a.logical.used_pages == set() and a.device_alloc.used_pages == set()
        assert self.host.available_pages == HOST_PAGES
        assert bool((a.full_to_hisparse_device_index_mapping == -1).all())
        assert self.coord._reqs == {} and self.coord.ack_staging_queue == []


# The ci profile runs 10 x 40 = 400 steps (about 15 s on one core); --slow runs 200 x 100 = 20,000.
TestHiSparseRuntime = HiSparseRuntime.TestCase
TestHiSparseRuntime.settings = settings(settings.default, max_examples=scaled_examples(10),
                                        stateful_step_count=100 if scaled_examples(10) > 10 else 40)


class HiSparseRuntimeIndexed(HiSparseRuntime):
    RESIDENT_INDEX = True


# The same machine on the indexed swap-in (its index rebuilt at admission and release, checked
# against the slot tokens after every rule); fewer examples, the kernels' own machines go deeper.
TestHiSparseRuntimeIndexed = HiSparseRuntimeIndexed.TestCase
TestHiSparseRuntimeIndexed.settings = settings(settings.default, max_examples=scaled_examples(3),
                                               stateful_step_count=100 if scaled_examples(10) > 10 else 40)


class HiSparseRuntimeIndexedProtected(HiSparseRuntimeIndexed):
    # The protected LRU at the machine's scale (the last 3 C4 positions, 1 either side of a requested
    # one: near_lru's windows would protect every slot of a 7-slot buffer).
    SWAP_IN_POLICY = (3, 1)


TestHiSparseRuntimeIndexedProtected = HiSparseRuntimeIndexedProtected.TestCase
TestHiSparseRuntimeIndexedProtected.settings = TestHiSparseRuntimeIndexed.settings

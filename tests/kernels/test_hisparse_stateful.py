"""Stateful check of the swap-in: many decode steps for several requests, kernel against model.

Each machine runs requests that are admitted (prefill resident on the device, or PD-style with every
lookup missing), grow by a few tokens per step, draw random top-k sets (hot tokens, cold ones, the
newest, repeats, -1, out of range), sometimes ride in a batch with CUDA-graph padding rows, and
finish. The machine runs for the generic layout and for the DSV4 C4 layout at every page size (C4
page slots 32, 64 and 128: full-token pages of 128, 256 and 512; 128 under ``--slow``), on every kernel backend (on a
GPU the cuda build is also compared with the cpu build at every step). After every step the kernel
must agree with

* the plain-Python policy model (:mod:`sparsekv.testing.hisparse_policy`), whose per-request state
  evolves on its own, never read back from the kernel: output slots, slot tokens, LRU order;
* the torch reference on the same pre-step state: every table, every byte of the device buffer,
  miss counts, the miss plan and the counters;

and the bytes in every slot the step returned must be the host bytes of the token asked for, in
the swap-in layer and in a second layer fed only by replaying the miss plan. The indexed kernel
(resident-token index) runs the same machine, under LRU and under the protected LRU (the model with
the same windows): its LRU order is read from its queue, and its index must agree with the slot
tokens after every step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sparsekv.jit_kernel.hisparse import copy_cache_planned_mla, policy_protections
from sparsekv.kv_layout import C4_PAGE_SLOTS, DSV4_PAGE_SIZES
from sparsekv.testing.backends import run_on_backend
from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.strategies.hisparse import make_world, random_bytes, top_k_row

K, H = 5, 7
MAX_REQS, MAX_LEN = 3, 48
SIM_EXAMPLES = 5
# The protected LRU of the test shape (in both kernels' tables): the last 3 positions and 1 either
# side of a requested token are evicted last.
PROTECT = (3, 1)


class SwapInMachine(RuleBasedStateMachine):
    def __init__(self, backend: str, page_slots: int | None, indexed: bool = False, policy: object = "lru"):
        super().__init__()
        self.backend = backend
        self.indexed = indexed
        self.policy = policy
        self.protections = policy_protections(policy)
        self.page_slots = page_slots  # None: the generic layout
        self.is_dsv4_layout = page_slots is not None
        self.seq: dict[int, int] = {}
        self.model: dict[int, HotBuffer] = {}

    @initialize(seed=st.integers(0, 2**20))
    def build(self, seed):
        self.world = make_world(K, H, is_dsv4_layout=self.is_dsv4_layout, max_reqs=MAX_REQS, max_len=MAX_LEN,
                                seed=seed, page_slots=self.page_slots or 64, backend=self.backend)
        self.world.policy = self.policy
        if self.indexed:
            self.world.use_resident_index()
        self.host2 = random_bytes(tuple(self.world.host_cache.shape), seed + 11)
        self.device2 = random_bytes(tuple(self.world.device_buffer.shape), seed + 12)
        self.counters = torch.zeros(3, dtype=torch.int64)
        self.expected_counters = [0, 0, 0]

    def place(self, rid, column, token):
        self.world.place(rid, column, token)
        self.world.place(rid, column, token, host_cache=self.host2, device_buffer=self.device2)

    def grow(self, rid, old, new):
        # What the model does as tokens are produced: a position below H into its own slot, the
        # newest position at or beyond H into the reserved column H.
        for pos in range(old, min(new, H)):
            self.place(rid, pos, pos)
        if new - 1 >= H:
            self.place(rid, H, new - 1)
        self.seq[rid] = new

    @precondition(lambda self: len(self.seq) < MAX_REQS)
    @rule(data=st.data())
    def admit(self, data):
        rid = data.draw(st.sampled_from([r for r in range(MAX_REQS) if r not in self.seq]))
        resident = data.draw(st.booleans(), label="prefill resident (else PD-style, all misses)")
        seq_len = data.draw(st.integers(1, 3 * H) if resident else st.integers(H + 1, 3 * H), label="seq_len")
        self.world.reset_request(rid, resident=resident)
        self.model[rid] = HotBuffer.resident_prefix(H) if resident else HotBuffer.empty(H)
        self.grow(rid, 0 if resident else seq_len - 1, seq_len)

    @precondition(lambda self: bool(self.seq))
    @rule(rid=st.integers(0, MAX_REQS - 1))
    def finish(self, rid):
        self.seq.pop(rid, None)
        self.model.pop(rid, None)

    @precondition(lambda self: bool(self.seq))
    @rule(data=st.data())
    def decode_step(self, data):
        live = sorted(self.seq)
        rows = data.draw(st.permutations(live), label="batch order")[: data.draw(st.integers(1, len(live)))]
        for rid in rows:
            self.grow(rid, self.seq[rid], min(self.seq[rid] + data.draw(st.integers(0, 3)), MAX_LEN))
        num_padding = data.draw(st.integers(0, 2), label="padding rows")
        rids = rows + data.draw(st.lists(st.integers(0, MAX_REQS - 1), min_size=num_padding, max_size=num_padding))
        seq_lens = [self.seq[r] for r in rows] + [MAX_LEN] * num_padding
        top_k = [data.draw(top_k_row(K, self.seq[r], self.model[r].tokens)) for r in rows]
        top_k += [[0, 1, 2, 3, 4]] * num_padding
        num_real = len(rows) if num_padding else None

        expected = self.world.reference(top_k, rids, seq_lens, num_real_reqs=num_real)
        res = self.world.swap_in(top_k, rids, seq_lens, num_real_reqs=num_real, plan=True, counters=self.counters)

        # Against the reference, on the same pre-step state: all tables and all bytes.
        assert torch.equal(res["out"], expected.top_k_device_locs)
        assert torch.equal(self.world.device_buffer_tokens, expected.device_buffer_tokens)
        assert [self.world.lru_order(r) for r in range(MAX_REQS)] == expected.lru_slots.tolist()
        assert torch.equal(self.world.device_buffer, expected.device_buffer)
        assert torch.equal(res["miss_count"], expected.miss_count)
        for b, pairs in enumerate(expected.plan):
            got = list(zip(res["miss_src"][b].tolist(), res["miss_dst"][b].tolist()))[: len(pairs)]
            assert got == pairs
        self.expected_counters = [a + b for a, b in zip(self.expected_counters, expected.counters)]
        assert self.counters.tolist() == self.expected_counters

        # Against the model's own state.
        for b, rid in enumerate(rows):
            step = swap_in_step(self.model[rid], top_k[b], self.seq[rid], protect_recent=self.protections[0],
                                protect_near=self.protections[1])
            locs = self.world.device_buffer_locs[rid]
            assert res["out"][b].tolist() == [int(locs[s]) if s >= 0 else -1 for s in step.slots]
            assert self.world.device_buffer_tokens[rid, :H].tolist() == self.model[rid].tokens
            assert self.world.lru_order(rid) == self.model[rid].lru
            assert int(res["miss_count"][b]) == len(step.misses)
        assert res["out"][len(rows):].eq(-1).all()

        # The second layer only sees the plan replayed.
        run_on_backend(self.backend, copy_cache_planned_mla,
                       dict(miss_src=res["miss_src"], miss_dst=res["miss_dst"], miss_count=res["miss_count"],
                            num_real_reqs=torch.tensor([len(rows)], dtype=torch.int32), host_cache=self.host2,
                            device_buffer=self.device2),
                       item_size_bytes=self.world.item_size_bytes, is_dsv4_layout=self.is_dsv4_layout,
                       page_slots=self.page_slots)
        for b, rid in enumerate(rows):
            for i, tok in enumerate(top_k[b]):
                loc = int(res["out"][b, i])
                if loc < 0:
                    continue
                assert torch.equal(self.world.device_token(loc), self.world.host_token(rid, tok))
                assert torch.equal(self.world.device_token(loc, self.device2),
                                   self.world.host_token(rid, tok, self.host2))

    @invariant()
    def lru_rows_are_permutations(self):
        if hasattr(self, "world"):
            for rid in range(MAX_REQS):
                assert sorted(self.world.lru_order(rid)) == list(range(H))

    @invariant()
    def the_resident_index_agrees_with_the_slot_tokens(self):
        if hasattr(self, "world") and self.indexed:
            for rid in range(MAX_REQS):
                assert self.world.resident_index.agrees_with(rid, self.world.device_buffer_tokens)


# The generic layout, then DSV4 C4 at full-token page sizes 128, 256 and 512. Each page size is two
# modules (swap-in and plan replay), built three times in CI (cpu, ASan, sim) for this test alone
# but for 256: by default 256 (the instances the other tests use) and 512 (a page size other than
# 256 in the addressing, the largest); --slow adds 128.
LAYOUTS = [None, pytest.param(C4_PAGE_SLOTS[0], marks=pytest.mark.slow), *C4_PAGE_SLOTS[1:]]
LAYOUT_IDS = ["generic", *(f"dsv4-page{p}" for p in DSV4_PAGE_SIZES)]


def machine_settings(backend: str) -> settings:
    # The simulator runs every thread of a block as a fiber: a fifth of the runs keeps the sim part
    # of the suite to its budget (the deep profile scales both).
    examples = scaled_examples(SIM_EXAMPLES) if backend == "sim" else settings.default.max_examples
    return settings(settings.default, max_examples=examples, stateful_step_count=40)


@pytest.mark.parametrize("page_slots", LAYOUTS, ids=LAYOUT_IDS)
def test_swap_in_state_machine(backend, page_slots):
    run_state_machine_as_test(lambda: SwapInMachine(backend, page_slots),
                              settings=machine_settings(backend))


# The indexed kernel (resident-token index) under the same machine, on generic rows (its DSV4 paths
# are compared with the scanning kernel's in tests/kernels/test_hisparse_index.py), with LRU and
# with the protected LRU; the scanning kernel's protected LRU too.
@pytest.mark.parametrize("page_slots", LAYOUTS[:1], ids=LAYOUT_IDS[:1])
@pytest.mark.parametrize("policy", ["lru", PROTECT], ids=["lru", "protected"])
def test_indexed_swap_in_state_machine(backend, page_slots, policy):
    run_state_machine_as_test(lambda: SwapInMachine(backend, page_slots, indexed=True, policy=policy),
                              settings=machine_settings(backend))


@pytest.mark.parametrize("page_slots", LAYOUTS[:1], ids=LAYOUT_IDS[:1])
def test_protected_swap_in_state_machine(backend, page_slots):
    run_state_machine_as_test(lambda: SwapInMachine(backend, page_slots, policy=PROTECT),
                              settings=machine_settings(backend))

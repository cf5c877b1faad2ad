"""The indexed swap-in (resident-token index): the scanning kernel's results over many steps, for
LRU and the protected LRU, the index's agreement with ``device_buffer_tokens``, its bytes, the input
contract of its extra tables.

The policy-level stateful check (admissions, growth, padding, finishes) runs the indexed kernel too:
tests/kernels/test_hisparse_stateful.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_mla
from sparsekv.jit_kernel.hisparse_index import (
    INDEXED,
    ResidentIndex,
    check_resident_index_on_device,
    indexed_shared_bytes,
    resident_index_bytes,
)
from sparsekv.testing.backends import core_backends, device_of, to_backend
from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step
from sparsekv.testing.profiles import scaled_examples, values_to_draw
from sparsekv.testing.strategies.hisparse import make_world

K, H = 5, 7
MAX_REQS, MAX_LEN = 3, 48
# The protected LRU of the test shape (in both kernels' tables): the last 3 positions and 1 either
# side of a requested token are evicted last.
PROTECT = (3, 1)
POLICIES = pytest.mark.parametrize("policy", ["lru", PROTECT], ids=["lru", "protected"])


def twin_worlds(backend, is_dsv4_layout, seed, policy="lru", **shape):
    """Two identical worlds under ``policy``; the second runs the indexed kernel. ``shape``: K, H,
    block size and sizes other than the module's (``num_top_k``, ``hot``, ``block_size``, ``max_reqs``,
    ``max_len``)."""
    k, h = shape.get("num_top_k", K), shape.get("hot", H)
    scan, indexed = (make_world(k, h, is_dsv4_layout=is_dsv4_layout, max_reqs=shape.get("max_reqs", MAX_REQS),
                                max_len=shape.get("max_len", MAX_LEN), seed=seed, backend=backend)
                     for _ in range(2))
    for w in (scan, indexed):
        w.policy, w.block_size = policy, shape.get("block_size")
        for rid in range(w.max_reqs):
            w.reset_request(rid, resident=rid % 2 == 0)
    indexed.use_resident_index()
    return scan, indexed


def step_both(scan, indexed, top_k, rows, lens, counters):
    """One step on both worlds; everything the two kernels produce or change must be equal. Returns
    the output rows."""
    a = scan.swap_in(top_k, rows, lens, plan=True, counters=counters[0])
    b = indexed.swap_in(top_k, rows, lens, plan=True, counters=counters[1])
    for name in ("out", "miss_count"):
        assert torch.equal(a[name], b[name]), name
    for row, n in enumerate(a["miss_count"].tolist()):
        assert torch.equal(a["miss_src"][row, :n], b["miss_src"][row, :n])
        assert torch.equal(a["miss_dst"][row, :n], b["miss_dst"][row, :n])
    assert torch.equal(scan.device_buffer_tokens, indexed.device_buffer_tokens)
    assert torch.equal(scan.device_buffer, indexed.device_buffer)
    assert torch.equal(counters[0], counters[1])
    for rid in range(scan.max_reqs):
        assert indexed.lru_order(rid) == scan.lru_slots[rid].tolist()
        assert indexed.resident_index.agrees_with(rid, indexed.device_buffer_tokens)
    return a["out"]


# The index's bookkeeping does not depend on the layout (it moves bytes as the scanning kernel does),
# and the DSV4 layout's 584-byte records cost ten to forty times generic rows' (2.7 CPU s an example
# on sim): by default both policies draw generic rows and one pinned LRU run takes the DSV4 layout
# (a protected DSV4 run would be two more modules per backend: cpu, sim, ASan); --slow draws both
# layouts under both policies.
@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@POLICIES
@settings(max_examples=scaled_examples(6), deadline=None)
@given(seed=st.integers(0, 2**16), is_dsv4_layout=st.sampled_from(values_to_draw([False], [True])))
def test_indexed_kernel_matches_the_scanning_kernel_step_after_step(backend, policy, seed, is_dsv4_layout):
    steps_agree(backend, policy, seed, is_dsv4_layout)


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
def test_indexed_kernel_matches_the_scanning_kernel_on_the_dsv4_layout(backend):
    steps_agree(backend, "lru", 4, True)


def steps_agree(backend, policy, seed, is_dsv4_layout):
    """40 steps on a queue of 2H = 14 entries (compaction, head moves and stale entries all happen):
    the two kernels agree after every one (:func:`step_both`)."""
    scan, indexed = twin_worlds(backend, is_dsv4_layout, seed, policy)
    rng = random.Random(seed)
    seq = {0: 6, 1: 12, 2: 30}
    counters = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
    for _ in range(40):
        rows = rng.sample(range(MAX_REQS), rng.randint(1, MAX_REQS))
        for r in rows:
            seq[r] = min(MAX_LEN, seq[r] + rng.randint(0, 2))
        top_k = [[rng.choice([rng.randrange(seq[r]), rng.randrange(min(seq[r], H + 3)), -1, seq[r] - 1, seq[r]])
                  for _ in range(K)] for r in rows]
        step_both(scan, indexed, top_k, rows, [seq[r] for r in rows], counters)


# Several chunks of a 32-thread block per walk (queue 2H = 80 entries), top-k clustered around
# recently asked positions and the newest ones, as decode top-k is: slots within 5 of a requested
# token and the last 10 positions are protected, so walks pass over protected slots, take protected
# ones when too few others remain, and move the passed-over ones up to where they stopped. Both
# kernels also follow the policy model (its own state), which finds "within 5" by bisection where
# the kernels use buckets of 6 positions.
WIDE = dict(num_top_k=8, hot=40, block_size=32, max_reqs=2, max_len=400)
WIDE_PROTECT = (10, 5)


@settings(max_examples=scaled_examples(3), deadline=None)
@given(seed=st.integers(0, 2**16))
def test_the_protected_walk_matches_the_scanning_kernel_over_block_sized_chunks(backend, seed):
    scan, indexed = twin_worlds(backend, False, seed, WIDE_PROTECT, **WIDE)
    models = [HotBuffer.resident_prefix(WIDE["hot"]), HotBuffer.empty(WIDE["hot"])]  # as twin_worlds resets them
    rng = random.Random(seed)
    seq, asked = {0: 41, 1: 60}, {0: [], 1: []}
    counters = [torch.zeros(3, dtype=torch.int64) for _ in range(2)]
    for _ in range(60):
        top_k = []
        for r in (0, 1):
            seq[r] += rng.randint(0, 2)
            n = seq[r]
            row = [rng.choice(asked[r]) + rng.randint(-1, 1) if asked[r] and rng.random() < 0.5 else
                   n - 1 - rng.randint(0, 12) if rng.random() < 0.4 else rng.randrange(n) for _ in range(8)]
            row = [min(max(t, 0), n - 1) for t in row]
            asked[r] = (asked[r] + row)[-30:]
            top_k.append(row)
        out = step_both(scan, indexed, top_k, [0, 1], [seq[0], seq[1]], counters)
        for r in (0, 1):
            step = swap_in_step(models[r], top_k[r], seq[r], protect_recent=WIDE_PROTECT[0],
                                protect_near=WIDE_PROTECT[1])
            assert out[r].tolist() == [int(scan.device_buffer_locs[r, s]) if s >= 0 else -1 for s in step.slots]
            assert scan.device_buffer_tokens[r, :WIDE["hot"]].tolist() == models[r].tokens
            assert scan.lru_slots[r].tolist() == models[r].lru


@pytest.mark.parametrize("policy, head, victims", [("lru", 2, [0, 1]), (PROTECT, 2, [1, 2])],
                         ids=["lru", "protected"])
def test_a_protected_slot_passed_over_moves_up_to_where_the_walk_stopped(backend, policy, head, victims):
    # Slots hold 20, 3, 7, 21, 8, 9, 10 (queue 0..6); 21 (slot 3) hits, 14 and 15 miss, newest 23.
    # LRU takes slots 0 and 1: the head moves past them. PROTECT keeps slot 0 (20: among the last 3
    # positions, next to 21) and takes 1 and 2; slot 0's entry moves from position 0 to 2, the new
    # head, and positions 0 and 1 (stale now) are never read again.
    _, w = twin_worlds(backend, False, 3, policy)
    w.device_buffer_tokens[0, :H] = torch.tensor([20, 3, 7, 21, 8, 9, 10], dtype=torch.int32)
    w.use_resident_index()
    res = w.swap_in([[21, 14, 15, -1, -1]], [0], [24], plan=True)
    assert res["miss_dst"][0, :2].tolist() == [int(w.device_buffer_locs[0, s]) for s in victims]
    index = w.resident_index
    assert index.queue_pos[0, H].item() == head and index.queue_pos[0, H + 1].item() == H + 3
    order = [s for s in range(H) if s not in victims + [3]] + victims + [3]
    assert index.queue[0, head:head + 1].tolist() == order[:1]
    assert index.lru_order(0) == order


@pytest.mark.sanitizer_case
def test_a_step_that_evicts_updates_the_index_in_the_same_launch(backend):
    _, w = twin_worlds(backend, False, 3)
    # Row 0 holds positions 0..6 (LRU 0..6); 20 and 21 miss and take slots 0 and 1 (20 first: top-k order).
    res = w.swap_in([[20, 2, 21, -1, 29]], [0], [30], plan=True)
    index = w.resident_index
    assert int(res["miss_count"][0]) == 2
    slot_of = index.slot_of[0].tolist()
    assert (slot_of[20], slot_of[21], slot_of[0], slot_of[1], slot_of[2]) == (0, 1, -1, -1, 2)
    assert index.lru_order(0) == [3, 4, 5, 6, 0, 1, 2]


@pytest.mark.no_backend("builds the index with torch on the CPU, no kernel")
def test_rebuilding_a_row_inverts_its_tokens_and_restarts_its_queue():
    tokens = torch.full((2, H + 2), -1, dtype=torch.int32)
    tokens[1, :H] = torch.tensor([9, -1, 3, 60, 0, -1, 5], dtype=torch.int32)  # 60: beyond max_len, not indexed
    tokens[1, H] = 7  # the newest entry's column is not a hot slot
    lru = torch.tensor([list(range(H)), [6, 5, 4, 3, 2, 1, 0]], dtype=torch.int16)
    index = ResidentIndex.build(tokens, lru, max_len=48)
    assert {t: s for t, s in enumerate(index.slot_of[1].tolist()) if s >= 0} == {9: 0, 3: 2, 0: 4, 5: 6}
    assert index.slot_of[0].eq(-1).all()
    assert index.lru_order(1) == [6, 5, 4, 3, 2, 1, 0]
    assert index.agrees_with(1, tokens)
    index.slot_of[1, 9] = 1
    assert not index.agrees_with(1, tokens)


@pytest.mark.no_backend("table sizes, no kernel")
def test_index_bytes_per_request_and_layer_are_the_tables_bytes():
    max_len, hot = 48, H
    index = ResidentIndex.empty(MAX_REQS, max_len, hot)
    per_row = sum(t[0].numel() * t.element_size() for t in (index.slot_of, index.queue, index.queue_pos))
    assert resident_index_bytes(max_len, hot) == per_row == 2 * max_len + 8 * hot + 8


@pytest.mark.no_backend("template arguments, nothing compiles")
def test_the_scratch_does_not_grow_with_the_hot_buffer():
    small = INDEXED.template_args({"num_top_k": 512, "hot_buffer_size": 1024, "layout": "generic"})
    large = INDEXED.template_args({"num_top_k": 512, "hot_buffer_size": 16384, "layout": "generic"})
    assert small[2] == large[2] == 512
    assert indexed_shared_bytes(512, 512) < 48 * 1024  # no opt-in to large shared memory at K = 512


def _call(w, index, **overrides):
    args = w.call_args([[20, 2, 21, -1, 29]], [0], [30])
    tables = dict(slot_of=index.slot_of, queue=index.queue, queue_pos=index.queue_pos)
    tables.update({k: v for k, v in overrides.items() if k in tables})
    args.update({k: v for k, v in overrides.items() if k not in tables})
    return args, tables


BAD_TABLES = [
    (lambda i: dict(slot_of=i.slot_of.to(torch.int32)), TypeError, "slot_of"),
    (lambda i: dict(slot_of=i.slot_of[:, :-1]), ValueError, "slot_of"),
    (lambda i: dict(queue=i.queue[:, :H]), ValueError, "queue"),
    (lambda i: dict(queue_pos=i.queue_pos.to(torch.int16)), TypeError, "queue_pos"),
    (lambda i: dict(queue_pos=i.queue_pos[:2]), ValueError, "queue_pos"),
    (lambda i: dict(queue=i.slot_of[:, : 2 * H]), ValueError, "slot_of"),  # shares memory with slot_of
]


@pytest.mark.parametrize("mutate, exc, name", BAD_TABLES)
def test_bad_index_tables_raise_naming_the_argument_and_write_nothing(backend, mutate, exc, name):
    _, w = twin_worlds(backend, False, 0)
    args, tables = _call(w, w.resident_index, **mutate(w.resident_index))
    args, tables = to_backend(backend, args), to_backend(backend, tables)
    before = [t.cpu().clone() for t in (args["device_buffer_tokens"], args["device_buffer"], *tables.values())]
    with pytest.raises(exc, match=f"`{name}`"):
        load_cache_to_device_buffer_mla(**args, resident_index=ResidentIndex(**tables))
    after = [t.cpu() for t in (args["device_buffer_tokens"], args["device_buffer"], *tables.values())]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_resident_index_of_the_wrong_type_is_rejected(backend):
    _, w = twin_worlds(backend, False, 0)
    args, tables = _call(w, w.resident_index)
    with pytest.raises(TypeError, match="`resident_index`"):
        load_cache_to_device_buffer_mla(**to_backend(backend, args), resident_index=tables)


@pytest.mark.parametrize("corrupt, message", [
    (lambda i: i.slot_of[0].__setitem__(3, 5), "disagrees with `device_buffer_tokens`"),
    (lambda i: i.slot_of[0].__setitem__(3, -1), "indexes 6 tokens"),
    (lambda i: i.queue_pos[0].__setitem__(2, 9), "not a live queue entry of slot 2"),
    (lambda i: i.queue_pos[0].__setitem__(H + 1, 2 * H + 1), "head 0 and tail 15"),
])
def test_check_indices_mode_rejects_an_index_out_of_step_with_the_tables(backend, monkeypatch, corrupt, message):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    _, w = twin_worlds(backend, False, 0)
    corrupt(w.resident_index)
    args, tables = _call(w, w.resident_index)
    before = w.device_buffer_tokens.clone()
    with pytest.raises(ValueError, match=message) as raised:
        load_cache_to_device_buffer_mla(**to_backend(backend, args),
                                        resident_index=ResidentIndex(**to_backend(backend, tables)))
    assert torch.equal(w.device_buffer_tokens, before)
    # The device check of the CUDA path, on request row 0 (the slow-path row), in the host entry's words.
    device = to_backend(backend, [tables, w.device_buffer_tokens])
    with pytest.raises(ValueError) as checked:
        check_resident_index_on_device(ResidentIndex(**device[0]), torch.tensor([0], device=device_of(backend)),
                                       device[1])
    assert str(checked.value) == str(raised.value)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_rows_of_one_request_are_refused_or_served_in_batch_order_as_by_the_scanning_kernel(backend, speculative):
    # MTP-style: three rows of request 0 (the plain entry refuses them on host tables), one of request 1.
    scan, indexed = twin_worlds(backend, False, 5)
    top_k = [[20, 2, 21, -1, 29], [22, 20, 3, 4, 30], [23, 24, 25, 26, 31], [1, 9, 10, 11, 12]]
    rows, lens = [0, 0, 0, 1], [30, 31, 32, 14]
    if not speculative and device_of(backend).type == "cpu":  # host tables (cpu and sim builds)
        for w in (scan, indexed):
            with pytest.raises(ValueError, match="`req_pool_indices` names request row 0 twice"):
                w.swap_in(top_k, rows, lens, plan=True)
        return
    a = scan.swap_in(top_k, rows, lens, plan=True, speculative=speculative)
    b = indexed.swap_in(top_k, rows, lens, plan=True, speculative=speculative)
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["miss_count"], b["miss_count"])
    assert torch.equal(scan.device_buffer_tokens, indexed.device_buffer_tokens)
    assert torch.equal(scan.device_buffer, indexed.device_buffer)
    for rid in range(MAX_REQS):
        assert indexed.lru_order(rid) == scan.lru_slots[rid].tolist()
        assert indexed.resident_index.agrees_with(rid, indexed.device_buffer_tokens)

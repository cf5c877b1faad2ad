"""HiSparse swap-in and miss-plan replay: hand-computed cases, the reference, open instances, and
the input contract (bad input, aliasing, duplicate destinations, index checks). Every test runs on
each kernel backend (tests/kernels/conftest.py); on a GPU the cuda build is also compared with the
cpu build of the same call.

The long-running policy check (many steps, many requests) is tests/kernels/test_hisparse_stateful.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel import hisparse
from sparsekv.jit_kernel.build.loader import csrc_root
from sparsekv.jit_kernel.build.toolchain import host_compiler
from sparsekv.jit_kernel.hisparse import (
    PLANNED,
    SHARED_MEMORY_LIMIT,
    SWAP_IN,
    SWAP_IN_POLICIES,
    check_plan_on_device,
    check_swap_in_on_device,
    copy_cache_planned_mla,
    default_block_size,
    load_cache_to_device_buffer_mla,
    swap_in_shared_bytes,
)
from sparsekv.jit_kernel.hisparse_index import indexed_shared_bytes
from sparsekv.testing.backends import core_backends, cpu_backend, device_of, host_readable, run_on_backend, to_backend
from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step
from sparsekv.testing.hisparse_traces import PROTECT_NEAR, PROTECT_RECENT
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.reference.hisparse import copy_cache_planned_reference
from sparsekv.testing.strategies.hisparse import make_world, random_bytes, top_k_row

K, H = 5, 7


def world(backend, is_dsv4_layout=False, seed=0, max_reqs=3, max_len=40):
    return make_world(K, H, is_dsv4_layout=is_dsv4_layout, max_reqs=max_reqs, max_len=max_len, seed=seed,
                      backend=backend)


def hold(w, rid, tokens):
    """Set request ``rid``'s hot slots to hold ``tokens`` and put their host bytes in the device slots."""
    w.device_buffer_tokens[rid, :H] = torch.tensor(tokens, dtype=torch.int32)
    for slot, tok in enumerate(tokens):
        if tok >= 0:
            w.place(rid, slot, tok)


def locs(w, rid, slots):
    return [int(w.device_buffer_locs[rid, s]) if s >= 0 else -1 for s in slots]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_fast_path_maps_position_to_slot_and_changes_nothing(backend, index_dtype):
    w = world(backend)
    w.reset_request(1, resident=True)
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    # seq_len 4 <= H: entries 0..3 are used; -1 and 4 (>= seq_len) are "no token"; entry 4 is past min(seq_len, K).
    res = w.swap_in([[3, -1, 2, 4, 0]], [1], [4], plan=True, index_dtype=index_dtype)
    assert res["out"].tolist() == [locs(w, 1, [3, -1, 2, -1, -1])]
    assert res["miss_count"].tolist() == [0]
    for now, then in zip((w.device_buffer_tokens, w.lru_slots, w.device_buffer), before):
        assert torch.equal(now, then)


@pytest.mark.sanitizer_case
def test_hits_newest_and_lru_then_misses_take_lru_slots(backend):
    w = world(backend)
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    # Step 1: 7 and 5 hit, 19 is the newest (reserved column H), -1 and 25 (>= seq_len) are no token.
    res = w.swap_in([[7, 19, 5, -1, 25]], [0], [20], plan=True)
    assert res["out"].tolist() == [locs(w, 0, [2, H, 5, -1, -1])]
    assert w.lru_slots[0].tolist() == [0, 1, 3, 4, 6, 2, 5]
    assert res["miss_count"].tolist() == [0]
    # Step 2: 3 hits (slot 1); 8, 9, 13 miss and take the LRU non-hit slots 0, 3, 4; 8 repeats.
    res = w.swap_in([[8, 3, 9, 8, 13]], [0], [20], plan=True)
    assert res["out"].tolist() == [locs(w, 0, [0, 1, 3, 0, 4])]
    assert w.device_buffer_tokens[0, :H].tolist() == [8, 3, 7, 9, 13, 5, 1]
    assert w.lru_slots[0].tolist() == [6, 2, 5, 0, 3, 4, 1]
    assert res["miss_count"].tolist() == [3]
    host = [int(w.host_cache_locs[0, t]) for t in (8, 9, 13)]
    assert res["miss_src"][0, :3].tolist() == host
    assert res["miss_dst"][0, :3].tolist() == locs(w, 0, [0, 3, 4])
    for tok, slot in ((8, 0), (9, 3), (13, 4)):
        assert torch.equal(w.device_token(locs(w, 0, [slot])[0]), w.host_token(0, tok))


def test_padding_rows_get_minus_one_and_leave_tables_alone(backend):
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.reset_request(1, resident=True)
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone())
    # Row 2 is padding although it names request 1 with a long sequence and cold tokens.
    res = w.swap_in([[1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [30, 31, 32, 33, 34]], [0, 2, 1], [3, 2, 38],
                    num_real_reqs=2, plan=True)
    assert res["out"][2].tolist() == [-1] * K
    assert res["miss_count"].tolist() == [0, 0, 0]
    assert torch.equal(w.device_buffer_tokens[1], before[0][1])
    assert torch.equal(w.lru_slots[1], before[1][1])


def test_all_invalid_entries_on_the_slow_path_load_nothing(backend):
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    res = w.swap_in([[-1, -5, 30, 31, 2**31 - 1]], [0], [30], plan=True)
    assert res["out"].tolist() == [[-1] * K]
    assert res["miss_count"].tolist() == [0]
    assert torch.equal(w.device_buffer_tokens, before[0]) and torch.equal(w.device_buffer, before[2])
    # No hit either: every slot is a non-hit, so the LRU order is unchanged.
    assert torch.equal(w.lru_slots, before[1])


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@pytest.mark.parametrize("is_dsv4_layout", [False, True], ids=["generic", "dsv4"])
def test_kernel_matches_reference_on_a_mixed_batch(backend, is_dsv4_layout):
    w = world(backend, is_dsv4_layout, seed=3, max_reqs=4)
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    w.reset_request(2, resident=True)
    hold(w, 3, [-1] * H)
    args = ([[7, 19, 9, 11, 3], [1, 0, 2, 6, 5], [30, 2, 31, 32, 33], [0, 1, 2, 3, 4]], [0, 2, 3, 1], [20, 7, 34, 9])
    expected = w.reference(*args, num_real_reqs=3)
    res = w.swap_in(*args, num_real_reqs=3, plan=True)
    assert torch.equal(res["out"], expected.top_k_device_locs)
    assert torch.equal(w.device_buffer_tokens, expected.device_buffer_tokens)
    assert torch.equal(w.lru_slots, expected.lru_slots)
    assert torch.equal(w.device_buffer, expected.device_buffer)
    assert torch.equal(res["miss_count"], expected.miss_count)
    for b, pairs in enumerate(expected.plan):
        assert list(zip(res["miss_src"][b].tolist(), res["miss_dst"][b].tolist()))[: len(pairs)] == pairs


def test_dsv4_miss_reads_and_writes_paged_addresses(backend):
    # A miss from host slot 65 (page 1, offset 1) into device slot 76 (page 1, offset 12): the value and
    # scale records sit 36,864 bytes apart in the page row; nothing else in either page changes.
    w = world(backend, True)
    w.host_cache_locs[0, 3] = 65
    w.device_buffer_locs[0, :H + 1] = torch.arange(76, 76 + H + 1, dtype=torch.int32)
    device_before = w.device_buffer.clone()
    res = w.swap_in([[3, -1, -1, -1, -1]], [0], [8], plan=True)
    assert res["out"].tolist() == [[76, -1, -1, -1, -1]]
    page = w.device_buffer[1]
    host_page = w.host_cache[1]
    assert torch.equal(page[12 * 576 : 13 * 576], host_page[576 : 2 * 576])
    assert torch.equal(page[36864 + 12 * 8 : 36864 + 13 * 8], host_page[36864 + 8 : 36864 + 16])
    changed = (w.device_buffer != device_before).nonzero()[:, 1].unique()
    allowed = set(range(12 * 576, 13 * 576)) | set(range(36864 + 96, 36864 + 104))
    assert set(changed.tolist()) <= allowed
    assert bool((w.device_buffer[[0, *range(2, w.device_buffer.shape[0])]] ==
                 device_before[[0, *range(2, w.device_buffer.shape[0])]]).all())


@pytest.mark.parametrize("is_dsv4_layout", [False, True], ids=["generic", "dsv4"])
@pytest.mark.parametrize("miss_dst_dtype", [torch.int64, torch.int32], ids=str)
def test_replaying_the_plan_into_a_second_layer_moves_the_same_tokens(backend, is_dsv4_layout, miss_dst_dtype):
    w = world(backend, is_dsv4_layout, seed=5)
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    w.reset_request(1, resident=False)
    host2 = random_bytes(tuple(w.host_cache.shape), 99)
    device2 = random_bytes(tuple(w.device_buffer.shape), 98)
    device2_before = device2.clone()
    res = w.swap_in([[8, 3, 9, 8, 13], [30, 31, 2, 33, 34], [1, 2, 3, 4, 5]], [0, 1, 2], [20, 36, 38],
                    num_real_reqs=2, plan=True, miss_dst_dtype=miss_dst_dtype)
    # Row 2 is padding: a plan row with garbage in it must be ignored by the replay as well.
    res["miss_count"][2] = K
    res["miss_src"][2] = 0
    res["miss_dst"][2] = 0
    run_on_backend(backend, copy_cache_planned_mla,
                   dict(miss_src=res["miss_src"], miss_dst=res["miss_dst"], miss_count=res["miss_count"],
                        num_real_reqs=torch.tensor([2], dtype=torch.int32), host_cache=host2, device_buffer=device2),
                   item_size_bytes=w.item_size_bytes, is_dsv4_layout=is_dsv4_layout)
    plan = [list(zip(res["miss_src"][b, : res["miss_count"][b]].tolist(),
                     res["miss_dst"][b, : res["miss_count"][b]].tolist())) for b in range(2)]
    assert sum(len(p) for p in plan) == 3 + 5
    assert torch.equal(device2, copy_cache_planned_reference(plan, host2, device2_before, page_slots=w.page_slots))
    for b, rid in enumerate([0, 1]):
        for i, tok in enumerate([[8, 3, 9, 8, 13], [30, 31, 2, 33, 34]][b]):
            if (rid, tok) in ((0, 3),):
                continue  # a hit: layer 2's slot was never filled in this test
            assert torch.equal(w.device_token(int(res["out"][b, i]), device2), w.host_token(rid, tok, host2))


def test_counters_accumulate_hits_misses_and_bytes(backend):
    w = world(backend)
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    w.reset_request(1, resident=True)
    counters = torch.zeros(3, dtype=torch.int64)
    w.swap_in([[8, 3, 9, 8, 13], [0, 1, 2, -1, 9]], [0, 1], [20, 4], counters=counters)
    # Row 0: one hit entry (3), three loads (8 repeats); row 1 (fast path): three valid entries.
    assert counters.tolist() == [1 + 3, 3, 3 * w.item_size_bytes]
    w.swap_in([[8, 3, 9, 8, 19]], [0], [20], counters=counters)
    assert counters.tolist() == [4 + 5, 3, 3 * w.item_size_bytes]


def test_without_checks_a_bad_host_loc_is_skipped_not_followed(backend, monkeypatch):
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.host_cache_locs[0, 20] = -1
    w.host_cache_locs[0, 21] = 10**12
    before = w.device_buffer.clone()
    res = w.swap_in([[20, 21, -1, -1, -1]], [0], [30], plan=True)
    # The slots are still assigned (the policy does not depend on bytes), no byte moves.
    assert res["miss_count"].tolist() == [2]
    assert res["miss_src"][0, :2].tolist() == [-1, 10**12]
    assert torch.equal(w.device_buffer, before)


@pytest.mark.parametrize("mutate, exc, name", [
    (lambda w: w.host_cache_locs.__setitem__((0, 20), -1), IndexError, "host_cache_locs"),
    (lambda w: w.host_cache_locs.__setitem__((0, 20), 10**6), IndexError, "host_cache_locs"),
    (lambda w: w.lru_slots.__setitem__((0, 3), 0), ValueError, "lru_slots"),
    (lambda w: w.lru_slots.__setitem__((0, 3), 7), ValueError, "lru_slots"),
    (lambda w: w.device_buffer_locs.__setitem__((0, H), -2), IndexError, "device_buffer_locs"),
    (lambda w: w.device_buffer_locs.__setitem__((0, 2), 10**6), IndexError, "device_buffer_locs"),
])
def test_check_indices_mode_rejects_a_bad_index_before_writing(backend, monkeypatch, mutate, exc, name):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    mutate(w)
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    with pytest.raises(exc, match=f"`{name}`"):
        w.swap_in([[20, 2, 21, -1, 29]], [0], [30], plan=True)
    for now, then in zip((w.device_buffer_tokens, w.lru_slots, w.device_buffer), before):
        assert torch.equal(now, then)


def test_check_indices_mode_accepts_a_valid_call(backend, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.host_cache_locs[0, 2] = -1  # a hit: its host slot is never read
    w.host_cache_locs[0, 29] = -1  # the newest token: never read either
    res = w.swap_in([[20, 2, 21, -1, 29]], [0], [30], plan=True)
    assert res["miss_count"].tolist() == [2]


def _call_args(w, **overrides):
    return w.call_args([[20, 2, 21, -1, 29]], [0], [30], **overrides)


def _sharing(offset, device="cpu"):
    """``top_k_tokens`` and a ``top_k_device_locs`` starting ``offset`` entries into it, in one buffer."""
    buffer = torch.tensor([20, 2, 21, -1, 29] * 2, dtype=torch.int32, device=device)
    return dict(top_k_tokens=buffer[:K].view(1, K), top_k_device_locs=buffer[offset : offset + K].view(1, K))


def _written(args):
    return [args[k].cpu().clone() for k in ("device_buffer_tokens", "lru_slots", "device_buffer", "top_k_device_locs")]


BAD_INPUTS = [
    (lambda w: dict(top_k_tokens=torch.zeros(1, K, dtype=torch.int64)), TypeError, "top_k_tokens"),
    (lambda w: dict(top_k_tokens=torch.zeros(1, K + 1, dtype=torch.int32)), ValueError, "top_k_tokens"),
    (lambda w: dict(top_k_device_locs=torch.zeros(2, K, dtype=torch.int32)), ValueError, "top_k_device_locs"),
    # The output aliasing the top-k: the kernel would re-read top-k entries it had overwritten.
    (lambda w: _sharing(0), ValueError, "top_k_device_locs"),
    (lambda w: _sharing(K - 1), ValueError, "top_k_device_locs"),
    (lambda w: dict(device_buffer_tokens=w.device_buffer_tokens[:, :H]), ValueError, "device_buffer_tokens"),
    (lambda w: dict(device_buffer_locs=w.device_buffer_locs.to(torch.int64)), TypeError, "device_buffer_locs"),
    (lambda w: dict(device_buffer_locs=torch.zeros(w.max_reqs, H + 2, 2, dtype=torch.int32)[..., 0]),
     ValueError, "device_buffer_locs"),
    (lambda w: dict(host_cache_locs=w.host_cache_locs.t().contiguous().t()), ValueError, "host_cache_locs"),
    (lambda w: dict(host_cache_locs=w.host_cache_locs.to(torch.int32)), TypeError, "host_cache_locs"),
    (lambda w: dict(lru_slots=w.lru_slots.to(torch.int32)), TypeError, "lru_slots"),
    (lambda w: dict(lru_slots=w.lru_slots[:2]), ValueError, "lru_slots"),
    (lambda w: dict(req_pool_indices=torch.tensor([0], dtype=torch.int16)), TypeError, "req_pool_indices"),
    (lambda w: dict(seq_lens=torch.tensor([30.0])), TypeError, "seq_lens"),
    (lambda w: dict(seq_lens=torch.tensor([30, 30], dtype=torch.int32)), ValueError, "seq_lens"),
    (lambda w: dict(host_cache=w.host_cache[:, :-1]), ValueError, "host_cache"),
    (lambda w: dict(device_buffer=w.device_buffer.view(torch.int8)), TypeError, "device_buffer"),
    (lambda w: dict(item_size_bytes=w.item_size_bytes + 1), ValueError, "host_cache"),
    (lambda w: dict(num_real_reqs=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "num_real_reqs"),
    (lambda w: dict(miss_src=torch.zeros(1, K - 1, dtype=torch.int64), miss_dst=torch.zeros(1, K, dtype=torch.int64),
                    miss_count=torch.zeros(1, dtype=torch.int32)), ValueError, "miss_src"),
    (lambda w: dict(miss_src=torch.zeros(1, K, dtype=torch.int64), miss_dst=torch.zeros(1, K, dtype=torch.int16),
                    miss_count=torch.zeros(1, dtype=torch.int32)), TypeError, "miss_dst"),
    (lambda w: dict(miss_src=torch.zeros(1, K, dtype=torch.int64)), ValueError, "miss_count"),
    (lambda w: dict(counters=torch.zeros(2, dtype=torch.int64)), ValueError, "counters"),
    (lambda w: dict(hot_buffer_size=4), ValueError, "hot_buffer_size"),
    (lambda w: dict(num_top_k=0), ValueError, "num_top_k"),
]


@pytest.mark.parametrize("mutate, exc, name", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(backend, mutate, exc, name):
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = to_backend(backend, _call_args(w))
    args.update(to_backend(backend, mutate(w)))
    before = _written(args)
    with pytest.raises(exc, match=f"`{name}`"):
        load_cache_to_device_buffer_mla(**args)
    assert all(torch.equal(a, b) for a, b in zip(_written(args), before))


# Each: overrides that alias two arguments, named in the order the entry lists them; the kernel
# writes one of the two while it reads (or writes) the other.
ALIASED = [
    (lambda a: {"miss_dst": a["top_k_tokens"]}, "top_k_tokens", "miss_dst"),
    (lambda a: {"device_buffer_locs": a["device_buffer_tokens"]}, "device_buffer_tokens", "device_buffer_locs"),
    (lambda a: {"host_cache": a["device_buffer"]}, "host_cache", "device_buffer"),
    (lambda a: {"host_cache": a["device_buffer"][1:]}, "host_cache", "device_buffer"),
    (lambda a: {"miss_src": a["host_cache_locs"][:1]}, "host_cache_locs", "miss_src"),
    (lambda a: {"counters": a["host_cache_locs"][0, :3]}, "host_cache_locs", "counters"),
    (lambda a: {"miss_count": a["top_k_device_locs"][0, :1]}, "top_k_device_locs", "miss_count"),
]


@pytest.mark.parametrize("alias, first, second", ALIASED, ids=[f"{f}-{s}" for _, f, s in ALIASED])
def test_arguments_that_share_memory_with_a_written_one_are_rejected(backend, alias, first, second):
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = to_backend(backend, _call_args(w, miss_src=torch.zeros(1, K, dtype=torch.int64),
                                          miss_dst=torch.zeros(1, K, dtype=torch.int32),
                                          miss_count=torch.zeros(1, dtype=torch.int32),
                                          counters=torch.zeros(3, dtype=torch.int64)))
    args.update(alias(args))
    before = _written(args)
    with pytest.raises(ValueError, match=f"`{first}` and `{second}` must not share memory"):
        load_cache_to_device_buffer_mla(**args)
    assert all(torch.equal(a, b) for a, b in zip(_written(args), before))


@pytest.mark.parametrize("name, dtype", [("num_real_reqs", torch.int32), ("miss_count", torch.int32),
                                         ("counters", torch.int64)])
def test_a_0_dim_tensor_for_an_optional_argument_is_rejected(backend, name, dtype):
    # It used to mean "omitted": a real 0-dim num_real_reqs ran the padding rows, a 0-dim miss_count
    # dropped the plan.
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    extra = {name: torch.tensor(1, dtype=dtype)}
    if name == "miss_count":
        extra.update(miss_src=torch.zeros(1, K, dtype=torch.int64), miss_dst=torch.zeros(1, K, dtype=torch.int64))
    args = to_backend(backend, _call_args(w, **extra))
    before = _written(args)
    with pytest.raises(ValueError, match=f"`{name}` is a 0-dim tensor; pass None"):
        load_cache_to_device_buffer_mla(**args)
    assert all(torch.equal(a, b) for a, b in zip(_written(args), before))


def test_top_k_and_output_may_be_adjacent_views_of_one_buffer(backend):
    separate, shared = world(backend), world(backend)
    for w in (separate, shared):
        hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = to_backend(backend, _call_args(separate))
    load_cache_to_device_buffer_mla(**args)
    views = _sharing(K, device_of(backend))
    shared_args = to_backend(backend, _call_args(shared))
    shared_args.update(views)
    load_cache_to_device_buffer_mla(**shared_args)
    assert torch.equal(views["top_k_device_locs"], args["top_k_device_locs"])
    assert views["top_k_tokens"].tolist() == args["top_k_tokens"].tolist()
    assert torch.equal(shared_args["device_buffer"], args["device_buffer"])


@pytest.mark.no_backend("a compile-time check of the header under the host compiler")
def test_a_swap_in_instance_too_large_for_shared_memory_fails_to_compile(tmp_path):
    root = csrc_root()

    def compile_instance(k, h):
        source = tmp_path / f"swap_in_{k}_{h}.cpp"
        source.write_text('#include "hisparse.cuh"\n'
                          f"static_assert(sizeof(sparsekv::hisparse::SwapIn<{k}, {h}, 1024, "
                          "sparsekv::hisparse::LinearRows>) > 0);\n")
        cmd = [host_compiler(None).path, "-std=c++17", "-fsyntax-only", f"-I{root}", f"-I{root / 'include'}",
               str(source)]
        return subprocess.run(cmd, capture_output=True, text=True)

    largest = max((v["num_top_k"], v["hot_buffer_size"]) for v in SWAP_IN.instances)
    assert compile_instance(*largest).returncode == 0
    # A 32,768-entry hash table alone is 320 KiB.
    result = compile_instance(16384, 16384)
    assert result.returncode != 0 and "exceeds the 227 KiB of shared memory" in result.stderr


def test_dsv4_rejects_a_non_page_row_cache_and_a_wrong_item_size(backend):
    w = world(backend, True)
    from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_dsv4_mla

    with pytest.raises(ValueError, match="`device_buffer`"):
        load_cache_to_device_buffer_dsv4_mla(**to_backend(backend,
                                                          _call_args(w, device_buffer=w.device_buffer[:, :584])))
    with pytest.raises(ValueError, match="`item_size_bytes`"):
        load_cache_to_device_buffer_dsv4_mla(**to_backend(backend, _call_args(w, item_size_bytes=576)))


@pytest.mark.no_backend("compares two instance tables")
def test_every_table_layout_has_a_plan_replay_instance():
    def layout(values):
        return values["layout"], values.get("page_slots")

    assert {layout(v) for v in SWAP_IN.instances} <= {layout(v) for v in PLANNED.instances}


# -- the device index check (the CUDA path with SPARSEKV_CHECK_INDICES=1) ---------------------------
def _hold_two(w):
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.reset_request(1, resident=True)


# (change to the world, overrides of the call): each a call the host entry refuses.
DEVICE_CHECKED = {
    "request out of range": (None, dict(req_pool_indices=torch.tensor([3], dtype=torch.int32))),
    "request twice": (None, dict(top_k_tokens=torch.tensor([[20, 2, 21, -1, 19], [20, 2, 22, -1, 20]],
                                                           dtype=torch.int32),
                                 top_k_device_locs=torch.full((2, K), 7, dtype=torch.int32),
                                 req_pool_indices=torch.tensor([0, 0], dtype=torch.int64),
                                 seq_lens=torch.tensor([20, 21], dtype=torch.int64))),
    "num_real_reqs above the batch": (None, dict(num_real_reqs=torch.tensor([2], dtype=torch.int32))),
    "fast-path slot": (lambda w: w.device_buffer_locs.__setitem__((1, 2), -5),
                       dict(req_pool_indices=torch.tensor([1], dtype=torch.int32),
                            seq_lens=torch.tensor([4], dtype=torch.int32),
                            top_k_tokens=torch.tensor([[3, -1, 2, 4, 0]], dtype=torch.int32))),
    "seq_len past host_cache_locs": (None, dict(seq_lens=torch.tensor([41], dtype=torch.int32))),
    "lru repeat": (lambda w: w.lru_slots.__setitem__((0, 3), 0), {}),
    "lru out of range": (lambda w: w.lru_slots.__setitem__((0, 3), 7), {}),
    "hot slot negative": (lambda w: w.device_buffer_locs.__setitem__((0, H), -2), {}),
    "hot slot too large": (lambda w: w.device_buffer_locs.__setitem__((0, 2), 10**6), {}),
    "host slot negative": (lambda w: w.host_cache_locs.__setitem__((0, 20), -1), {}),
    "host slot too large": (lambda w: w.host_cache_locs.__setitem__((0, 21), 10**6), {}),
    "device slot twice": (lambda w: w.device_buffer_locs.__setitem__((1, 3), int(w.device_buffer_locs[0, 5])),
                          dict(top_k_tokens=torch.tensor([[20, 2, 21, -1, 29], [30, 31, 32, 33, 34]],
                                                         dtype=torch.int32),
                               top_k_device_locs=torch.full((2, K), 7, dtype=torch.int32),
                               req_pool_indices=torch.tensor([0, 1], dtype=torch.int32),
                               seq_lens=torch.tensor([30, 36], dtype=torch.int32))),
}


def _check_on_device(backend, a, speculative=False):
    """``check_swap_in_on_device`` on ``backend``'s device for the wrapper arguments ``a``."""
    d = to_backend(backend, a)
    check_swap_in_on_device(d["top_k_tokens"], d["device_buffer_tokens"], d["host_cache_locs"],
                            d["device_buffer_locs"], d["req_pool_indices"], d["seq_lens"], d["lru_slots"],
                            d.get("num_real_reqs"), d["host_cache"], d["device_buffer"], hot_buffer_size=H,
                            speculative=speculative)


@pytest.mark.parametrize("change, overrides", DEVICE_CHECKED.values(), ids=DEVICE_CHECKED.keys())
def test_the_device_index_check_refuses_what_the_host_entry_refuses_in_its_words(backend, monkeypatch, change,
                                                                                 overrides):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    w = world("cpu")
    _hold_two(w)
    if change is not None:
        change(w)
    a = _call_args(w, **overrides)
    with pytest.raises((IndexError, ValueError)) as host:
        load_cache_to_device_buffer_mla(**a)  # host tables: the C++ entry's own check
    with pytest.raises(host.type) as device:
        _check_on_device(backend, a)
    assert str(device.value) == str(host.value)
    # The op's CUDA path on this backend's tables: they fit the device check, which refuses before the
    # launch (the entry, told to run, would skip the bad entries), in those words, writing nothing.
    monkeypatch.setattr(hisparse, "index_checks_on_device", lambda tensor: True)
    d = to_backend(backend, a)
    before = _written(d)
    with pytest.raises(host.type) as op:
        load_cache_to_device_buffer_mla(**d)
    assert str(op.value) == str(host.value)
    assert all(torch.equal(x, y) for x, y in zip(_written(d), before))


def test_the_device_index_check_accepts_valid_calls(backend, monkeypatch):
    w = world("cpu")
    _hold_two(w)
    w.host_cache_locs[0, 2] = -1  # a hit and the newest token: their host slots are never read
    w.host_cache_locs[0, 29] = -1
    _check_on_device(backend, _call_args(w))
    _check_on_device(backend, _call_args(w, **DEVICE_CHECKED["request twice"][1]), speculative=True)
    # The op's CUDA path on this backend's tables (of a copy of the world) writes what the unchecked call writes.
    unchecked, checked = to_backend(backend, _call_args(w)), to_backend(backend, _call_args(_copy_world(w)))
    load_cache_to_device_buffer_mla(**unchecked)
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    monkeypatch.setattr(hisparse, "index_checks_on_device", lambda tensor: True)
    load_cache_to_device_buffer_mla(**checked)
    assert (checked["top_k_device_locs"] != 7).all()
    assert all(torch.equal(x, y) for x, y in zip(_written(checked), _written(unchecked)))


# -- open instantiation ---------------------------------------------------------------------------
# (K, H, layout, page slots), none of them in the SWAP_IN table: each compiles at first use (three
# times in CI: cpu, ASan, sim). The smallest (H = K) and an odd H on the DSV4 layout run by default;
# --slow adds H = 3 K and K = the block size.
OPEN_INSTANCES = [(4, 4, "generic", None), pytest.param(16, 48, "generic", None, marks=pytest.mark.slow),
                  pytest.param(64, 128, "generic", None, marks=pytest.mark.slow), (12, 70, "dsv4", 64)]


def _in_table(k, h, layout):
    return any((v["num_top_k"], v["hot_buffer_size"], v["layout"]) == (k, h, layout) for v in SWAP_IN.instances)


@pytest.mark.parametrize("k, h, layout, page_slots", OPEN_INSTANCES,
                         ids=["K4-H4-generic", "K16-H48-generic", "K64-H128-generic", "K12-H70-dsv4"])
def test_any_valid_instance_compiles_and_follows_the_policy_model(backend, k, h, layout, page_slots):
    assert not _in_table(k, h, layout)
    _follow_the_policy_model(backend, k, h, layout, page_slots, steps=4, hit_share=1 / 3)


# The serving instances on the DSV4 layout: DSV4-Flash (top-k 512), DSV4-Pro (1024) and a 2048 top-k,
# each with a hot buffer of twice its top-k. A few steps each, at a serving-like share of hits. By
# default K = 512 (one entry per thread of a 512-thread block) and K = 2048 (two per thread of the
# largest, 1024-thread block); --slow adds K = 1024 (one per thread of a 1024-thread block).
SERVING_INSTANCES = [(512, 1024), pytest.param(1024, 2048, marks=pytest.mark.slow), (2048, 4096)]


@pytest.mark.parametrize("k, h", SERVING_INSTANCES, ids=["K512-H1024", "K1024-H2048", "K2048-H4096"])
def test_serving_instances_follow_the_policy_model(backend, k, h):
    misses = _follow_the_policy_model(backend, k, h, "dsv4", 64, steps=3, hit_share=0.75)
    # Row 0 (longer than H) loads some of each step's entries and serves the rest from its slots;
    # row 1 starts empty, so its first step loads every entry it asks for.
    assert all(0 < m[0] < k for m in misses), misses
    assert misses[0][1] > misses[-1][1] > 0, misses


def _follow_the_policy_model(backend, k, h, layout, page_slots, *, steps: int, hit_share: float) -> list[list[int]]:
    """Run ``steps`` decode steps of two requests (one twice the hot buffer with a resident prefix,
    one starting empty) against the policy model; each step's top-k asks for held tokens
    about ``hit_share`` of the time. Returns the kernel's miss counts per step and row."""
    max_len = 3 * h + 8
    w = make_world(k, h, is_dsv4_layout=layout == "dsv4", max_reqs=2, max_len=max_len, seed=k + h,
                   page_slots=page_slots or 64, backend=backend)
    gen = torch.Generator().manual_seed(h)
    w.reset_request(0, resident=True)
    models = {0: HotBuffer.resident_prefix(h), 1: HotBuffer.empty(h)}
    seq = {0: 2 * h + 1, 1: 2 * h}  # row 0: positions h .. 2h - 1 only in the host cache
    for rid, n in seq.items():  # the model writes every resident token and the newest one
        for pos in range(min(n, h) if rid == 0 else 0):
            w.place(rid, pos, pos)
        w.place(rid, h, n - 1)
    misses = []
    for _ in range(steps):
        rids = [0, 1]
        top_k = []
        for rid in rids:
            n = seq[rid]
            held = [t for t in models[rid].tokens if t >= 0]
            row = torch.randint(0, n, (k,), generator=gen).tolist()
            asks_held = torch.rand(k, generator=gen) < hit_share
            for i in asks_held.nonzero().flatten().tolist() if held else ():  # hits
                row[i] = held[int(torch.randint(0, len(held), (1,), generator=gen))]
            row[-1] = n - 1 if k > 1 else row[-1]
            if k > 2:
                row[1] = -1
            top_k.append(row)
        expected = w.reference(top_k, rids, [seq[r] for r in rids])
        res = w.swap_in(top_k, rids, [seq[r] for r in rids], plan=True)
        assert torch.equal(res["out"], expected.top_k_device_locs)
        assert torch.equal(w.device_buffer, expected.device_buffer)
        for b, rid in enumerate(rids):
            step = swap_in_step(models[rid], top_k[b], seq[rid])
            locs_row = w.device_buffer_locs[rid]
            assert res["out"][b].tolist() == [int(locs_row[s]) if s >= 0 else -1 for s in step.slots]
            assert w.device_buffer_tokens[rid, :h].tolist() == models[rid].tokens
            assert w.lru_slots[rid].tolist() == models[rid].lru
            assert int(res["miss_count"][b]) == len(step.misses)
            for i, tok in enumerate(top_k[b]):
                loc = int(res["out"][b, i])
                if loc >= 0:
                    assert torch.equal(w.device_token(loc), w.host_token(rid, tok))
        misses.append(res["miss_count"].tolist())
        for rid in rids:  # one new token per step, written by the model into the reserved column
            seq[rid] += 1
            w.place(rid, h, seq[rid] - 1)
    return misses




INVALID_INSTANCES = [
    (dict(num_top_k=0, hot_buffer_size=4), "`num_top_k` must be an int in [1, 32767]"),
    (dict(num_top_k=8, hot_buffer_size=7), "`hot_buffer_size` must be an int in [8, 32767] (at least num_top_k"),
    (dict(num_top_k=8, hot_buffer_size=40000), "`hot_buffer_size` must be an int in [8, 32767]"),
    (dict(num_top_k=True, hot_buffer_size=4), "`num_top_k` must be an int"),
    (dict(num_top_k=16384, hot_buffer_size=16384), "bytes (227 KiB) of shared memory"),
    (dict(num_top_k=8, hot_buffer_size=8, block_size=48), "`block_size` must be a multiple of 32"),
    (dict(num_top_k=8, hot_buffer_size=8, block_size=2048), "`block_size` must be a multiple of 32"),
    (dict(num_top_k=8, hot_buffer_size=8, layout="paged"), "`layout` must be one of"),
    (dict(num_top_k=8, hot_buffer_size=8, layout="dsv4", page_slots=48), "`page_slots` must be one of"),
    (dict(num_top_k=8, hot_buffer_size=8, layout="dsv4"), "`page_slots` must be one of"),
    (dict(num_top_k=8, hot_buffer_size=8, page_slots=64), "applies to layout 'dsv4' only"),
    (dict(num_top_k=8), "needs the parameters"),
    (dict(num_top_k=8, hot_buffer_size=8, top_k=3), "has no parameter 'top_k'"),
]


@pytest.mark.parametrize("values, message", INVALID_INSTANCES, ids=[m[:32] for _, m in INVALID_INSTANCES])
def test_an_invalid_instance_raises_before_compiling_anything(backend, monkeypatch, values, message):
    import sparsekv.jit_kernel.build.registry as registry

    def no_compile(*args, **kwargs):
        raise AssertionError("an invalid instance reached the compiler")

    monkeypatch.setattr(registry, "load_jit", no_compile)
    with pytest.raises(ValueError, match=re.escape(message)):
        SWAP_IN.module(**values, backend=backend)


@pytest.mark.no_backend("a compile-time check of the header under the host compiler")
def test_the_shared_memory_bound_is_what_the_compiler_says(tmp_path):
    """swap_in_shared_bytes and indexed_shared_bytes (the Python bounds on K and H) equal
    sizeof(SwapIn<...>::Shared) and sizeof(IndexedSwapIn<...>::Shared), LRU and protected."""
    cases = [(1, 1, 64), (4, 4, 64), (5, 7, 64), (12, 70, 64), (16, 48, 64), (64, 128, 64), (100, 333, 128),
             (512, 1024, 512), (2048, 4096, 1024), (7000, 9000, 1024)]
    lines = ['#include "hisparse_index.cuh"']
    for k, h, block in cases:
        lines.append(f"static_assert(sizeof(sparsekv::hisparse::SwapIn<{k}, {h}, {block}, "
                     f"sparsekv::hisparse::LinearRows>::Shared) == {swap_in_shared_bytes(k, h, block)});")
        protected = swap_in_shared_bytes(k, h, block, 256, 16)
        if protected <= SHARED_MEMORY_LIMIT:  # a protected policy's scratch: 6 H bytes and the near buckets more
            lines.append(f"static_assert(sizeof(sparsekv::hisparse::SwapIn<{k}, {h}, {block}, sparsekv::hisparse::"
                         f"LinearRows, 256, 16>::Shared) == {protected});")
        for policy in ((), (256, 16), (256, 0)):
            if indexed_shared_bytes(k, block, *policy[1:]) <= SHARED_MEMORY_LIMIT:
                args = "".join(f", {v}" for v in policy)
                lines.append(f"static_assert(sizeof(sparsekv::hisparse::IndexedSwapIn<{k}, {h}, {block}, sparsekv::"
                             f"hisparse::LinearRows{args}>::Shared) == {indexed_shared_bytes(k, block, *policy[1:])});")
    source = tmp_path / "shared_bytes.cpp"
    source.write_text("\n".join(lines) + "\n")
    root = csrc_root()
    done = subprocess.run([host_compiler(None).path, "-std=c++17", "-fsyntax-only", f"-I{root}",
                           f"-I{root / 'include'}", str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert swap_in_shared_bytes(7000, 9000, 1024) <= SHARED_MEMORY_LIMIT < swap_in_shared_bytes(16384, 16384, 1024)


@pytest.mark.no_backend("block sizes are computed in Python")
def test_default_block_size_covers_the_table():
    assert [default_block_size(k) for k in (1, 5, 64, 65, 512, 1024, 2048, 30000)] == [64, 64, 64, 128, 512, 1024,
                                                                                         1024, 1024]


def test_check_mode_rejects_a_device_slot_named_by_two_hot_slots(backend, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.reset_request(1, resident=False)
    w.device_buffer_locs[1, 3] = w.device_buffer_locs[0, 5]  # two requests' hot slots share a device slot
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    with pytest.raises(ValueError, match="`device_buffer_locs` names device slot .* twice"):
        w.swap_in([[20, 2, 21, -1, 29], [30, 31, 32, 33, 34]], [0, 1], [30, 36], plan=True)
    for now, then in zip((w.device_buffer_tokens, w.lru_slots, w.device_buffer), before):
        assert torch.equal(now, then)


# -- the plan replay's input contract -------------------------------------------------------------
def _plan(backend, src, dst, *, count=None):
    w = world(backend)
    args = dict(miss_src=torch.tensor([src], dtype=torch.int64), miss_dst=torch.tensor([dst], dtype=torch.int64),
                miss_count=torch.tensor([len(src) if count is None else count], dtype=torch.int32),
                num_real_reqs=torch.tensor([1], dtype=torch.int32), host_cache=w.host_cache,
                device_buffer=w.device_buffer)
    return w, to_backend(backend, args)


def test_plan_replay_rejects_a_destination_named_twice_with_different_sources(backend):
    w, args = _plan(backend, [3, 4, 3], [9, 9, 10])
    before = args["device_buffer"].cpu().clone()
    if host_readable(backend):  # rejected; on the device, distinct destinations are the caller's duty
        with pytest.raises(ValueError, match="`miss_dst` names destination 9 twice"):
            copy_cache_planned_mla(**args, item_size_bytes=w.item_size_bytes)
        assert torch.equal(args["device_buffer"].cpu(), before)
    # The same destination with the same source is harmless (same bytes whatever the order).
    w, args = _plan(backend, [3, 4, 3], [9, 10, 9])
    copy_cache_planned_mla(**args, item_size_bytes=w.item_size_bytes)
    device = args["device_buffer"].cpu()
    assert torch.equal(device[9], w.host_cache[3]) and torch.equal(device[10], w.host_cache[4])


@pytest.mark.parametrize("field", ["host_cache", "miss_count", "num_real_reqs"])
def test_plan_replay_rejects_a_device_buffer_sharing_memory(backend, field):
    w, args = _plan(backend, [3], [9])
    device_buffer = args["device_buffer"]
    args[field] = device_buffer if field == "host_cache" else device_buffer.view(torch.int32).view(-1)[:1]
    before = device_buffer.cpu().clone()
    with pytest.raises(ValueError, match=f"`{field}` and `device_buffer` must not share memory"):
        copy_cache_planned_mla(**args, item_size_bytes=w.item_size_bytes)
    assert torch.equal(device_buffer.cpu(), before)


@pytest.mark.parametrize("src, dst, count, name", [([-1, 4], [9, 10], None, "miss_src"),
                                                   ([3, 4], [9, -1], None, "miss_dst"),
                                                   ([3, 10**6], [9, 10], None, "miss_src"),
                                                   ([3, 4], [9, 10], 3, "miss_count")])
def test_plan_replay_check_mode_rejects_every_bad_entry(backend, monkeypatch, src, dst, count, name):
    w, args = _plan(backend, src, dst, count=count)
    before = args["device_buffer"].cpu().clone()
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    if count is None:  # without the check, bad entries are skipped (the swap-in records -1 for skipped copies)
        copy_cache_planned_mla(**args, item_size_bytes=w.item_size_bytes)
        device = args["device_buffer"].cpu()
        good = [(s, d) for s, d in zip(src, dst) if 0 <= s < w.host_cache.shape[0] and d >= 0]
        for s, d in good:
            assert torch.equal(device[d], w.host_cache[s])
        assert int((device != before).any(dim=1).sum()) == len(good)
        args["device_buffer"].copy_(before)
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    with pytest.raises(IndexError, match=f"`{name}`") as raised:
        copy_cache_planned_mla(**args, item_size_bytes=w.item_size_bytes)
    assert torch.equal(args["device_buffer"].cpu(), before)
    # The device check (the CUDA path) refuses it in the host entry's words.
    plan = {k: v for k, v in args.items() if k not in ("host_cache", "device_buffer")}
    with pytest.raises(IndexError) as device:
        check_plan_on_device(**plan, host_cache=args["host_cache"], device_buffer=args["device_buffer"])
    assert str(device.value) == str(raised.value)


# -- rows of one request in one batch (MTP draft tokens, speculative decoding) --------------------
def _copy_world(w):
    return dataclasses.replace(w, **{f.name: getattr(w, f.name).clone() for f in dataclasses.fields(w)
                                     if isinstance(getattr(w, f.name), torch.Tensor)})


def _state(w):
    return (w.device_buffer_tokens, w.lru_slots, w.device_buffer)


@st.composite
def speculative_batches(draw):
    """A world whose requests hold some tokens, and a batch in which requests repeat (draft rows of
    one request at growing lengths), mixed with rows of other requests and padding."""
    w = make_world(K, H, is_dsv4_layout=draw(st.booleans()), max_reqs=3, max_len=40, seed=draw(st.integers(0, 99)),
                   backend="cpu")
    for rid in range(3):
        held = draw(st.lists(st.integers(0, 30), min_size=H, max_size=H, unique=True))
        hold(w, rid, held)
    rids = draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
    base = {rid: draw(st.integers(1, 32)) for rid in set(rids)}
    seq_lens, top_k = [], []
    for b, rid in enumerate(rids):
        n = base[rid] + rids[:b].count(rid)  # each draft row one token longer
        seq_lens.append(n)
        top_k.append(draw(top_k_row(K, n, w.device_buffer_tokens[rid, :H].tolist())))
    num_real = draw(st.integers(max(1, len(rids) - 2), len(rids)))
    return w, top_k, rids, seq_lens, num_real


@given(case=speculative_batches())
def test_speculative_rows_equal_running_them_one_after_another(backend, case):
    w, top_k, rids, seq_lens, num_real = case
    w.backend = backend
    one_by_one = _copy_world(w)
    counters, counters_seq = torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    res = w.swap_in(top_k, rids, seq_lens, num_real_reqs=num_real, plan=True, counters=counters, speculative=True)
    for b in range(len(rids)):
        real = b < num_real
        row = one_by_one.swap_in([top_k[b]], [rids[b]], [seq_lens[b]], num_real_reqs=int(real), plan=True,
                                 counters=counters_seq)
        assert torch.equal(res["out"][b], row["out"][0])
        count = int(row["miss_count"][0])
        assert int(res["miss_count"][b]) == count
        assert torch.equal(res["miss_src"][b, :count], row["miss_src"][0, :count])
        assert torch.equal(res["miss_dst"][b, :count], row["miss_dst"][0, :count])
    for now, then in zip(_state(w), _state(one_by_one)):
        assert torch.equal(now, then)
    assert torch.equal(counters, counters_seq)


@example(rows=[[8, 9, 13, 2, -1], [8, 9, 14, 2, 15]])
@given(rows=st.lists(st.lists(st.integers(2, 11), min_size=K, max_size=K), min_size=2, max_size=3))
def test_a_token_missed_by_several_draft_rows_is_loaded_once(backend, rows):
    # Draft rows at lengths 20, 21, ...: each row's newest token has the reserved column. While the
    # group selects at most H distinct tokens, no row evicts what an earlier one selected.
    n = [20 + b for b in range(len(rows))]
    assume(len({t for b, row in enumerate(rows) for t in row if 0 <= t < n[b] - 1}) <= H)
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    res = w.swap_in(rows, [0] * len(rows), n, plan=True, speculative=True)
    loaded = [int(s) for b in range(len(rows)) for s in res["miss_src"][b, : int(res["miss_count"][b])]]
    assert len(loaded) == len(set(loaded))
    for b, row in enumerate(rows):
        for i, tok in enumerate(row):
            if 0 <= tok < n[b] - 1:
                loc = int(res["out"][b, i])
                assert loc >= 0 and torch.equal(w.device_token(loc), w.host_token(0, tok))


@pytest.mark.parametrize("later_copy", ["lands", "skipped"])
def test_a_slot_two_draft_rows_load_ends_with_the_later_rows_bytes(backend, monkeypatch, later_copy):
    # Request 0's draft rows are batch rows 0 and 34 (between them, 33 fast-path rows of requests 1
    # and 2: on the GPU a copy's warp finds row 34 in its second trip over the later rows, 32 a
    # trip). Row 0's 5 misses take slots 0-4 (LRU order), leaving [5, 6 | 0..4]; row 34's 5 misses
    # take 5, 6, 0, 1, 2, so slots 0-2 are loaded twice in the step and keep row 34's tokens (17,
    # 18, 19), as in two calls one after the other. A later copy the swap-in skips (its host slot
    # outside the cache, with the index check off) writes nothing: slot 1 then keeps row 0's 11.
    # The copies of the two rows run in different blocks of the copy launch; sim runs blocks in an
    # order drawn from SPARSEKV_SIM_SEED, so four seeds give a copy that should have been dropped
    # the chance to land last (on cpu the seed changes nothing).
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    draft_rows, n = [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]], [20, 21]
    fast = [[0, 2, 1, -1, 5]] * 33
    held = {0: 17, 1: 11 if later_copy == "skipped" else 18, 2: 19, 3: 13, 4: 14, 5: 15, 6: 16}
    for seed in range(4):
        monkeypatch.setenv("SPARSEKV_SIM_SEED", str(seed))
        w = world(backend)
        hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
        if later_copy == "skipped":
            w.host_cache_locs[0, 18] = w.host_cache.shape[0]
        one_by_one = _copy_world(w)
        res = w.swap_in([draft_rows[0], *fast, draft_rows[1]], [0] + [1, 2] * 16 + [1, 0],
                        [n[0]] + [3] * 33 + [n[1]], plan=True, speculative=True)
        for b, at in enumerate((0, 34)):
            row = one_by_one.swap_in([draft_rows[b]], [0], [n[b]], plan=True)
            assert torch.equal(res["out"][at], row["out"][0])
        for now, then in zip(_state(w), _state(one_by_one)):
            assert torch.equal(now, then)
        for slot, tok in held.items():
            assert torch.equal(w.device_token(int(w.device_buffer_locs[0, slot])), w.host_token(0, tok))


def test_the_plain_entry_refuses_two_rows_of_one_request_before_writing(backend):
    w = world(backend)
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    before = [t.clone() for t in _state(w)]
    with pytest.raises(ValueError, match="`req_pool_indices` names request row 0 twice"):
        w.swap_in([[20, 2, 21, -1, 19], [20, 2, 22, -1, 20]], [0, 0], [20, 21], plan=True)
    for now, then in zip(_state(w), before):
        assert torch.equal(now, then)
    # A padding row may name a real row's request.
    w.swap_in([[20, 2, 21, -1, 19], [20, 2, 22, -1, 20]], [0, 0], [20, 21], num_real_reqs=1)


@pytest.mark.gpu
@pytest.mark.no_backend("the device-side refusal exists only on the cuda backend (host tables raise instead)")
def test_on_the_device_the_plain_entry_refuses_rows_of_one_request_without_a_sync():
    w = world("cpu")
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = to_backend("cuda", _call_args(w, top_k_tokens=torch.tensor([[20, 2, 21, -1, 19], [20, 2, 22, -1, 20],
                                                                        [1, 2, 3, 4, 5]], dtype=torch.int32),
                                         top_k_device_locs=torch.full((3, K), 7, dtype=torch.int32),
                                         req_pool_indices=torch.tensor([0, 1, 0], dtype=torch.int32),
                                         seq_lens=torch.tensor([20, 6, 21], dtype=torch.int32)))
    before = _written(args)
    load_cache_to_device_buffer_mla(**args)
    after = _written(args)
    for now, then in zip(after[:3], before[:3]):
        assert torch.equal(now, then)  # request 0's tables and bytes untouched; request 1 is on the fast path
    assert after[3][0].tolist() == [-1] * K and after[3][2].tolist() == [-1] * K
    # Request 1 (seq_len 6 <= H) takes the fast path: token t sits in slot t, and tokens 20 and 22 are
    # past its end (-1), so only token 2 has a slot (the host entry gives the same for this row alone).
    assert after[3][1].tolist() == locs(w, 1, [-1, 2, -1, -1, -1])


@pytest.mark.gpu
@pytest.mark.no_backend("pageable host memory is refused on the cuda backend only (the cpu backend reads it)")
def test_the_cuda_swap_in_refuses_a_pageable_host_cache_naming_it():
    w = world("cpu")
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = to_backend("cuda", _call_args(w))
    args["host_cache"] = w.host_cache  # on the host, not pinned
    before = _written(args)
    with pytest.raises(ValueError, match="`host_cache` is pageable host memory.*pin it"):
        load_cache_to_device_buffer_mla(**args)
    for now, then in zip(_written(args), before):
        assert torch.equal(now, then)
    args["host_cache"] = w.host_cache.pin_memory()
    load_cache_to_device_buffer_mla(**args)


def _two_rows_of_request_0(w, seed, monkeypatch, speculative):
    """One launch whose two real rows both name request 0 (slow path, different misses), run with
    SPARSEKV_SIM_SEED=seed: the output rows and request 0's tables after it, or "refused"."""
    monkeypatch.setenv("SPARSEKV_SIM_SEED", str(seed))
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    args = _call_args(w, top_k_tokens=torch.tensor([[8, 3, 9, 7, 13], [20, 3, 21, 22, 12]], dtype=torch.int32),
                      top_k_device_locs=torch.full((2, K), 7, dtype=torch.int32),
                      req_pool_indices=torch.tensor([0, 0], dtype=torch.int32),
                      seq_lens=torch.tensor([30, 30], dtype=torch.int32))
    try:
        load_cache_to_device_buffer_mla(**args, speculative=speculative)
    except ValueError as refused:
        assert "`req_pool_indices`" in str(refused)
        return "refused"
    return (tuple(args["top_k_device_locs"].flatten().tolist()), tuple(w.device_buffer_tokens[0].tolist()),
            tuple(w.lru_slots[0].tolist()))


@pytest.mark.no_backend("runs on sim in every session (make test too): only sim runs blocks in a seeded order")
def test_rows_of_one_request_in_one_launch_do_not_depend_on_the_block_order(monkeypatch):
    # The GPU hazard of issue 23: two real rows of one request served by two blocks at once race on
    # the request's tables and slots. Sim runs the blocks one after the other in a seeded order, so
    # such a race is an outcome that changes with the seed (before the fix: two outcomes in these 8
    # seeds; tests/jit/test_jit_sim.py holds the order to vary). Now the plain entry refuses the
    # launch and the speculative one serves both rows in one block, in batch order: the same as two
    # calls one after the other.
    with cpu_backend("sim"):
        plain = {seed: _two_rows_of_request_0(world("sim"), seed, monkeypatch, False) for seed in range(8)}
        together = {seed: _two_rows_of_request_0(world("sim"), seed, monkeypatch, True) for seed in range(8)}
    assert set(plain.values()) == {"refused"}
    assert len(set(together.values())) == 1, f"the outcome depends on the block order: {together}"
    w = world("cpu")
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    rows = []
    for top_k in ([8, 3, 9, 7, 13], [20, 3, 21, 22, 12]):  # one call after the other
        args = _call_args(w, top_k_tokens=torch.tensor([top_k], dtype=torch.int32))
        load_cache_to_device_buffer_mla(**args)
        rows += args["top_k_device_locs"].flatten().tolist()
    assert together[0] == (tuple(rows), tuple(w.device_buffer_tokens[0].tolist()), tuple(w.lru_slots[0].tolist()))


# -- protected replacement policies ----------------------------------------------------------------
# The test shape's protected instance (in the SWAP_IN and INDEXED tables): the last 3 positions, and 1
# either side of a requested token, are evicted last. The model: swap_in_step(protect_recent=3,
# protect_near=1). Each test runs the scanning kernel and the indexed one (resident index).
PROTECT = (3, 1)
KERNELS = pytest.mark.parametrize("indexed", [False, True], ids=["scanning", "indexed"])


@KERNELS
@settings(max_examples=scaled_examples(8), deadline=None)
@given(data=st.data(), resident=st.booleans(), steps=st.integers(1, 6))
def test_a_protected_policy_follows_its_model_bit_for_bit(backend, indexed, data, resident, steps):
    w = world(backend, max_reqs=2, max_len=48)
    w.policy = PROTECT
    for rid, prefix in ((0, resident), (1, True)):
        w.reset_request(rid, resident=prefix)
        for pos in range(H if prefix else 0):  # the prefill's bytes in their slots
            w.place(rid, pos, pos)
    if indexed:
        w.use_resident_index()
    models = {rid: HotBuffer(tokens=w.device_buffer_tokens[rid, :H].tolist()) for rid in (0, 1)}
    n = data.draw(st.integers(H + 1, 30))
    for _ in range(steps):
        for rid in (0, 1):  # the newest token's bytes, in the reserved column
            w.place(rid, H, n - 1)
        top_k = [data.draw(top_k_row(K, n, models[rid].tokens)) for rid in (0, 1)]
        res = w.swap_in(top_k, [0, 1], [n, n], plan=True)
        for rid in (0, 1):
            step = swap_in_step(models[rid], top_k[rid], n, protect_recent=PROTECT[0], protect_near=PROTECT[1])
            assert res["out"][rid].tolist() == locs(w, rid, step.slots)
            assert w.device_buffer_tokens[rid, :H].tolist() == models[rid].tokens
            assert w.lru_order(rid) == models[rid].lru
            count = int(res["miss_count"][rid])
            assert count == len(step.misses)
            assert res["miss_dst"][rid, :count].tolist() == locs(w, rid, [s for _, s in step.misses])
            for i, tok in enumerate(top_k[rid]):
                loc = int(res["out"][rid, i])
                if loc >= 0:
                    assert torch.equal(w.device_token(loc), w.host_token(rid, tok))
        n += data.draw(st.integers(0, 2))


# Slots hold 20, 3, 7, 21, 8, 9, 10 (LRU order 0..6); the step asks for 21 (slot 3, a hit) and two
# misses, 14 and 15. At newest 23 (n = 24) LRU evicts slots 0 and 1. The last 3 positions (>= 20,
# the boundary itself) protect 20 and 21: slots 1 and 2 go; at newest 24 they (>= 21) protect nothing
# that can go. One position either side of a requested token protects 20 (next to 21): at newest 35
# (no held token among the last 3) that window alone sends slots 1 and 2. PROTECT protects 20 both
# ways at newest 23. Each window alone and its boundary on the two protected instances other tests
# build (a policy is a module: cpu, ASan and sim in CI); the indexed kernel runs the table's policies
# (the rule itself is the scanning kernel's function).
PROTECTED_CASES = [("lru", 24, [0, 1]), ((3, 0), 24, [1, 2]), ((3, 0), 25, [0, 1]), (PROTECT, 36, [1, 2]),
                   (PROTECT, 24, [1, 2])]
KERNEL_CASES = [(False, *case) for case in PROTECTED_CASES] + \
    [(True, *case) for case in PROTECTED_CASES if case[:2] in (("lru", 24), (PROTECT, 24))]


@pytest.mark.parametrize("indexed, policy, n, victims", KERNEL_CASES,
                         ids=[f"{'indexed' if i else 'scanning'}-{p}-n{n}" for i, p, n, _ in KERNEL_CASES])
def test_a_protected_policy_evicts_a_far_slot_before_a_less_recently_used_protected_one(backend, indexed, policy, n,
                                                                                        victims):
    w = world(backend)
    w.policy = policy
    hold(w, 0, [20, 3, 7, 21, 8, 9, 10])
    if indexed:
        w.use_resident_index()
    res = w.swap_in([[21, 14, 15, -1, -1]], [0], [n], plan=True)
    assert res["miss_dst"][0, :2].tolist() == locs(w, 0, victims)
    assert w.lru_order(0) == [s for s in range(7) if s not in victims + [3]] + victims + [3]


@pytest.mark.no_backend("argument checks before anything compiles")
@pytest.mark.parametrize("policy, message", [("mru", "`policy` must be one of"), ((1, 2, 3), "`policy` must be one of"),
                                             ((0, 5000), "`protect_near` must be an int in [0, 4095] (2 S + 1 lookups"),
                                             ((-1, 0), "`protect_recent` must be an int in [0,")])
@KERNELS
def test_a_bad_policy_is_refused_before_writing(policy, message, indexed):
    w = world("cpu")
    w.policy = policy
    if indexed:
        w.use_resident_index()
    before = [t.clone() for t in (w.device_buffer_tokens, w.lru_slots, w.device_buffer)]
    with pytest.raises(ValueError, match=re.escape(message)):
        w.swap_in([[9, 10, 11, 12, 13]], [0], [30])
    assert all(torch.equal(a, b) for a, b in zip((w.device_buffer_tokens, w.lru_slots, w.device_buffer), before))


@pytest.mark.no_backend("the policy table is Python")
def test_the_kernel_policies_are_the_simulated_ones():
    assert SWAP_IN_POLICIES["lru"] == (0, 0)
    assert SWAP_IN_POLICIES["recent_lru"] == (PROTECT_RECENT, 0)
    assert SWAP_IN_POLICIES["near_lru"] == (PROTECT_RECENT, PROTECT_NEAR)


@pytest.mark.parametrize("public", [hisparse.load_cache_to_device_buffer_mla,
                                    hisparse.load_cache_to_device_buffer_dsv4_mla])
def test_a_call_that_does_not_fit_the_signature_names_the_public_function(backend, public):
    device = device_of(backend)
    with pytest.raises(TypeError, match=rf"^sparsekv: {public.__name__}\(\): missing a required argument: "
                                        r"'host_cache_locs'$"):
        public(torch.zeros(1, 5, dtype=torch.int32, device=device), torch.zeros(1, 7, dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match=rf"^sparsekv: {public.__name__}\(\): got an unexpected keyword argument "
                                        r"'top_k'$"):
        public(*[torch.zeros(1, device=device)] * 13, top_k=5)

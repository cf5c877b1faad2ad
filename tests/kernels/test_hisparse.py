"""HiSparse swap-in and miss-plan replay: hand-computed cases, the reference, and the bad-input contract.

The long-running policy check (many steps, many requests) is tests/test_hisparse_stateful.py.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from sparsekv.jit_kernel.hisparse import (
    PLANNED,
    SWAP_IN,
    copy_cache_planned_mla,
    load_cache_to_device_buffer_mla,
)
from sparsekv.jit_kernel.loader import csrc_root
from sparsekv.jit_kernel.toolchain import host_compiler
from sparsekv.testing.reference.hisparse import copy_cache_planned_reference
from sparsekv.testing.strategies.hisparse import make_world, random_bytes

K, H = 5, 7


def world(is_dsv4_layout=False, seed=0, max_reqs=3, max_len=40):
    return make_world(K, H, is_dsv4_layout=is_dsv4_layout, max_reqs=max_reqs, max_len=max_len, seed=seed)


def hold(w, rid, tokens):
    """Set request ``rid``'s hot slots to hold ``tokens`` and put their host bytes in the device slots."""
    w.device_buffer_tokens[rid, :H] = torch.tensor(tokens, dtype=torch.int32)
    for slot, tok in enumerate(tokens):
        if tok >= 0:
            w.place(rid, slot, tok)


def locs(w, rid, slots):
    return [int(w.device_buffer_locs[rid, s]) if s >= 0 else -1 for s in slots]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_fast_path_maps_position_to_slot_and_changes_nothing(index_dtype):
    w = world()
    w.reset_request(1, resident=True)
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    # seq_len 4 <= H: entries 0..3 are used; -1 and 4 (>= seq_len) are "no token"; entry 4 is past min(seq_len, K).
    res = w.swap_in([[3, -1, 2, 4, 0]], [1], [4], plan=True, index_dtype=index_dtype)
    assert res["out"].tolist() == [locs(w, 1, [3, -1, 2, -1, -1])]
    assert res["miss_count"].tolist() == [0]
    for now, then in zip((w.device_buffer_tokens, w.lru_slots, w.device_buffer), before):
        assert torch.equal(now, then)


def test_hits_newest_and_lru_then_misses_take_lru_slots():
    w = world()
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


def test_padding_rows_get_minus_one_and_leave_tables_alone():
    w = world()
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


def test_all_invalid_entries_on_the_slow_path_load_nothing():
    w = world()
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    res = w.swap_in([[-1, -5, 30, 31, 2**31 - 1]], [0], [30], plan=True)
    assert res["out"].tolist() == [[-1] * K]
    assert res["miss_count"].tolist() == [0]
    assert torch.equal(w.device_buffer_tokens, before[0]) and torch.equal(w.device_buffer, before[2])
    # No hit either: every slot is a non-hit, so the LRU order is unchanged.
    assert torch.equal(w.lru_slots, before[1])


@pytest.mark.parametrize("is_dsv4_layout", [False, True], ids=["generic", "dsv4"])
def test_kernel_matches_reference_on_a_mixed_batch(is_dsv4_layout):
    w = world(is_dsv4_layout, seed=3, max_reqs=4)
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


def test_dsv4_miss_reads_and_writes_paged_addresses():
    # A miss from host slot 65 (page 1, offset 1) into device slot 76 (page 1, offset 12): the value and
    # scale records sit 36,864 bytes apart in the page row; nothing else in either page changes.
    w = world(True)
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
def test_replaying_the_plan_into_a_second_layer_moves_the_same_tokens(is_dsv4_layout, miss_dst_dtype):
    w = world(is_dsv4_layout, seed=5)
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
    copy_cache_planned_mla(miss_src=res["miss_src"], miss_dst=res["miss_dst"], miss_count=res["miss_count"],
                           num_real_reqs=torch.tensor([2], dtype=torch.int32), host_cache=host2,
                           device_buffer=device2, item_size_bytes=w.item_size_bytes, is_dsv4_layout=is_dsv4_layout)
    plan = [list(zip(res["miss_src"][b, : res["miss_count"][b]].tolist(),
                     res["miss_dst"][b, : res["miss_count"][b]].tolist())) for b in range(2)]
    assert sum(len(p) for p in plan) == 3 + 5
    assert torch.equal(device2, copy_cache_planned_reference(plan, host2, device2_before, page_slots=w.page_slots))
    for b, rid in enumerate([0, 1]):
        for i, tok in enumerate([[8, 3, 9, 8, 13], [30, 31, 2, 33, 34]][b]):
            if (rid, tok) in ((0, 3),):
                continue  # a hit: layer 2's slot was never filled in this test
            assert torch.equal(w.device_token(int(res["out"][b, i]), device2), w.host_token(rid, tok, host2))


def test_counters_accumulate_hits_misses_and_bytes():
    w = world()
    hold(w, 0, [10, 3, 7, -1, 12, 5, 1])
    w.reset_request(1, resident=True)
    counters = torch.zeros(3, dtype=torch.int64)
    w.swap_in([[8, 3, 9, 8, 13], [0, 1, 2, -1, 9]], [0, 1], [20, 4], counters=counters)
    # Row 0: one hit entry (3), three loads (8 repeats); row 1 (fast path): three valid entries.
    assert counters.tolist() == [1 + 3, 3, 3 * w.item_size_bytes]
    w.swap_in([[8, 3, 9, 8, 19]], [0], [20], counters=counters)
    assert counters.tolist() == [4 + 5, 3, 3 * w.item_size_bytes]


def test_without_checks_a_bad_host_loc_is_skipped_not_followed(monkeypatch):
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    w = world()
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
def test_check_indices_mode_rejects_a_bad_index_before_writing(monkeypatch, mutate, exc, name):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    w = world()
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    mutate(w)
    before = (w.device_buffer_tokens.clone(), w.lru_slots.clone(), w.device_buffer.clone())
    with pytest.raises(exc, match=f"`{name}`"):
        w.swap_in([[20, 2, 21, -1, 29]], [0], [30], plan=True)
    for now, then in zip((w.device_buffer_tokens, w.lru_slots, w.device_buffer), before):
        assert torch.equal(now, then)


def test_check_indices_mode_accepts_a_valid_call(monkeypatch):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    w = world()
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.host_cache_locs[0, 2] = -1  # a hit: its host slot is never read
    w.host_cache_locs[0, 29] = -1  # the newest token: never read either
    res = w.swap_in([[20, 2, 21, -1, 29]], [0], [30], plan=True)
    assert res["miss_count"].tolist() == [2]


def _call_args(w, **overrides):
    args = dict(top_k_tokens=torch.tensor([[20, 2, 21, -1, 29]], dtype=torch.int32),
                device_buffer_tokens=w.device_buffer_tokens, host_cache_locs=w.host_cache_locs,
                device_buffer_locs=w.device_buffer_locs, host_cache=w.host_cache, device_buffer=w.device_buffer,
                top_k_device_locs=torch.full((1, K), 7, dtype=torch.int32),
                req_pool_indices=torch.tensor([0], dtype=torch.int32), seq_lens=torch.tensor([30], dtype=torch.int32),
                lru_slots=w.lru_slots, item_size_bytes=w.item_size_bytes, num_top_k=K, hot_buffer_size=H)
    args.update(overrides)
    return args


def _sharing(offset):
    """``top_k_tokens`` and a ``top_k_device_locs`` starting ``offset`` entries into it, in one buffer."""
    buffer = torch.tensor([20, 2, 21, -1, 29] * 2, dtype=torch.int32)
    return dict(top_k_tokens=buffer[:K].view(1, K), top_k_device_locs=buffer[offset : offset + K].view(1, K))


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
def test_bad_input_raises_naming_the_argument_and_writes_nothing(mutate, exc, name):
    w = world()
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = _call_args(w)
    args.update(mutate(w))
    before = [t.clone() for t in (w.device_buffer_tokens, w.lru_slots, w.device_buffer, args["top_k_device_locs"])]
    with pytest.raises(exc, match=f"`{name}`"):
        load_cache_to_device_buffer_mla(**args)
    after = (w.device_buffer_tokens, w.lru_slots, w.device_buffer, args["top_k_device_locs"])
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_top_k_and_output_may_be_adjacent_views_of_one_buffer():
    separate, shared = world(), world()
    for w in (separate, shared):
        hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    args = _call_args(separate)
    load_cache_to_device_buffer_mla(**args)
    views = _sharing(K)
    load_cache_to_device_buffer_mla(**_call_args(shared, **views))
    assert torch.equal(views["top_k_device_locs"], args["top_k_device_locs"])
    assert views["top_k_tokens"].tolist() == args["top_k_tokens"].tolist()
    assert torch.equal(shared.device_buffer, separate.device_buffer)


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


def test_dsv4_rejects_a_non_page_row_cache_and_a_wrong_item_size():
    w = world(True)
    from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_dsv4_mla

    with pytest.raises(ValueError, match="`device_buffer`"):
        load_cache_to_device_buffer_dsv4_mla(**_call_args(w, device_buffer=w.device_buffer[:, :584]))
    with pytest.raises(ValueError, match="`item_size_bytes`"):
        load_cache_to_device_buffer_dsv4_mla(**_call_args(w, item_size_bytes=576))


def test_every_table_layout_has_a_plan_replay_instance():
    def layout(values):
        return values["layout"], values.get("page_slots")

    assert {layout(v) for v in SWAP_IN.instances} <= {layout(v) for v in PLANNED.instances}


def test_index_check_reads_only_the_shapes_of_the_caches():
    # On the GPU the debug check runs on host copies of the tables and one-row stand-ins of the
    # caches; the stand-ins must pass the same checks and the verdict must be the same.
    from sparsekv.jit_kernel.hisparse import _stand_in, swap_in_module

    w = world()
    hold(w, 0, [0, 1, 2, 3, 4, 5, 6])
    w.host_cache_locs[0, 21] = -1
    a = _call_args(w)
    empty = [torch.empty((), dtype=d) for d in (torch.int32, torch.int64, torch.int64, torch.int32, torch.int64)]
    args = [a["top_k_tokens"], a["device_buffer_tokens"], a["host_cache_locs"], a["device_buffer_locs"],
            _stand_in(w.host_cache), _stand_in(w.device_buffer), a["top_k_device_locs"], a["req_pool_indices"],
            a["seq_lens"], a["lru_slots"], a["item_size_bytes"], *empty]
    assert args[4].untyped_storage().nbytes() == w.item_size_bytes
    with pytest.raises(IndexError, match=r"`host_cache_locs`\[0, 21\] = -1"):
        swap_in_module(K, H).check_load_cache_indices(*args)
    w.host_cache_locs[0, 21] = 5
    swap_in_module(K, H).check_load_cache_indices(*args)

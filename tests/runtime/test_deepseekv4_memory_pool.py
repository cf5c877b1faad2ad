"""DeepSeekV4TokenToKVPool: allocated bytes equal the configurator's budget; layouts, locations, PD lists."""

from __future__ import annotations

import doctest
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import sparsekv.srt.mem_cache.deepseekv4_memory_pool as pool_module
from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
from sparsekv.srt.model_executor import dsv4_geometry as geo
from sparsekv.srt.model_executor.model_spec import DSV4ModelSpec, ServerSpec, SpeculativeSpec, dsv4_preset
from sparsekv.srt.model_executor.pool_planner import RankPlan, plan_pipeline

MIB = 1 << 20


def build_pools(model, server, budget, pp_size=1) -> list[tuple[RankPlan, DeepSeekV4TokenToKVPool]]:
    plan = plan_pipeline(model, server, budget, pp_size)
    return [(rank, DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device="cpu")) for rank in plan.ranks]


def assert_allocation_matches_budget(rank: RankPlan, pool: DeepSeekV4TokenToKVPool) -> None:
    """Per component: allocated - budgeted is in [0, one page per layer]; the C128 state is exact."""
    budget = rank.configurator.component_bytes(rank.config)
    allocated = pool.component_nbytes()
    page = pool.component_page_bytes()
    layers = {
        "swa_kv": len(pool.swa_kv_pool.buffers), "c4_kv": len(pool.c4_kv_pool.buffers),
        "c4_indexer": len(pool.c4_indexer_pool.buffers), "c128_kv": len(pool.c128_kv_pool.buffers),
        "c4_state": len(pool.c4_state_pool.buffers), "c4_indexer_state": len(pool.c4_indexer_state_pool.buffers),
    }
    assert allocated["c128_state"] == budget["c128_state"]
    for name, count in layers.items():
        slack = allocated[name] - budget[name]
        assert -1e-6 * budget[name] <= slack <= count * page[name], (name, allocated[name], budget[name], page[name])


@st.composite
def small_cases(draw):
    num_layers = draw(st.integers(1, 8))
    ratios = tuple(draw(st.lists(st.sampled_from((0, 4, 128)), min_size=num_layers, max_size=num_layers)))
    model = DSV4ModelSpec(num_hidden_layers=num_layers, compress_ratios=ratios + (0,), context_len=131072)
    mode = draw(st.sampled_from(("null", "decode")))
    server = ServerSpec(
        page_size=draw(st.sampled_from((128, 256))),
        swa_full_tokens_ratio=draw(st.one_of(st.none(), st.floats(0.1, 0.6))),
        max_running_requests=draw(st.integers(1, 8)),
        chunked_prefill_size=draw(st.sampled_from((256, 1024))),
        disable_radix_cache=draw(st.booleans()),
        enable_hisparse=draw(st.booleans()),
        hisparse_host_to_device_ratio=draw(st.integers(1, 5)),
        speculative=draw(st.one_of(st.none(), st.just(SpeculativeSpec(num_steps=1, num_draft_tokens=2)))),
        disaggregation_mode=mode,
        disaggregation_decode_extra_slots=draw(st.integers(0, 4)) if mode == "decode" else 0,
        compress_state_dtype=draw(st.sampled_from(("fp32", "bf16"))),
    )
    pp_size = draw(st.integers(1, min(3, num_layers)))
    return model, server, draw(st.integers(8 * MIB, 48 * MIB)), pp_size


@given(small_cases())
def test_allocated_bytes_equal_the_budget_per_component(case):
    model, server, budget, pp_size = case
    try:
        pools = build_pools(model, server, budget, pp_size)
    except (ValueError, RuntimeError):
        assume(False)
    for rank, pool in pools:
        assert_allocation_matches_budget(rank, pool)
        assert (pool.start_layer, pool.end_layer) == rank.layers


def test_flash_stages_under_a_gib_match_the_budget():
    server = ServerSpec(max_running_requests=8, enable_hisparse=True, hisparse_host_to_device_ratio=3)
    pools = build_pools(dsv4_preset("dsv4-flash"), server, 384 * MIB, pp_size=2)
    for rank, pool in pools:
        assert_allocation_matches_budget(rank, pool)
        total = sum(pool.component_nbytes().values())
        assert total <= 384 * MIB * 1.02  # the reserved pages are the only overshoot


def test_docstring_example_runs():
    assert doctest.testmod(pool_module).failed == 0


@pytest.fixture(scope="module")
def flash_stage():
    # Rank 1 of a PP-2 Flash: layers [22, 43), all C4/C128, page 256.
    return build_pools(dsv4_preset("dsv4-flash"), ServerSpec(max_running_requests=4), 256 * MIB, pp_size=2)[1]


def test_layouts_and_layer_slice(flash_stage):
    rank, pool = flash_stage
    assert (pool.start_layer, pool.end_layer) == (22, 43) == rank.layers
    assert pool.swa_kv_pool.buffers[0].shape[1] == 149760 and pool.c4_kv_pool.page_bytes == 37440
    assert pool.c128_kv_pool.page_bytes == 1728 and pool.c4_indexer_pool.page_bytes == 64 * 132
    assert len(pool.swa_kv_pool.buffers) == 21 and len(pool.c4_kv_pool.buffers) == 11
    assert len(pool.c128_kv_pool.buffers) == 10
    assert pool.get_compressed_kv_buffer(22) is pool.c4_kv_pool.buffers[0]  # layer 22 has ratio 4
    assert pool.get_compressed_kv_buffer(23) is pool.c128_kv_pool.buffers[0]
    assert pool.get_indexer_buffer(23) is None and pool.get_indexer_state(22) is pool.c4_indexer_state_pool.buffers[0]
    assert pool.get_compress_state(23).shape[1] == 2 * 512
    with pytest.raises(IndexError, match="layer 21"):
        pool.get_swa_kv_buffer(21)
    state = pool.get_compress_state(22)
    half = state.shape[1] // 2
    assert torch.all(state[:, :half] == 0) and torch.all(state[:, half:] == float("-inf"))


def test_buf_infos_follow_the_wire_layout(flash_stage):
    _, pool = flash_stage
    contiguous = pool.get_contiguous_buf_infos()
    assert contiguous.item_lens == [37440] * 11 + [64 * 132] * 11 + [1728] * 10
    assert contiguous.data_ptrs[0] == pool.c4_kv_pool.buffers[0].data_ptr()
    assert contiguous.data_lens[-1] == pool.c128_kv_pool.buffers[-1].nbytes
    state = pool.get_state_buf_infos()
    ring = pool.ring_sizes[4]
    assert state.item_lens == [149760] * 21 + [ring * 4 * 512 * 4] * 11 + [ring * 4 * 128 * 4] * 11
    request = pool.get_request_state_buf_infos()
    assert request.item_lens == [128 * 2 * 512 * 4] * 10
    assert len(set(contiguous.data_ptrs + state.data_ptrs + request.data_ptrs)) == 21 + 11 * 4 + 10 * 2


def test_every_item_of_a_page_index_lies_inside_its_buffer(flash_stage):
    # The largest SWA page index addresses a whole SWA page and a whole ring in every state pool.
    _, pool = flash_stage
    last_swa_page = pool.swa_kv_pool.size // pool.page_size
    state = pool.get_state_buf_infos()
    for length, item in zip(state.data_lens, state.item_lens):
        assert (last_swa_page + 1) * item <= length
    last_page = pool.size // pool.page_size
    for length, item in zip(*pool.get_contiguous_buf_infos()[1:]):
        assert (last_page + 1) * item <= length


def test_full_to_compressed_locations():
    loc = torch.arange(0, 1024)
    c4 = DeepSeekV4TokenToKVPool.translate_loc_from_full_to_compressed(loc, 4)
    assert torch.equal(c4, torch.arange(0, 256))
    c128 = DeepSeekV4TokenToKVPool.translate_loc_from_full_to_compressed(torch.tensor([127, 128, 255, 300]), 128)
    assert c128.tolist() == [0, 1]
    with pytest.raises(ValueError, match="compress_ratio"):
        DeepSeekV4TokenToKVPool.translate_loc_from_full_to_compressed(loc, 2)


def test_state_locations(flash_stage):
    _, pool = flash_stage
    ring, page = pool.ring_sizes[4], pool.page_size
    swa_loc = torch.tensor([-1, page, page + 1, page + ring, 2 * page + 3, pool.swa_kv_pool.size + page - 1])
    rows = pool.c4_state_loc(swa_loc)
    assert rows[0] == -1 and rows[1] == ring and rows[2] == ring + 1 and rows[3] == ring  # wraps in its ring
    assert rows[4] == 2 * ring + 3 and rows.max() < pool.c4_state_pool.rows
    assert rows[rows >= 0].min() >= ring  # ring 0 (scratch) is never a real slot
    req = torch.tensor([0, pool.num_req_slots - 1])
    rows = pool.c128_state_loc(req, torch.tensor([5, 1000]))
    assert rows.tolist() == [5, (pool.num_req_slots - 1) * 128 + 1000 % 128]
    assert rows.max() < pool.c128_state_pool.scratch_row


def test_swa_mapping_is_required_and_used(flash_stage):
    _, pool = flash_stage
    fresh = DeepSeekV4TokenToKVPool.__new__(DeepSeekV4TokenToKVPool)
    with pytest.raises(RuntimeError, match="register_mapping"):
        fresh.translate_loc_from_full_to_swa(torch.tensor([0]))
    with pytest.raises(TypeError):
        pool.register_mapping(torch.zeros(4))
    mapping = torch.arange(100, dtype=torch.int64) - 1
    pool.register_mapping(mapping)
    assert pool.translate_loc_from_full_to_swa(torch.tensor([0, 5])).tolist() == [-1, 4]


def test_bad_inputs_are_rejected_before_allocation(flash_stage):
    rank, _ = flash_stage
    with pytest.raises(ValueError, match="finalize"):
        DeepSeekV4TokenToKVPool(replace(rank.config, max_running_requests=None), rank.configurator, "cpu")
    with pytest.raises(TypeError, match="DSV4PoolConfigurator"):
        DeepSeekV4TokenToKVPool(rank.config, object(), "cpu")
    small_head = dsv4_preset("dsv4-flash", num_hidden_layers=4, head_dim=256)
    plan = plan_pipeline(small_head, ServerSpec(max_running_requests=2), 32 * MIB)
    with pytest.raises(ValueError, match="584"):
        DeepSeekV4TokenToKVPool(plan.ranks[0].config, plan.ranks[0].configurator, "cpu")


def test_geometry_matches_the_layout_constants():
    assert [geo.kv_page_bytes(n) for n in (64, 256, 2, 1)] == [37440, 149760, 1728, 1152]
    assert geo.indexer_bytes_per_entry(128) == 132
    assert geo.compress_state_write_pad(4, 16) == 10 and geo.compress_state_write_pad(128, 256) == 130


def test_layer_ids_and_ratios_must_be_ints(flash_stage):
    _, pool = flash_stage
    # 22.0 == 22 and True == 1 hash alike, so a dict lookup alone would take them.
    for bad in (22.0, True):
        with pytest.raises(TypeError, match="layer_id"):
            pool.get_compressed_kv_buffer(bad)
    with pytest.raises(IndexError, match="layer_id"):
        pool.get_swa_kv_buffer(-1)
    with pytest.raises(TypeError, match="compress_ratio"):
        DeepSeekV4TokenToKVPool.translate_loc_from_full_to_compressed(torch.arange(8), 4.0)
    with pytest.raises(TypeError, match="full_loc"):
        DeepSeekV4TokenToKVPool.translate_loc_from_full_to_compressed(torch.arange(8.0), 4)


def test_swa_mapping_must_be_an_integer_table(flash_stage):
    _, pool = flash_stage
    mapping = torch.arange(10, dtype=torch.int64)
    pool.register_mapping(mapping)
    with pytest.raises(TypeError, match="full_to_swa_index_mapping"):
        pool.register_mapping(torch.ones(4, dtype=torch.bool))
    assert pool.full_to_swa_index_mapping is mapping
    with pytest.raises(TypeError, match="full_loc"):
        pool.translate_loc_from_full_to_swa(torch.tensor([1.0]))


def test_state_locations_take_integer_tensors(flash_stage):
    _, pool = flash_stage
    with pytest.raises(TypeError, match="swa_loc"):
        pool.c4_state_loc(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="position"):
        pool.c128_state_loc(torch.tensor([0]), torch.tensor([5.5]))

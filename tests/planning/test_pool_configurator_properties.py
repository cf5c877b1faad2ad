"""Properties of the configurators and the consumer flow over random models and servers."""

from __future__ import annotations

import re
from dataclasses import replace

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sparsekv.srt.model_executor.model_spec import (
    DSV4ModelSpec,
    MHAModelSpec,
    ParallelSpec,
    ServerSpec,
    SpeculativeSpec,
    dsv4_preset,
)
from sparsekv.srt.model_executor.pool_configurator import (
    DSV4PoolConfigurator,
    MemoryPoolConfig,
    create_memory_pool_configurator,
)
from sparsekv.srt.model_executor.pool_planner import plan_pipeline
from sparsekv.testing.profiles import scaled_examples

SIZE_FIELDS = (
    "max_total_num_tokens", "full_max_total_num_tokens", "swa_max_total_num_tokens",
    "c4_max_total_num_tokens", "c128_max_total_num_tokens", "c4_state_pool_size",
)
GIB = 1 << 30
# Budgets from 2 GiB to 1 TiB, spread evenly in log scale: about four draws in five plan (the rest are
# documented refusals, half of them for want of memory).
budgets = st.builds(lambda e, f: int((1 << e) * f), st.integers(31, 39), st.floats(1, 2))
# Half the draws one PP rank: a PP stage of a hybrid MHA model often holds no SWA layer, which
# sglang refuses, so many ranks would leave few draws that plan.
pp_sizes = st.integers(0, 3).flatmap(lambda one: st.just(1) if one else st.integers(2, 8))
#: More memory than any rank has: a refusal for want of memory must go away with it.
PIB = 1 << 50
#: The planner's documented refusals for want of memory (see pool_configurator's Raises sections).
BUDGET_REFUSALS = ("Not enough memory for the KV cache", "cannot hold even one request",
                   "leaves no room for the full KV pool")
ADMISSION_FLOOR = re.compile(r"SWA pool \((\d+) tokens\) cannot hold even one request: the prefill admission floor is "
                             r"sliding_window_size \((\d+)\) \+ page_size \((\d+)\)")


@st.composite
def dsv4_models(draw):
    num_layers = draw(st.integers(1, 24))
    ratios = draw(st.lists(st.sampled_from((0, 4, 128)), min_size=num_layers, max_size=num_layers))
    return DSV4ModelSpec(
        num_hidden_layers=num_layers,
        compress_ratios=tuple(ratios) + (0,),
        context_len=draw(st.sampled_from((131072, 1048576))),
    )


ANY_MAX_RUNNING_REQUESTS = st.one_of(st.none(), st.integers(1, 1024))
SPECULATIVE = st.one_of(
    st.none(), st.integers(1, 6).map(lambda n: SpeculativeSpec(num_steps=n, num_draft_tokens=n + 1))
)


@st.composite
def dsv4_servers(draw, max_running_requests=ANY_MAX_RUNNING_REQUESTS):
    spec = draw(SPECULATIVE)
    mode = draw(st.sampled_from(("null", "prefill", "decode")))
    return ServerSpec(
        page_size=draw(st.sampled_from((128, 256, 512))),
        swa_full_tokens_ratio=draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        max_running_requests=draw(max_running_requests),
        chunked_prefill_size=draw(st.sampled_from((None, 4096, 8192))),
        disable_overlap_schedule=draw(st.booleans()),
        disable_radix_cache=draw(st.booleans()),
        enable_hisparse=draw(st.booleans()),
        hisparse_host_to_device_ratio=draw(st.integers(1, 8)),
        speculative=spec,
        disaggregation_mode=mode,
        disaggregation_decode_extra_slots=draw(st.integers(0, 64)) if mode == "decode" else 0,
        compress_state_dtype=draw(st.sampled_from(("fp32", "bf16"))),
    )


@st.composite
def mha_models(draw):
    num_layers = draw(st.integers(1, 48))
    return MHAModelSpec(
        num_layers=num_layers,
        kv_heads=draw(st.integers(1, 16)),
        head_dim=draw(st.sampled_from((64, 128, 256))),
        dtype_bytes=draw(st.sampled_from((1, 2))),
        swa_layers=draw(st.integers(0, num_layers)),
        swa_window=draw(st.sampled_from((128, 512, 4096))),
    )


@st.composite
def mha_servers(draw):
    return ServerSpec(
        page_size=draw(st.sampled_from((1, 16, 64))),
        swa_full_tokens_ratio=draw(st.floats(0.05, 1.0)),
        max_running_requests=draw(st.one_of(st.none(), st.integers(1, 64))),
        disable_radix_cache=draw(st.booleans()),
    )


def any_model_and_server():
    return st.one_of(st.tuples(dsv4_models(), dsv4_servers()), st.tuples(mha_models(), mha_servers()))


def profile(model, server, available, pp_rank=0, pp_size=1):
    """``(configurator, profiled config)``; either is ``None`` where it raised."""
    try:
        configurator = create_memory_pool_configurator(model, ParallelSpec(pp_size, pp_rank), server)
    except ValueError:
        return None, None
    try:
        return configurator, configurator.calculate_pool_sizes(available, server.page_size)
    except (ValueError, RuntimeError):
        return configurator, None


def outcome(model, server, available, pp_rank=0, pp_size=1):
    """What profiling gives, comparable across configurators: coefficients and sizes, or failure."""
    configurator, config = profile(model, server, available, pp_rank, pp_size)
    if configurator is None:
        return "rejected"
    coefficients = (getattr(configurator, "bytes_per_full_token", None),
                    getattr(configurator, "bytes_per_swa_token", None))
    return coefficients, None if config is None else sizes(config)


def sizes(config: MemoryPoolConfig) -> tuple:
    return tuple(getattr(config, f) or 0 for f in SIZE_FIELDS)


def assert_documented_refusal(error: Exception, model, server, available: int, pp_size: int = 1) -> None:
    """``error`` is one the planner documents, and this input is one it is documented for."""
    assert isinstance(error, (ValueError, RuntimeError)), repr(error)
    message = str(error)
    stages = [range(*ParallelSpec(pp_size, r).layer_range(model.num_layers)) for r in range(pp_size)]
    if "holds no SWA layer" in message:
        assert any(not any(model.is_swa_layer(i) for i in stage) for stage in stages), message
    elif "hold only SWA-only layers" in message:
        assert server.swa_full_tokens_ratio is None, message
        assert any(not any(model.compress_ratios[i] for i in stage) for stage in stages), message
    elif "compressor state ring" in message:
        assert server.speculative is not None, message
        assert f"num_draft_tokens={server.speculative.num_draft_tokens} exceeds" in message
    elif any(reason in message for reason in BUDGET_REFUSALS):
        plan_pipeline(model, server, PIB, pp_size)  # the same input plans given the memory
    else:
        raise AssertionError(f"an undocumented refusal: {error!r}")


def assert_below_admission_floor(error: Exception, server) -> None:
    """``error`` refuses an SWA pool of at most ``sliding_window + page_size`` tokens, and it is so small."""
    found = ADMISSION_FLOOR.search(str(error))
    assert isinstance(error, ValueError) and found, repr(error)
    tokens, window, page = map(int, found.groups())
    assert tokens <= window + page and page == server.page_size


def plan_or_refusal(model, server, available: int, pp_size: int = 1):
    """``plan_pipeline``'s plan, or None where it refused, with one of its documented refusals for this input."""
    try:
        return plan_pipeline(model, server, available, pp_size)
    except (ValueError, RuntimeError) as e:
        assert_documented_refusal(e, model, server, available, pp_size)
        return None


def assert_most_planned(outcomes: list[bool]) -> None:
    """Most draws must plan: a planner that wrongly refused valid input would otherwise pass."""
    assert outcomes and sum(outcomes) > len(outcomes) / 2, f"{sum(outcomes)} of {len(outcomes)} draws planned"


def test_from_max_tokens_never_exceeds_profiled_and_is_monotone():
    outcomes = []

    @given(any_model_and_server(), budgets, st.data())
    def sized_from_max_tokens(model_server, available, data):
        model, server = model_server
        configurator, profiled = profile(model, server, available)
        assume(profiled is not None)
        # One count in ten anywhere in the profiled range, the rest in its upper half: small counts fall
        # below the SWA admission floor (and integers crowd near 0).
        top = profiled.max_total_num_tokens
        counts = st.integers(0, 9).flatmap(lambda k: st.integers(0 if k == 0 else top // 2, top))
        n1, n2 = sorted(data.draw(st.lists(counts, min_size=2, max_size=2)))
        try:
            small = configurator.calculate_pool_sizes_from_max_tokens(n1, server.page_size)
        except (ValueError, RuntimeError) as e:
            if "Not enough memory" in str(e):
                assert isinstance(e, RuntimeError) and n1 < server.page_size  # not one page
            else:
                assert_below_admission_floor(e, server)  # below the floor there is no plan to compare
            outcomes.append(False)
            return
        outcomes.append(True)
        large = configurator.calculate_pool_sizes_from_max_tokens(n2, server.page_size)
        for a, b, p in zip(sizes(small), sizes(large), sizes(profiled)):
            assert a <= b <= p

    sized_from_max_tokens()
    assert_most_planned(outcomes)


def test_more_memory_never_fewer_tokens_with_fixed_requests():
    outcomes = []

    @given(any_model_and_server(), pp_sizes, budgets, budgets)
    @example((dsv4_preset("dsv4-flash"), ServerSpec()), 1, int(2.55 * GIB), int(2.6 * GIB))
    def more_memory(model_server, pp_size, a, b):
        model, server = model_server
        assume(server.max_running_requests is not None and pp_size <= model.num_layers)
        small_budget, large_budget = sorted((a, b))
        small = plan_or_refusal(model, server, small_budget, pp_size)
        outcomes.append(small is not None)
        if small is None:
            return
        large = plan_pipeline(model, server, large_budget, pp_size)  # must not raise: more memory still plans
        assert small.agreed_tokens <= large.agreed_tokens
        for rs, rl in zip(small.ranks, large.ranks):
            for size_small, size_large in zip(sizes(rs.config), sizes(rl.config)):
                assert size_small <= size_large
            assert rs.config.max_running_requests <= rl.config.max_running_requests

    more_memory()
    assert_most_planned(outcomes)


def test_unset_requests_can_step_down_like_sglang():
    # With max_running_requests unset the fixed C128 state is sized for a request count estimated
    # from capacity; where the estimate steps up, one more byte of budget gives fewer tokens.
    # sglang behaves so; we match it rather than "fix" it.
    c = DSV4PoolConfigurator(dsv4_preset("dsv4-flash"), ParallelSpec(), ServerSpec(max_running_requests=None))
    lo, hi = 40 * GIB, 41 * GIB
    assert c.budgeted_max_running_requests(lo) < c.budgeted_max_running_requests(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if c.budgeted_max_running_requests(mid) == c.budgeted_max_running_requests(lo) else (lo, mid)
    before = c.calculate_pool_sizes(lo, 256).max_total_num_tokens
    after = c.calculate_pool_sizes(hi, 256).max_total_num_tokens
    assert after < before


def test_full_and_swa_pools_are_page_aligned():
    outcomes = []

    @given(any_model_and_server(), pp_sizes, budgets)
    def page_aligned(model_server, pp_size, available):
        model, server = model_server
        assume(pp_size <= model.num_layers)
        plan = plan_or_refusal(model, server, available, pp_size)
        outcomes.append(plan is not None)
        for rank in plan.ranks if plan else ():
            config = rank.config
            assert config.max_total_num_tokens % server.page_size == 0
            for tokens in (config.full_max_total_num_tokens, config.swa_max_total_num_tokens):
                assert tokens is None or tokens % server.page_size == 0

    page_aligned()
    assert_most_planned(outcomes)


@given(dsv4_models(), dsv4_servers(), st.integers(2, 8), budgets, st.data())
def test_pp_stage_depends_only_on_its_own_layers(model, server, pp_size, available, data):
    # The seed-000 regression: a stage priced with the whole model's layers over-counts by ~pp_size.
    assume(pp_size <= model.num_layers)
    rank = data.draw(st.integers(0, pp_size - 1))
    start, end = ParallelSpec(pp_size, rank).layer_range(model.num_layers)
    others = data.draw(
        st.lists(st.sampled_from((0, 4, 128)), min_size=len(model.compress_ratios), max_size=len(model.compress_ratios))
    )
    ratios = tuple(others[:start]) + model.compress_ratios[start:end] + tuple(others[end:])
    perturbed = replace(model, compress_ratios=ratios)
    alone = replace(model, num_hidden_layers=end - start, compress_ratios=model.compress_ratios[start:end])
    got = {
        outcome(perturbed, server, available, rank, pp_size),
        outcome(alone, server, available),
        outcome(model, server, available, rank, pp_size),
    }
    assert len(got) == 1, got


@given(dsv4_models(), st.integers(1, 8))
def test_pp_stages_partition_the_per_token_bytes(model, pp_size):
    # Summed over stages, the per-token bytes are the whole model's: no stage counts another's layers.
    assume(pp_size <= model.num_layers)
    server = ServerSpec()
    whole = DSV4PoolConfigurator(model, ParallelSpec(), server)
    stages = [DSV4PoolConfigurator(model, ParallelSpec(pp_size, r), server) for r in range(pp_size)]
    for attr in ("bytes_per_full_token", "bytes_per_swa_token"):
        total = sum(getattr(s, attr) for s in stages)
        assert abs(total - getattr(whole, attr)) <= 1e-9 * max(1.0, getattr(whole, attr))


@given(dsv4_models(), dsv4_servers(max_running_requests=st.integers(1, 1024)), budgets)
def test_non_pp_plan_is_the_whole_model(model, server, available):
    # start=0, end=L: the trailing MTP entry never counts, and the plan equals the L-layer model's.
    configurator, _ = profile(model, server, available)
    assert configurator is None or configurator.layers == (0, model.num_hidden_layers)
    trimmed = replace(model, compress_ratios=model.compress_ratios[: model.num_hidden_layers])
    assert outcome(model, server, available) == outcome(trimmed, server, available)


def test_user_cap_is_honoured_exactly():
    outcomes = []

    @settings(max_examples=scaled_examples(10))
    @given(dsv4_servers(max_running_requests=st.integers(1, 1024)), st.integers(1, 6), budgets)
    def capped(server, pp_size, available):
        model = dsv4_preset("dsv4-pro")
        uncapped = plan_or_refusal(model, server, available, pp_size)
        outcomes.append(uncapped is not None)
        if uncapped is None:
            return
        cap = max(1, uncapped.agreed_tokens // 3)
        try:
            plan = plan_pipeline(model, replace(server, max_total_tokens=cap), available, pp_size)
        except (ValueError, RuntimeError) as e:
            assert_below_admission_floor(e, server)  # the cap itself is below the SWA admission floor
            return
        for rank in plan.ranks:
            assert rank.config.max_total_num_tokens == cap // server.page_size * server.page_size

    capped()
    assert_most_planned(outcomes)

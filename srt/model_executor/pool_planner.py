"""The consumer flow that turns each PP rank's byte budget into its final pool sizes.

Per rank, as an sglang server does it at start-up:

1. profile: ``calculate_pool_sizes(available_bytes)``;
2. constrain: the operator's ``max_total_tokens``, then the MIN over PP ranks, so every stage
   admits the same tokens (each holds different layers, so each profiles a different count);
3. re-size with ``calculate_pool_sizes_from_max_tokens`` if the count dropped;
4. resolve ``max_running_requests`` from the final capacity;
5. ``finalize_with_max_running_requests``.

:func:`plan_pipeline` runs every rank in one process (planning, tests, ``plan-memory``);
:func:`plan_rank` runs one rank in its own process and agrees on the MIN through a
``reduce_min`` callable, :func:`gloo_min` for real ``torch.distributed`` ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .model_spec import ParallelSpec, ServerSpec
from .pool_configurator import MemoryPoolConfig, MemoryPoolConfigurator, ModelSpec, create_memory_pool_configurator

logger = logging.getLogger(__name__)


@dataclass
class RankPlan:
    """The final plan of one PP rank.

    Attributes
    ----------
    pp_rank : int
    layers : tuple of int
        The stage's layers ``[start, end)``.
    profiled_tokens : int
        ``max_total_num_tokens`` the rank's own budget gives, before any constraint.
    config : MemoryPoolConfig
        The final sizes, ``max_running_requests`` resolved.
    configurator : MemoryPoolConfigurator
        The configurator that sized the rank (its coefficients explain the numbers).
    """

    pp_rank: int
    layers: tuple[int, int]
    profiled_tokens: int
    config: MemoryPoolConfig
    configurator: MemoryPoolConfigurator


@dataclass
class PoolPlan:
    """Every rank's plan and the token count they agreed on."""

    ranks: list[RankPlan]
    agreed_tokens: int


def resolve_max_num_reqs(token_capacity: int, server: ServerSpec, attn_dp_size: int, context_len: int) -> int:
    """Concurrent requests per attention-DP worker for a full pool of ``token_capacity``.

    The operator's ``max_running_requests`` split over DP workers, else an estimate of 512
    requests per context length of capacity clamped to [2048, 4096]; never more than half the
    capacity.
    """
    if server.max_running_requests is not None:
        requested = max(1, server.max_running_requests // attn_dp_size)
    else:
        requested = max(min(int(token_capacity / context_len * 512), 4096), 2048)
    return min(requested, token_capacity // 2)


def profile_rank(configurator: MemoryPoolConfigurator, available_bytes: int, server: ServerSpec) -> MemoryPoolConfig:
    """Step 1: size the rank's pools from its own byte budget."""
    return configurator.calculate_pool_sizes(available_bytes, server.page_size)


def apply_user_cap(tokens: int, server: ServerSpec) -> int:
    """Step 2a: the operator's ``max_total_tokens`` bounds the profiled capacity."""
    return tokens if server.max_total_tokens is None else min(tokens, server.max_total_tokens)


def finalize_rank(
    configurator: MemoryPoolConfigurator,
    config: MemoryPoolConfig,
    agreed_tokens: int,
    server: ServerSpec,
    attn_dp_size: int,
    context_len: int,
) -> MemoryPoolConfig:
    """Steps 3-5: re-size to the agreed count, resolve the request count, finalize."""
    if agreed_tokens != config.max_total_num_tokens:
        config = configurator.calculate_pool_sizes_from_max_tokens(agreed_tokens, server.page_size)
    config.max_running_requests = resolve_max_num_reqs(config.max_total_num_tokens, server, attn_dp_size, context_len)
    return configurator.finalize_with_max_running_requests(config)


def plan_pipeline(
    model: ModelSpec, server: ServerSpec, available_bytes: int, pp_size: int = 1, attn_dp_size: int = 1
) -> PoolPlan:
    """Plan every PP rank in this process; each rank has ``available_bytes`` for KV.

    Raises
    ------
    ValueError, RuntimeError
        The first rank (in rank order) whose budget cannot hold a valid plan.
    """
    configurators = create_stage_configurators(model, server, pp_size, attn_dp_size)
    return plan_stages(configurators, server, available_bytes, attn_dp_size, model.context_len)


def create_stage_configurators(
    model: ModelSpec, server: ServerSpec, pp_size: int = 1, attn_dp_size: int = 1
) -> list[MemoryPoolConfigurator]:
    """One configurator per PP rank. Rejects a configuration no rank could serve.

    Raises
    ------
    ValueError, TypeError
        From the configurators' input checks (e.g. a DSV4 page size not a multiple of 128).
    """
    return [
        create_memory_pool_configurator(model, ParallelSpec(pp_size, rank, attn_dp_size), server)
        for rank in range(pp_size)
    ]


def plan_stages(
    configurators: list[MemoryPoolConfigurator],
    server: ServerSpec,
    available_bytes: int,
    attn_dp_size: int,
    context_len: int,
) -> PoolPlan:
    """Run the consumer flow over prebuilt stage configurators (see :func:`plan_pipeline`)."""
    profiled = [profile_rank(c, available_bytes, server) for c in configurators]
    agreed = min(apply_user_cap(p.max_total_num_tokens, server) for p in profiled)
    ranks = []
    for rank, (configurator, config) in enumerate(zip(configurators, profiled)):
        final = finalize_rank(configurator, config, agreed, server, attn_dp_size, context_len)
        ranks.append(RankPlan(rank, configurator.layers, config.max_total_num_tokens, final, configurator))
    return PoolPlan(ranks, agreed)


def plan_rank(
    model: ModelSpec,
    server: ServerSpec,
    available_bytes: int,
    parallel: ParallelSpec,
    reduce_min: Callable[[int], int],
) -> RankPlan:
    """Plan this process's PP rank; ``reduce_min`` returns the MIN of a value over all ranks.

    Every rank must call it (it is a collective when ``reduce_min`` is).
    """
    configurator = create_memory_pool_configurator(model, parallel, server)
    config = profile_rank(configurator, available_bytes, server)
    capped = apply_user_cap(config.max_total_num_tokens, server)
    agreed = reduce_min(capped) if parallel.pp_size > 1 else capped
    final = finalize_rank(configurator, config, agreed, server, parallel.attn_dp_size, model.context_len)
    logger.info(
        "PP rank %d layers=[%d,%d): profiled %d tokens, agreed %d",
        parallel.pp_rank, *configurator.layers, config.max_total_num_tokens, agreed,
    )
    return RankPlan(parallel.pp_rank, configurator.layers, config.max_total_num_tokens, final, configurator)


def gloo_min(value: int, group: object | None = None) -> int:
    """MIN of ``value`` over the ranks of ``group`` (default: the world) via ``torch.distributed``.

    The process group must be initialized (any backend that supports CPU tensors, e.g. gloo);
    torch is imported only here, so planning itself never needs it.
    """
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())

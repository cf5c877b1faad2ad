"""Memory planning: how many KV tokens of each pool fit a byte budget, rank by rank.

Configurators size one PP rank's pools (sglang's ``MemoryPoolConfigurator`` hierarchy), the
planner runs the consumer flow over every rank (with the MIN over PP ranks), and a
:class:`MemoryCase` is one planning question as ``sparsekv plan-memory`` reads it. The names
resolve lazily from their modules; none of them imports torch.

Examples
--------
>>> from sparsekv.srt.model_executor import ServerSpec, dsv4_preset, plan_pipeline
>>> plan = plan_pipeline(dsv4_preset("dsv4-flash"), ServerSpec(), 40 << 30, pp_size=2)
>>> [rank.config.max_total_num_tokens for rank in plan.ranks]
[11490048, 11490048]
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "MemoryPoolConfig": "pool_configurator",
    "MemoryPoolConfigurator": "pool_configurator",
    "DefaultPoolConfigurator": "pool_configurator",
    "HybridSWAPoolConfigurator": "pool_configurator",
    "SWARequestCapPoolConfigurator": "pool_configurator",
    "DSV4PoolConfigurator": "pool_configurator",
    "DSV4TokenBytes": "pool_configurator",
    "create_memory_pool_configurator": "pool_configurator",
    "DSV4ModelSpec": "model_spec",
    "MHAModelSpec": "model_spec",
    "ParallelSpec": "model_spec",
    "ServerSpec": "model_spec",
    "SpeculativeSpec": "model_spec",
    "dsv4_preset": "model_spec",
    "PoolPlan": "pool_planner",
    "RankPlan": "pool_planner",
    "create_stage_configurators": "pool_planner",
    "gloo_min": "pool_planner",
    "plan_pipeline": "pool_planner",
    "plan_rank": "pool_planner",
    "plan_stages": "pool_planner",
    "MemoryCase": "memory_case",
    "parse_case": "memory_case",
    "plan_report": "plan_breakdown",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

"""Prefill admission (PD): bounded by the full KV pool (the host-backed logical size under HiSparse),
never by the SWA pool."""

from __future__ import annotations

import pytest

from sparsekv.srt.disaggregation.admission import PrefillAdmission, max_token_pool_size
from sparsekv.srt.mem_cache.allocators import HiSparseTokenToKVPoolAllocator
from sparsekv.srt.model_executor.model_spec import ServerSpec, dsv4_preset
from sparsekv.srt.model_executor.pool_configurator import MemoryPoolConfig
from sparsekv.srt.model_executor.pool_planner import plan_pipeline


def dsv4_config() -> MemoryPoolConfig:
    plan = plan_pipeline(dsv4_preset("dsv4-flash", num_hidden_layers=6), ServerSpec(max_running_requests=4),
                         48 << 20, 1)
    return plan.ranks[0].config


def test_a_prompt_longer_than_the_swa_pool_but_within_the_full_pool_is_admitted():
    config = dsv4_config()
    assert config.swa_max_total_num_tokens < config.full_max_total_num_tokens
    admission = PrefillAdmission.for_pool(config)
    assert admission.max_total_num_tokens == config.full_max_total_num_tokens
    assert admission.rejection(config.swa_max_total_num_tokens + 1) is None
    assert admission.rejection(config.full_max_total_num_tokens) is None


def test_a_prompt_longer_than_the_full_pool_is_rejected_with_the_reason():
    config = dsv4_config()
    full = config.full_max_total_num_tokens
    reason = PrefillAdmission.for_pool(config).rejection(full + 1)
    assert reason == (f"the prompt has {full + 1} tokens, more than the KV pool holds ({full} tokens); "
                      "it can never be admitted")


def test_under_hisparse_the_bound_is_the_host_backed_logical_size():
    config = dsv4_config()
    allocator = HiSparseTokenToKVPoolAllocator(config.full_max_total_num_tokens, 256, host_to_device_ratio=3)
    assert max_token_pool_size(config, allocator) == 3 * config.full_max_total_num_tokens
    admission = PrefillAdmission.for_pool(config, allocator)
    assert admission.rejection(2 * config.full_max_total_num_tokens) is None
    assert admission.rejection(3 * config.full_max_total_num_tokens + 1) is not None


def test_pools_without_an_swa_part_use_max_total_num_tokens():
    assert max_token_pool_size(MemoryPoolConfig(max_total_num_tokens=1000)) == 1000
    with pytest.raises(ValueError, match="input_len"):
        PrefillAdmission(1000).rejection(-1)

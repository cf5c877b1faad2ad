"""PD state routing: the exact components and region lists each pool kind sends, PP labels, and an
exhaustive sender dispatch."""

from __future__ import annotations

import pytest
import torch

from sparsekv.srt.disaggregation import planning
from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.kv_args import KVArgs, StateType
from sparsekv.srt.disaggregation.manifest import Manifest
from sparsekv.srt.disaggregation.state_routing import (
    DSAStatePool,
    HybridLinearStatePool,
    kv_args_of,
    setup_state_kv_args,
)
from sparsekv.srt.mem_cache.base_swa_pool import BufInfos
from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
from sparsekv.srt.model_executor.model_spec import ServerSpec, dsv4_preset
from sparsekv.srt.model_executor.pool_planner import plan_pipeline

MIB = 1 << 20


def dsv4_pools(pp_size: int, num_layers: int = 6, budget_mib: int = 16) -> list[DeepSeekV4TokenToKVPool]:
    model = dsv4_preset("dsv4-flash", num_hidden_layers=num_layers)
    plan = plan_pipeline(model, ServerSpec(max_running_requests=2), budget_mib * MIB, pp_size)
    return [DeepSeekV4TokenToKVPool(r.config, r.configurator, device="cpu") for r in plan.ranks]


class _Buffers:
    """Test doubles of pool kinds sparsekv does not build: they only implement the buffer-info methods."""

    def __init__(self, kv_items: list[int], state_items: list[int]):
        self.kv = [torch.zeros(4 * n, dtype=torch.uint8) for n in kv_items]
        self.state = [torch.zeros(3 * n, dtype=torch.uint8) for n in state_items]
        self.kv_items, self.state_items = kv_items, state_items

    def get_contiguous_buf_infos(self):
        return BufInfos.of(self.kv, self.kv_items)

    def get_state_buf_infos(self):
        return BufInfos.of(self.state, self.state_items)


class MambaPool(_Buffers, HybridLinearStatePool):
    pass


class DSAPool(_Buffers, DSAStatePool):
    pass


class PlainPool:
    """A pool with KV only (no state)."""

    def __init__(self):
        self.kv = [torch.zeros(64, dtype=torch.uint8)]

    def get_contiguous_buf_infos(self):
        return BufInfos.of(self.kv, [16])


def test_dsv4_routes_as_swa_plus_request_state():
    (pool,) = dsv4_pools(1)
    args = kv_args_of(pool)
    assert args.state_types == [StateType.SWA, StateType.C128_STATE]
    swa, request = pool.get_state_buf_infos(), pool.get_request_state_buf_infos()
    assert (args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0]) == tuple(swa)
    assert (args.state_data_ptrs[1], args.state_data_lens[1], args.state_item_lens[1]) == tuple(request)
    assert (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens) == tuple(pool.get_contiguous_buf_infos())
    ratios = list(pool.stage_compress_ratios)
    assert args.mla_compression_ratios == ratios
    c4 = [i for i, r in enumerate(ratios) if r == 4]
    c128 = [i for i, r in enumerate(ratios) if r == 128]
    assert args.kv_labels == ([f"c4_kv:{i}" for i in c4] + [f"c4_indexer:{i}" for i in c4]
                              + [f"c128_kv:{i}" for i in c128])
    assert args.state_labels[0] == ([f"swa_kv:{i}" for i in range(len(ratios))] + [f"c4_state:{i}" for i in c4]
                                    + [f"c4_indexer_state:{i}" for i in c4])
    assert args.state_labels[1] == [f"c128_state:{i}" for i in c128]
    assert args.state_mem_kinds == [["DRAM"] * len(swa.data_ptrs), ["DRAM"] * len(request.data_ptrs)]


def test_dsv4_draft_adds_a_second_swa_component():
    target, draft = dsv4_pools(1)[0], dsv4_pools(1, budget_mib=12)[0]
    args = kv_args_of(target, draft)
    assert args.state_types == [StateType.SWA, StateType.C128_STATE, StateType.SWA]
    assert args.state_data_ptrs[2] == draft.get_state_buf_infos().data_ptrs
    assert all(label.startswith("draft.") for label in args.state_labels[2])
    assert args.owners[:2] == [target, draft]


def test_hybrid_linear_routes_as_mamba():
    pool = MambaPool([8, 8], [5, 7, 9])
    args = KVArgs()
    setup_state_kv_args(args, pool)
    assert args.state_types == [StateType.MAMBA]
    assert (args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0]) == \
        tuple(pool.get_state_buf_infos())
    assert args.state_labels == [["mamba:0", "mamba:1", "mamba:2"]]
    assert args.mla_compression_ratios is None
    with pytest.raises(ValueError, match="hybrid-linear"):
        setup_state_kv_args(args, pool, MambaPool([8], [5]))


def test_dsa_routes_as_dsa_with_the_draft_appended():
    pool, draft = DSAPool([8], [4, 6]), DSAPool([8], [2])
    args = KVArgs()
    setup_state_kv_args(args, pool, draft)
    assert args.state_types == [StateType.DSA]
    assert args.state_data_ptrs[0] == pool.get_state_buf_infos().data_ptrs + draft.get_state_buf_infos().data_ptrs
    assert args.state_item_lens[0] == [4, 6, 2]
    assert args.state_labels[0] == ["dsa:0", "dsa:1", "draft.dsa:0"]
    with pytest.raises(ValueError, match="DSA pool"):
        setup_state_kv_args(args, pool, MambaPool([8], [5]))


def test_a_pool_without_state_sends_none_and_the_lists_are_reset():
    args = KVArgs()
    setup_state_kv_args(args, MambaPool([8], [5]))
    setup_state_kv_args(args, PlainPool())
    assert (args.state_types, args.state_data_ptrs, args.state_labels) == ([], [], [])
    assert args.mla_compression_ratios is None
    with pytest.raises(ValueError, match="without state"):
        setup_state_kv_args(args, PlainPool(), PlainPool())


@pytest.mark.parametrize("pp_size", [2, 3])
def test_pp_stage_labels_partition_the_full_pool(pp_size):
    """Each stage's regions name exactly its own layers; together the stages cover the decode pool once."""
    stages = [kv_args_of(p) for p in dsv4_pools(pp_size)]
    (full,) = [kv_args_of(p) for p in dsv4_pools(1)]
    lists = [lambda a: a.kv_labels] + [lambda a, c=c: a.state_labels[c] for c in range(len(full.state_types))]
    for labels_of in lists:
        seen = [label for a in stages for label in labels_of(a)]
        assert len(seen) == len(set(seen))
        assert sorted(seen) == sorted(labels_of(full))
    for a in stages:
        start, end = a.layers
        assert all(start <= int(label.rsplit(":", 1)[1]) < end for label in a.kv_labels + sum(a.state_labels, []))


def test_every_state_type_has_a_sender():
    assert set(planning.SENDERS) == set(StateType)


def test_a_state_type_without_a_sender_fails_before_anything_is_planned(monkeypatch):
    (pool,) = dsv4_pools(1)
    args = kv_args_of(pool)
    manifest = Manifest.of(args)
    request = {"kv_indices": [1], "state_indices": [[1], [1]]}
    assert planning.plan_room(manifest, manifest, args, [2], [[2], [2]], request)  # the real table plans it
    monkeypatch.delitem(planning.SENDERS, StateType.C128_STATE)
    with pytest.raises(TransferError, match="no sender for state type 'c128_state'"):
        planning.plan_room(manifest, manifest, args, [2], [[2], [2]], request)

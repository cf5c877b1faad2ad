"""The cross-rank MIN through torch.distributed (gloo, CPU, loopback): real processes, one per PP rank."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict

import pytest

from sparsekv.srt.model_executor.model_spec import ParallelSpec, ServerSpec, dsv4_preset
from sparsekv.srt.model_executor.pool_planner import gloo_min, plan_pipeline, plan_rank

CASES = {
    # world size -> (preset, server, per-rank budget); each spawn costs a torch import per process.
    2: ("dsv4-flash", ServerSpec(), 40 << 30),
    4: ("dsv4-pro", ServerSpec(max_running_requests=None, enable_hisparse=True, disaggregation_mode="decode",
                               disaggregation_decode_extra_slots=64), 120 << 30),
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        preset, server, budget = CASES[world_size]
        plan = plan_rank(dsv4_preset(preset), server, budget, ParallelSpec(world_size, rank), gloo_min)
        result = {"layers": list(plan.layers), "profiled": plan.profiled_tokens, "config": asdict(plan.config)}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_gloo_min_over_pp_ranks_matches_in_process_plan(world_size, tmp_path):
    import torch.multiprocessing as mp

    # fork: the children inherit the imported torch instead of importing it again (CPU only, no CUDA state).
    mp.start_processes(_rank_main, args=(world_size, _free_port(), str(tmp_path)), nprocs=world_size, join=True,
                       start_method="fork")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]

    preset, server, budget = CASES[world_size]
    expected = plan_pipeline(dsv4_preset(preset), server, budget, pp_size=world_size)
    assert len({g["profiled"] for g in got}) > 1  # the stages really disagree before the MIN
    for rank, (g, e) in enumerate(zip(got, expected.ranks)):
        assert g["layers"] == list(e.layers)
        assert g["profiled"] == e.profiled_tokens
        assert g["config"] == asdict(e.config), f"rank {rank}"
    assert got[0]["config"]["max_total_num_tokens"] == min(
        expected.agreed_tokens, *(r.profiled_tokens for r in expected.ranks)
    ) // server.page_size * server.page_size

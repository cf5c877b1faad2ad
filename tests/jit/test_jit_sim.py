"""The sim backend's own guarantees, on planted kernels (tests/jit/data/planted_sim.cuh): a shared-memory
race changes its result with SPARSEKV_SIM_SEED, and so does a race between blocks (the blocks run in an
order drawn from the seed), a partial-warp shuffle and a partial barrier are errors
naming kernel, block and thread, unwritten shared memory reads as the poison, launches over Hopper's
limits are refused naming the limit, and the warp operations mean what they mean in CUDA; and how
calls reach the sim build (SPARSEKV_CPU_BACKEND, a cache key of its own)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from sparsekv.jit_kernel.build import cache, loader
from sparsekv.jit_kernel.build.registry import backend_of
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS

HERE = Path(__file__).resolve().parent
PLANTED = "planted_sim.cuh"
KERNELS = ("Race", "BlockOrder", "PartialShuffle", "PartialBarrier", "Uninitialized", "WarpOps", "BlockShape",
           "DynamicSmem")
POISON = 0x7FA5A5A5  # cuda_sim::kPoisonWord


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The sim build of the planted kernels (the project's headers plus the planted one)."""
    root = tmp_path_factory.mktemp("planted-sim") / "csrc"
    shutil.copytree(loader.csrc_root(), root)
    shutil.copy(HERE / "data" / PLANTED, root / PLANTED)
    qualified = [f"sparsekv::planted_sim::{k}" for k in KERNELS]
    plan = loader.make_plan("planted_sim", (), header=PLANTED,
                            exports={k: f"sparsekv::planted_sim::run<{q}>" for k, q in zip(KERNELS, qualified)},
                            kernels=qualified, backend="sim", arch=None, probe_dir=None, csrc=root)
    return loader.find_or_build(plan, cache.open_roots())


def _race(module, seed, monkeypatch) -> list[int]:
    monkeypatch.setenv("SPARSEKV_SIM_SEED", str(seed))
    out = torch.full((4,), -1, dtype=torch.int32)
    module.Race(out, 0, 0)
    return out.tolist()


def test_a_shared_memory_race_changes_its_result_with_the_seed(planted, monkeypatch):
    results = {seed: _race(planted, seed, monkeypatch) for seed in range(6)}
    # Every block reads the index of whichever of its 256 threads stored last: a real thread index...
    assert all(0 <= v < 256 for r in results.values() for v in r)
    # ...that depends on the thread order the seed draws, and is the same again for the same seed.
    assert len({tuple(r) for r in results.values()}) > 1, results
    assert _race(planted, 3, monkeypatch) == results[3]


def _block_order(module, seed, monkeypatch) -> list[int]:
    monkeypatch.setenv("SPARSEKV_SIM_SEED", str(seed))
    out = torch.zeros(9, dtype=torch.int32)
    module.BlockOrder(out, 0, 0)
    assert out[0] == 8  # every block took one slot
    return out[1:].tolist()


def test_a_race_between_blocks_changes_its_result_with_the_seed(planted, monkeypatch):
    # A kernel whose result depends on the block order (as the hisparse swap-in's rows of one request
    # did, issue 23) can only be caught if the order varies: a seed sweep must see several orders,
    # each one a permutation of the 8 blocks, and the same seed the same order again.
    orders = {seed: _block_order(planted, seed, monkeypatch) for seed in range(8)}
    assert all(sorted(order) == list(range(8)) for order in orders.values()), orders
    assert len({tuple(order) for order in orders.values()}) > 1, orders
    assert _block_order(planted, 5, monkeypatch) == orders[5]


def test_a_partial_warp_shuffle_is_an_error_naming_kernel_block_and_thread(planted):
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(RuntimeError) as raised:
        planted.PartialShuffle(out, 0, 0)
    message = str(raised.value)
    assert "kernel `sparsekv::planted_sim::partial_shuffle_kernel`" in message
    assert "block (0, 0, 0), thread (" in message
    assert "__shfl_xor_sync(mask 0xffffffff) was reached by only 16 of the 32 lanes" in message
    assert "had exited" in message


def test_a_barrier_part_of_the_block_never_reaches_is_an_error(planted):
    with pytest.raises(RuntimeError, match=r"partial_barrier_kernel`, block \(0, 0, 0\), thread \(\d+, 0, 0\).*"
                                           r"__syncthreads\(\) was reached by only 32 of the 64 threads"):
        planted.PartialBarrier(torch.zeros(64, dtype=torch.int32), 0, 0)


def test_unwritten_shared_memory_reads_as_the_poison(planted):
    out = torch.zeros(128, dtype=torch.int32)
    planted.Uninitialized(out, 0, 0)
    assert out[:32].tolist() == list(range(32))  # written before the barrier
    assert (out[32:64] == POISON).all() and (out[64:] == POISON).all(), out  # static and dynamic: never written
    assert torch.isnan(out[32:].view(torch.float32)).all()  # as floats, NaN


LIMITS = [
    # (kernel, a, b, message)
    ("BlockShape", 1025, 1, r"blockDim \(1025, 1, 1\) has 1025 threads, over the limit of 1024 threads per block"),
    ("BlockShape", 32, 65536, r"gridDim.y = 65536 exceeds the limit of 65535"),
    ("DynamicSmem", 48 * 1024 + 1, 0, r"49153 bytes of dynamic shared memory exceed the limit of 49152 bytes "
                                      r"\(48 KiB\) without the opt-in attribute"),
    ("DynamicSmem", 227 * 1024 + 1, 1, r"over the limit of 232448 bytes \(227 KiB\) per block"),
]


@pytest.mark.parametrize("kernel, a, b, message", LIMITS, ids=["block", "grid-y", "smem-no-opt-in", "smem-227k"])
def test_a_launch_over_a_hopper_limit_is_refused_naming_the_limit(planted, kernel, a, b, message):
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        getattr(planted, kernel)(out, a, b)
    assert out.item() == 0  # nothing ran


@pytest.mark.parametrize("kernel, a, b", [("BlockShape", 1024, 65535), ("DynamicSmem", 227 * 1024, 1)],
                         ids=["at-the-grid-and-block-limits", "opted-in-227k"])
def test_a_launch_at_the_limits_runs(planted, kernel, a, b):
    out = torch.zeros(1, dtype=torch.int32)
    getattr(planted, kernel)(out, a, b)
    assert out.item() == 1


def test_warp_operations_mean_what_they_mean_in_cuda(planted):
    out = torch.zeros(10 * 64, dtype=torch.int32)
    planted.WarpOps(out, 0, 0)
    rows = out.view(10, 64)
    t = torch.arange(64, dtype=torch.int32)
    lane = t % 32
    base = t - lane
    assert torch.equal(rows[0], torch.where(lane >= 1, t - 1, t))  # up 1: lane 0 keeps its own
    assert torch.equal(rows[1], torch.where(lane + 2 <= 31, t + 2, t))  # down 2: the last two keep theirs
    assert torch.equal(rows[2], base + (lane & ~7) + 5)  # lane 5 of each 8-lane segment
    assert torch.equal(rows[3], base + (lane ^ 3))
    ballots = [sum(1 << lane for lane in range(32) if (w * 32 + lane) % 3 == 0) for w in (0, 1)]
    as_int32 = [b - (1 << 32) if b >= 1 << 31 else b for b in ballots]  # warp 1's has bit 31 set
    assert rows[4].tolist() == [as_int32[0]] * 32 + [as_int32[1]] * 32
    assert rows[5].tolist() == [0] * 32 + [1] * 32  # any: thread 40 is in the second warp
    assert rows[6].tolist() == [0] * 32 + [1] * 32  # all: thread 7 is in the first warp
    assert rows[7].tolist() == ([0xAAAA] * 16 + [-1] * 16) * 2  # a half-warp mask, odd lanes
    assert (rows[8] == 64).all()  # shared-memory atomicAdd by every thread, read after the barrier
    assert rows[9, 0].item() == 63  # global atomicMax


def test_sparsekv_cpu_backend_sim_routes_calls_on_cpu_tensors_to_the_sim_build(monkeypatch):
    cpu_tensor = torch.zeros(1)
    assert backend_of(cpu_tensor) == "cpu"
    monkeypatch.setenv("SPARSEKV_CPU_BACKEND", "sim")
    assert backend_of(cpu_tensor) == "sim"
    monkeypatch.setenv("SPARSEKV_CPU_BACKEND", "gpu")
    with pytest.raises(ValueError, match="SPARSEKV_CPU_BACKEND must be one of"):
        backend_of(cpu_tensor)


def test_the_cache_key_includes_the_backend_and_the_emulation_header():
    plans = {b: loader.make_plan("gather_rows", ("int32_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                                 kernels=GATHER_ROWS.kernels, backend=b, arch=None, probe_dir=None)
             for b in ("cpu", "sim")}
    assert plans["cpu"].entry_name() != plans["sim"].entry_name()
    assert plans["sim"].key_doc()["backend"] == "sim"
    assert loader.SIM_HEADER in plans["sim"].closure and loader.SIM_HEADER not in plans["cpu"].closure
    assert "kernels_sim.cpp" in plans["sim"].sources
    # A sim module's host side is built with SIM_HOST_FLAGS (-O1: CI time), so they are part of its key.
    assert plans["sim"].key_doc()["cxx_flags"] == [*loader.CXX_FLAGS, *loader.SIM_HOST_FLAGS]
    assert plans["cpu"].key_doc()["cxx_flags"] == list(loader.CXX_FLAGS)

"""The cuda backend without a GPU: every registered module compiles with nvcc for sm_90a and
sm_100a (a sample of each family by default, every instance under ``--slow``), and a cuda module
called on a machine without a driver raises one clear RuntimeError."""

from __future__ import annotations

import json

import pytest
import torch
from test_sass import SASS_TABLE  # the serving instances test_sass builds for both archs, under the same key

from sparsekv.cli import main
from sparsekv.cli.jit import instance_values
from sparsekv.jit_kernel.build import toolchain
from sparsekv.jit_kernel.build.registry import discover
from sparsekv.testing.components import gpu_only, needs


def _nvcc_available() -> str | None:
    try:
        toolchain.nvcc(None)
    except toolchain.ToolchainError as exc:
        return str(exc)
    return None


NO_NVCC = _nvcc_available()
needs_nvcc = needs("nvcc", NO_NVCC)
#: Per family, the ``--instance`` spec of the one test_sass builds (its first where it checks several).
SASS_BUILT = {module.partition(":")[0]: module for build, module, _ in reversed(SASS_TABLE) if build == "cuda"}


@needs_nvcc
@pytest.mark.parametrize("name", sorted(discover()))
def test_every_registered_family_compiles_for_sm90a_and_sm100a(name, request, capsys):
    """One family per test, so xdist spreads the nvcc builds. By default a sample of one instance: the
    one test_sass builds (the same cache entry: one nvcc build serves both tests), else the family's
    last table entry (the tables list their plain instances first); ``--slow`` builds every instance."""
    family = discover()[name]
    if request.config.getoption("--slow") or len(family.instances) == 1:
        selection, expected = [name], len(family.instances)
    else:
        values = instance_values(family, family.instances[-1])
        spec = SASS_BUILT.get(name, f"{name}:" + ",".join(f"{k}={v}" for k, v in values.items()))
        selection, expected = ["--instance", spec], 1
    # In this process (main() returns the exit code): the nvcc compiles are the cost, not an interpreter's start.
    code = main(["jit", "build", "--json", "--backend", "cuda", "--arch", "9.0a,10.0a", *selection])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-5000:]
    report = json.loads(out)
    # Built now, or found in the cache under the same content-addressed key (the same nvcc output).
    assert report["built"] + report["cached"] == len(report["entries"]) == expected, report


@needs_nvcc
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason=gpu_only("a GPU is present: the no-driver path cannot be shown here"))
def test_cuda_module_without_a_driver_raises_runtime_error():
    from sparsekv.jit_kernel.gather_rows import GATHER_ROWS

    module = GATHER_ROWS.module(index_dtype=torch.int64, backend="cuda", arch="9.0a")
    dst = torch.zeros(4, 8, dtype=torch.uint8)
    before = dst.clone()
    with pytest.raises(RuntimeError, match="CUDA runtime cannot run here"):
        module.gather_rows(dst, torch.tensor([0]), torch.ones(4, 8, dtype=torch.uint8), torch.tensor([1]))
    assert torch.equal(dst, before)


def test_missing_cuda_toolkit_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda-here"))
    monkeypatch.delenv("SPARSEKV_NVCC", raising=False)
    with pytest.raises(toolchain.ToolchainError, match="CUDA_HOME"):
        toolchain.nvcc(None)


def test_arch_comes_from_sparsekv_cuda_arch_then_tvm_ffi(monkeypatch):
    from sparsekv.jit_kernel.build.arch import resolve_arch_list

    monkeypatch.setenv("TVM_FFI_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("SPARSEKV_CUDA_ARCH", "10.0a")
    assert resolve_arch_list() == ("10.0a",)
    monkeypatch.delenv("SPARSEKV_CUDA_ARCH")
    assert resolve_arch_list() == ("9.0a",)
    assert resolve_arch_list("12.0") == ("12.0",)


@pytest.mark.gpu(count=2)
def test_a_launch_runs_on_the_tensors_gpu_and_leaves_the_current_device_alone():
    from sparsekv.jit_kernel.gather_rows import gather_rows

    torch.cuda.set_device(0)
    src = torch.arange(64, dtype=torch.uint8, device="cuda:1").view(8, 8)
    dst = torch.zeros(4, 8, dtype=torch.uint8, device="cuda:1")
    gather_rows(dst, torch.tensor([0, 3], device="cuda:1"), src, torch.tensor([5, 2], device="cuda:1"))
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.equal(dst[0].cpu(), src[5].cpu()) and torch.equal(dst[3].cpu(), src[2].cpu())
    assert bool((dst[1:3] == 0).all())

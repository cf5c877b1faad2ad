"""`sparsekv jit build` parallelism: bounded by cores and by free memory, container limits included;
SPARSEKV_MAX_JOBS and --jobs override. And `build --model` builds what the model's serving path loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparsekv.cli import jit as cli
from sparsekv.jit_kernel.build import resources
from sparsekv.jit_kernel.build.registry import discover
from sparsekv.srt.model_executor.deployment import model_instances

GIB = 1 << 30


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """A cgroup v2 tree with a memory limit and a CPU quota, as a container would have."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(resources, "_CGROUP", root)
    monkeypatch.setattr(resources, "_cgroup_dir", lambda: root)

    def limit(memory_max: int | str, memory_current: int, cpu_max: str = "max 100000") -> None:
        (root / "memory.max").write_text(f"{memory_max}\n")
        (root / "memory.current").write_text(f"{memory_current}\n")
        (root / "cpu.max").write_text(f"{cpu_max}\n")

    return limit


def test_jobs_are_bounded_by_the_container_memory(fake_cgroup, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("SPARSEKV_MAX_JOBS", raising=False)
    fake_cgroup(5 * GIB, GIB)  # 4 GiB of headroom
    assert resources.available_memory() <= 4 * GIB
    assert resources.build_jobs("cpu") == 4 * GIB // resources.COMPILE_BYTES["cpu"]
    assert resources.build_jobs("cuda") == 4 * GIB // resources.COMPILE_BYTES["cuda"]
    fake_cgroup(GIB + GIB // 2, GIB)  # less than one compile's worth: still one job
    assert resources.build_jobs("cuda") == 1


def test_jobs_are_bounded_by_the_cpu_quota(fake_cgroup, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("SPARSEKV_MAX_JOBS", raising=False)
    fake_cgroup("max", 0, cpu_max="300000 100000")  # 3 CPUs, no memory limit
    assert resources.available_cores() == 3
    by_memory = resources.available_memory() // resources.COMPILE_BYTES["cpu"]
    assert resources.build_jobs("cpu") == max(1, min(3, by_memory))


def test_explicit_jobs_override(monkeypatch):
    monkeypatch.setenv("SPARSEKV_MAX_JOBS", "7")
    assert resources.build_jobs("cpu") == 7
    assert resources.build_jobs("cpu", requested=2) == 2
    monkeypatch.setenv("SPARSEKV_MAX_JOBS", "zero")
    with pytest.raises(ValueError, match="SPARSEKV_MAX_JOBS"):
        resources.build_jobs("cpu")


def test_build_model_builds_the_serving_instances():
    """Uses the suite's shared cache: the kernel tests build these table entries too."""
    done = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "build", "--model", "dsv4-flash", "--json"],
                          capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    families = discover()
    expected = [cli.explain(families[name], cli.resolve_instance(families[name], values), "cpu", None)["entry"]
                for name, values in model_instances("dsv4-flash")]
    assert report["entries"] == expected and report["built"] + report["cached"] == len(expected)
    assert report["jobs"] >= 1
    # Every family the serving path loads, not only the HiSparse ones.
    assert {name for name, _ in model_instances("dsv4-flash")} == {
        "dsv4_compress", "dsv4_store", "dsv4_compress_store", "dsv4_quant", "dsv4_indexer", "dsv4_indexer_topk",
        "dsv4_attention", "hisparse", "hisparse_planned", "hisparse_copy"}
    again = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "build", "--model", "dsv4-flash", "--json"],
                           capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert json.loads(again.stdout)["built"] == 0 and json.loads(again.stdout)["cached"] == len(expected)

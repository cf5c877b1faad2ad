"""`sparsekv jit build` parallelism: bounded by cores and by free memory, container limits included;
SPARSEKV_MAX_JOBS and --jobs override. And `build --model` builds what the model's serving path loads."""

from __future__ import annotations

import json
import os

import pytest

from sparsekv.cli import jit as cli
from sparsekv.jit_kernel.build import resources
from sparsekv.jit_kernel.build.registry import discover
from sparsekv.srt.model_executor.deployment import model_instances

GIB = 1 << 30


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """A cgroup v2 tree with a memory limit and a CPU quota, as a container would have, on a host whose
    /proc/meminfo reports 64 GiB available and whose process may run on 16 cores."""
    root = tmp_path / "cgroup"
    root.mkdir()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {128 * GIB // 1024} kB\nMemAvailable:   {64 * GIB // 1024} kB\n")
    monkeypatch.setattr(resources, "_CGROUP", root)
    monkeypatch.setattr(resources, "_MEMINFO", meminfo)
    monkeypatch.setattr(resources, "_cgroup_dir", lambda: root)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))

    def limit(memory_max: int | str, memory_current: int, cpu_max: str = "max 100000") -> None:
        (root / "memory.max").write_text(f"{memory_max}\n")
        (root / "memory.current").write_text(f"{memory_current}\n")
        (root / "cpu.max").write_text(f"{cpu_max}\n")

    return limit


def test_the_container_limits_bound_the_memory_and_cores(fake_cgroup):
    fake_cgroup(5 * GIB, GIB, cpu_max="300000 100000")  # 4 GiB of headroom, 3 CPUs
    assert resources.available_memory() == 4 * GIB
    assert resources.available_cores() == 3
    fake_cgroup("max", GIB)  # no limits: the host's
    assert resources.available_memory() == 64 * GIB
    assert resources.available_cores() == 16


def test_jobs_are_bounded_by_the_container_memory(monkeypatch):
    monkeypatch.delenv("SPARSEKV_MAX_JOBS", raising=False)
    assert resources.build_jobs("cpu", cores=16, memory=4 * GIB) == 4 * GIB // resources.COMPILE_BYTES["cpu"] == 4
    assert resources.build_jobs("cuda", cores=16, memory=4 * GIB) == 4 * GIB // resources.COMPILE_BYTES["cuda"] == 2
    # Less than one compile's worth: still one job.
    assert resources.build_jobs("cuda", cores=16, memory=GIB // 2) == 1


def test_jobs_are_bounded_by_the_cpu_quota(monkeypatch):
    monkeypatch.delenv("SPARSEKV_MAX_JOBS", raising=False)
    assert resources.build_jobs("cpu", cores=3, memory=64 * GIB) == 3
    assert resources.build_jobs("cpu", cores=1, memory=64 * GIB) == 1


def test_explicit_jobs_override(monkeypatch):
    monkeypatch.setenv("SPARSEKV_MAX_JOBS", "7")
    assert resources.build_jobs("cpu") == 7
    assert resources.build_jobs("cpu", requested=2) == 2
    assert resources.build_jobs("cpu", requested=2, cores=16, memory=64 * GIB) == 2
    monkeypatch.setenv("SPARSEKV_MAX_JOBS", "zero")
    with pytest.raises(ValueError, match="SPARSEKV_MAX_JOBS"):
        resources.build_jobs("cpu")


@pytest.mark.parametrize("model", ["demo", pytest.param("dsv4-flash", marks=pytest.mark.slow)])
def test_build_model_builds_the_serving_instances(model, sparsekv_cli):
    """In the suite's cache, whatever it holds (built + cached counts both). By default the demo's model:
    ``sparsekv demo`` (the README's ``make demo`` block, ``tests/test_demo.py``) loads these very entries,
    so the suite compiles them once; ``--slow`` also builds a real preset's (dsv4-flash: another dozen
    compiles). Which families each model's serving path loads is checked for every model, compiling nothing."""
    suite_cache = os.environ["SPARSEKV_CACHE_DIR"]  # the suite's: what the demo tests load
    done = sparsekv_cli("jit", "build", "--model", model, "--json", cache_dir=suite_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    families = discover()
    expected = [cli.explain(families[name], cli.resolve_instance(families[name], values), "cpu", None)["entry"]
                for name, values in model_instances(model)]
    assert report["entries"] == expected and report["built"] + report["cached"] == len(expected)
    assert report["jobs"] >= 1
    # Every family the serving path loads, not only the HiSparse ones: each DSV4 family, and HiSparse's.
    for each in ("demo", "dsv4-flash", "dsv4-pro"):
        served = {name for name, _ in model_instances(each)}
        assert served <= set(families) and {name for name in families if name.startswith("dsv4_")} <= served, each
        assert any(families[name].stem.startswith("hisparse") for name in served), each
    again = sparsekv_cli("jit", "build", "--model", model, "--json", cache_dir=suite_cache)
    assert json.loads(again.stdout)["built"] == 0 and json.loads(again.stdout)["cached"] == len(expected)

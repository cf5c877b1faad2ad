"""`make gpu-check DRY_RUN=1`: the one-call GPU verification lists its steps and checks its own
plumbing (named tests exist, benchmarks take the flags it passes, the summary writes) without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build.registry import discover
from sparsekv.testing.bench import takes_backend

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def gpu_check(monkeypatch):
    """tools/gpu_check.py as a module (tools/ is not a package); registered, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_plans_every_step_and_finds_its_tests_and_benchmarks(gpu_check, tmp_path):
    done = subprocess.run(["make", "-s", "gpu-check", "DRY_RUN=1", f"GPU_CHECK_OUT={tmp_path}",
                           f"GPU_CHECK_PYTHON={sys.executable}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    names = [s["name"] for s in summary["steps"]]
    assert names[:6] == ["probe", "install tvm-ffi", "install sparsekv", "build cuda modules", "build cpu modules",
                         "graph capture"]
    assert names[-1] == "kernel tests cuda"
    assert [n for n in names if n.startswith(("memcheck", "racecheck"))] == [
        f"{tool} (one case per family)" for tool in gpu_check.SANITIZER_TOOLS]
    # FlashMLA beside our attention only where this checkout holds the built peer library.
    assert [n for n in names if n.startswith("bench ")] == [
        "bench " + b[len("bench_"):-len(".py")] for b in gpu_check.KERNEL_BENCHMARKS] + (
        ["bench dsv4_attention vs flashmla"] if gpu_check.PEER_LIBRARY.is_file() else [])
    assert {s["status"] for s in summary["steps"]} == {"planned"}
    assert (tmp_path / "summary.md").read_text().startswith("# sparsekv gpu-check on dry run")
    # The lists come from the families: the stems it reads from csrc/ are the registered ones, every
    # family has its sanitizer case, and every benchmark that takes a backend is run.
    assert gpu_check.KERNEL_STEMS == sorted({family.stem for family in discover().values()})
    assert sorted(gpu_check.SANITIZER_CASES) == gpu_check.KERNEL_STEMS
    timed = {p.name for p in (REPO / "tools" / "bench").glob("bench_*.py") if takes_backend(p.read_text())}
    assert timed == set(gpu_check.KERNEL_BENCHMARKS)


def test_the_dry_run_reports_a_missing_test(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check.SANITIZER_CASES, "gather_rows", "tests/kernels/test_gather_rows.py::test_gone")
    monkeypatch.setattr(gpu_check, "KERNEL_BENCHMARKS", ())
    assert gpu_check.check_plumbing([], tmp_path) == ["tests/kernels/test_gather_rows.py has no test test_gone"]


def test_the_dry_run_reports_a_family_without_its_sanitizer_case(gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "KERNEL_STEMS", [*gpu_check.KERNEL_STEMS, "new_family"])
    monkeypatch.setattr(gpu_check, "KERNEL_BENCHMARKS", ())
    assert gpu_check.check_plumbing([], tmp_path) == [
        "tests/kernels/test_new_family.py marks 0 tests @pytest.mark.sanitizer_case; one per family"]


def test_the_summary_puts_each_kernel_time_beside_its_roofline(gpu_check, tmp_path):
    from sparsekv.testing import roofline

    cost = roofline.compress_store(4096, 4)  # 7.115 us on an H200
    measured = {"case": "fused C4 T=4k", "kernel_ms": 0.0213, "kernel_us": 21.3, "kernel_eager_us": 95.0,
                "kernel_method": "CUDA-graph replay of 100 calls", **roofline.fields(cost, 21.3e-6, "NVIDIA H200")}
    on_cpu = {"case": "fused C128 T=4k", "kernel_ms": 40.0, **roofline.fields(cost, 40e-3, "cpu")}
    result = {"name": "dsv4_compress_store", "rows": [measured, on_cpu, {"case": "op overhead", "raw_us": 2.0}]}
    (tmp_path / "bench_dsv4_compress_store.json").write_text(json.dumps(result))
    step = gpu_check.Step("bench dsv4_compress_store", ["python", "bench",
                                                        str(tmp_path / "bench_dsv4_compress_store.json")], 1,
                          status="pass", seconds=2.0)
    doc = gpu_check.write_summary([step], tmp_path, "test")
    assert doc["passed"] and doc["benchmarks"]["dsv4_compress_store"] == result
    rows = doc["roofline"]["dsv4_compress_store"]
    assert [r["case"] for r in rows] == ["fused C4 T=4k", "fused C128 T=4k"]  # rows without a roofline left out
    assert rows[0]["measured_over_roofline"] == round(21.3 / 7.1151, 2) and rows[0]["roofline_us"] == 7.115
    assert rows[1]["device_us"] == 40000.0 and rows[1]["measured_over_roofline"] is None
    text = (tmp_path / "summary.md").read_text()
    assert "| fused C4 T=4k | 21.3 | 95 | 7.115 (H200) | 2.99 | CUDA-graph replay of 100 calls |" in text
    assert "| fused C128 T=4k | 4e+04 | - | 7.115 (H200, on paper) | - | - |" in text


def test_a_step_gets_what_is_left_of_the_budget(gpu_check, tmp_path):
    late = gpu_check.Step("late", [sys.executable, "-c", "print('ran')"], 60)
    gpu_check.run_step(late, tmp_path, left_s=5)
    assert (late.status, late.detail) == ("not run", "budget spent")
    slow = gpu_check.Step("slow", [sys.executable, "-c", "import time; time.sleep(30)"], 60)
    gpu_check.run_step(slow, tmp_path, left_s=11)
    assert slow.status == "fail" and slow.detail.startswith("over its 11 s limit")
    doc = gpu_check.write_summary([slow, late], tmp_path, "test")
    assert (doc["passed"], doc["complete"]) == (False, False)


def test_failures_now_prints_a_traceback_before_the_run_ends(pytester):
    # gpu-check's kernel suite may be cut by its budget: each failure must be in the log when it happens.
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_planted="def test_planted():\n    assert 6 * 7 == 43, 'planted failure'\n\n"
                                     "def test_later():\n    pass\n")
    result = pytester.runpytest_subprocess("--failures-now", "-p", "no:cacheprovider", "-q")
    out = result.stdout.str()
    assert "--- FAILED test_planted.py::test_planted (call)" in out
    assert out.index("planted failure") < out.index("= FAILURES =")


def test_the_flashmla_peer_step_runs_exactly_where_its_library_is(gpu_check, tmp_path):
    library = tmp_path / "libsparsekv_flashmla.so"
    without = gpu_check.plan("python3", tmp_path, tmp_path, 2, peer_library=library)
    library.write_bytes(b"")
    with_peer = gpu_check.plan("python3", tmp_path, tmp_path, 2, peer_library=library)
    added = [s for s in with_peer if s.name not in {t.name for t in without}]
    assert [s.name for s in added] == ["bench dsv4_attention vs flashmla"]
    command = added[0].command
    assert command[command.index("--peer") + 1] == f"flashmla={library}"
    assert command[command.index("--backend") + 1] == "cuda"

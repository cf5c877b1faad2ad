"""SPARSEKV_REQUIRE_ALL=1 turns the skip of a test whose optional component is missing into a failure
with the same reason (CI sets it in .ci/run); without it such a test skips."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

TESTS = """
from sparsekv.testing.components import component_missing, needs

@needs("Engine", "it is not installed")
def test_marked():
    pass

@needs("Engine", None)
def test_present():
    pass

def test_asked_at_run_time():
    component_missing("Engine", "it went away")
"""


def test_a_missing_component_skips_and_fails_under_require_all(pytester, monkeypatch):
    pytester.makepyfile(TESTS)
    args = ("-p", "sparsekv.testing.components", "-p", "no:xdist", "-p", "no:cacheprovider", "-rsf")
    monkeypatch.delenv("SPARSEKV_REQUIRE_ALL", raising=False)
    relaxed = pytester.runpytest(*args)
    relaxed.assert_outcomes(passed=1, skipped=2)
    relaxed.stdout.fnmatch_lines(["*Engine is missing: it is not installed*", "*Engine is missing: it went away*"])
    monkeypatch.setenv("SPARSEKV_REQUIRE_ALL", "1")
    strict = pytester.runpytest(*args)
    strict.assert_outcomes(passed=1, failed=1, errors=1)  # a mark fails at setup: an error
    strict.stdout.fnmatch_lines(["*Engine is missing and SPARSEKV_REQUIRE_ALL=1 requires it: it is not installed*",
                                 "*Engine is missing and SPARSEKV_REQUIRE_ALL=1 requires it: it went away*"])


def test_ci_requires_every_component():
    ci = (REPO / ".ci" / "run").read_text()
    assert "export SPARSEKV_REQUIRE_ALL=1" in ci and "make test\n" in ci and "make test-sanitize-sim\n" in ci
    # and the demos the default profile leaves out (on sim, and with the Triton twins), in the sim stage
    assert "make test-sim-and-demos PYTEST_ARGS='-m \"not core\"'\n" in ci


def test_every_test_the_sanitized_sim_stage_names_exists():
    # make test-sanitize-sim names its HiSparse tests by node id, and a name pytest cannot find ends that
    # stage with an error: make test finds a rename first, here.
    makefile = (REPO / "Makefile").read_text()
    hisparse = re.search(r"^HISPARSE_TESTS := (\S+)$", makefile, re.M).group(1)
    names = re.findall(r"\$\(HISPARSE_TESTS\)::(\w+)", makefile)
    source = (REPO / hisparse).read_text()
    assert names and all(re.search(rf"^def {name}\(", source, re.M) for name in names), names
    for path in re.search(r"^SANITIZE_SIM_TESTS \?= (.*?)\n(?!\t)", makefile, re.M | re.S).group(1).split():
        assert path.startswith("$(HISPARSE_TESTS)::") or (REPO / path.rstrip("\\")).is_file() or path == "\\", path


def test_a_slow_test_named_by_node_id_runs_without_slow():
    # CI's sim stage names the two slow demo tests (the Makefile's DEMO_TESTS): without --slow they run,
    # and a slow test the command line does not name stays deselected.
    makefile = (REPO / "Makefile").read_text()
    demos = re.search(r"^DEMO_TESTS := (.*?)\n(?!\t)", makefile, re.M | re.S).group(1).replace("\\\n", " ").split()
    assert len(demos) == 2 and all(demo.startswith("tests/test_demo.py::") for demo in demos), demos
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           "-p", "no:xdist", demos[0], "tests/test_demo.py"], capture_output=True, text=True, cwd=REPO,
                           timeout=300)
    collected = {line for line in done.stdout.splitlines() if "::" in line}
    assert done.returncode == 0 and demos[0] in collected and demos[1] not in collected, done.stdout[-2000:]


SKIPS = """
import pytest

from sparsekv.testing.components import gpu_only, skip_for_gpu

def test_gpu():
    skip_for_gpu("needs the cuda backend")

@pytest.mark.skipif(True, reason=gpu_only("a GPU is visible"))
def test_gpu_mark():
    pass

def test_runs():
    pass
"""
PLAIN_SKIPS = """
import pytest

def test_plain_skip():
    pytest.skip("the engine is not here")

@pytest.mark.skipif(True, reason="the engine is not here either")
def test_plain_mark():
    pass
"""


def test_under_require_all_a_run_lists_its_skips_and_fails_on_any_but_a_gpu_one(pytester, monkeypatch):
    """The meta-test of CI's skips: under SPARSEKV_REQUIRE_ALL=1 every run lists its skips at the end, and
    one that skipped for any reason but a GPU fails (under xdist too: the controller keeps the list), so
    CI, with every optional component present, has no skip but the GPU ones."""
    pytester.makepyfile(test_gpu=SKIPS)
    args = ("-p", "sparsekv.testing.components", "-p", "no:cacheprovider")
    monkeypatch.setenv("SPARSEKV_REQUIRE_ALL", "1")
    allowed = pytester.runpytest(*args, "-p", "no:xdist")
    allowed.assert_outcomes(passed=1, skipped=2)
    assert allowed.ret == 0
    allowed.stdout.fnmatch_lines(["*allowed: test_gpu.py::test_gpu: gpu only: needs the cuda backend*"])
    pytester.makepyfile(test_plain=PLAIN_SKIPS, test_module="import pytest\n\npytest.importorskip('no_such_module')\n")
    for run in (pytester.runpytest(*args, "-p", "no:xdist"), pytester.runpytest_subprocess(*args, "-n", "2")):
        run.assert_outcomes(passed=1, skipped=5)
        assert run.ret == pytest.ExitCode.TESTS_FAILED
        run.stdout.fnmatch_lines_random([
            "*NOT ALLOWED: test_plain.py::test_plain_skip: the engine is not here",
            "*NOT ALLOWED: test_plain.py::test_plain_mark: the engine is not here either",
            "*NOT ALLOWED: test_module.py: could not import 'no_such_module'*",
            "*allowed: test_gpu.py::test_gpu_mark: gpu only: a GPU is visible"])
    monkeypatch.delenv("SPARSEKV_REQUIRE_ALL")
    relaxed = pytester.runpytest(*args, "-p", "no:xdist")
    assert relaxed.ret == 0 and "NOT ALLOWED" not in relaxed.stdout.str()


# Run in place of every test's setup after the skip marks and needs(...) were looked at: nothing is set up
# and no body runs, so a whole directory's skip decisions take seconds.
DECISIONS_ONLY = """
import pytest

def pytest_runtest_setup(item):
    pytest.xfail("decided to run")
"""


@pytest.mark.parametrize("component, modules, nodes", [
    ("NIXL/UCX", ["nixl", "nixl_cu12", "nixl_cu13"],
     ["test_pd_protocol.py::", "test_pd_stress.py::test_pp_and_hisparse_sessions_arrive_byte_for_byte_under_load[nixl]",
      "test_demo.py::test_tiny_demo_over_pd_equals_the_single_process_run", "test_pd_sender_receiver.py::",
      "test_pd_nixl.py::", "test_pd_engines.py::test_decode_killed_mid_transfer_fails_the_transfer_on_prefill[nixl]"]),
    ("Mooncake TE/TCP", ["mooncake"],
     ["test_pd_stress.py::test_pp_and_hisparse_sessions_arrive_byte_for_byte_under_load[mooncake]",
      "test_pd_mooncake.py::",
      "test_pd_engines.py::test_decode_killed_mid_transfer_fails_the_transfer_on_prefill[mooncake]"]),
])
def test_ci_fails_where_a_transfer_engine_is_hidden(component, modules, nodes, tmp_path):
    """With ``component`` made unimportable, every test that needs it fails under SPARSEKV_REQUIRE_ALL=1 (CI)
    and none skips: the PD tests and the demo over PD, whose plain skips once hid a missing NIXL."""
    for name in modules:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is hidden by the test')\n")
    (tmp_path / "decisions_only.py").write_text(DECISIONS_ONLY)
    env = dict(os.environ, SPARSEKV_REQUIRE_ALL="1", COLUMNS="100000",  # summary lines are not cut short
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-p",
                           "decisions_only", "-q", "-rE", "tests/pd", "tests/test_demo.py"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, out[-3000:] + done.stderr[-3000:]
    assert " skipped" not in out.splitlines()[-1], out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("ERROR ")]
    assert failed and all(f"{component} is missing and SPARSEKV_REQUIRE_ALL=1 requires it" in line
                          for line in failed), failed
    for node in nodes:
        assert any(node in line for line in failed), (node, failed)

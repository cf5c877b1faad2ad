"""Every kernel test runs on every backend, checked on the ids pytest collects (so it is verified
on a machine without a GPU): forcing ``cpu,cuda,sim`` collects each kernel test once per backend, every
registered kernel family has a backend-parametrized test file sharing its header's stem, and every
kernel test's body uses its ``backend`` (a test that takes no notice of it would run its cuda copy on
CPU tensors) unless it is marked ``no_backend`` with the reason."""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

from sparsekv.jit_kernel.build.registry import discover
from sparsekv.testing.bench import takes_backend

REPO = Path(__file__).resolve().parent.parent
KERNEL_TESTS = REPO / "tests" / "kernels"


@functools.cache
def _collect(backends: str) -> list[str]:
    env = dict(os.environ, SPARSEKV_TEST_BACKENDS=backends)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                           str(KERNEL_TESTS.relative_to(REPO))], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def _on(backend: str, test_id: str) -> str:
    """``test_id`` with its backend parameter replaced by ``backend``."""
    name, _, params = test_id.partition("[")
    parts = params.rstrip("]").split("-")
    assert "cpu" in parts, f"{test_id} is not parametrized by backend"
    return f"{name}[{'-'.join(backend if p == 'cpu' else p for p in parts)}]"


def test_forcing_cpu_and_other_backends_collects_every_kernel_test_once_per_backend():
    """One collection with every backend forced (``cpu,cuda,sim``) against the cpu one: each kernel
    test is there once per backend (a collection of ``tests/kernels`` costs seconds, so two, not four)."""
    cpu = _collect("cpu")
    every = _collect("cpu,cuda,sim")
    assert cpu, "no kernel tests collected"
    assert all("[" in test_id for test_id in cpu), [t for t in cpu if "[" not in t]
    assert sorted(every) == sorted(cpu + [_on(other, t) for other in ("cuda", "sim") for t in cpu])


def test_every_registered_family_has_a_backend_parametrized_test_file():
    collected = _collect("cpu")
    stems = {family.stem for family in discover().values()}
    for stem in sorted(stems):
        path = f"tests/kernels/test_{stem}.py::"
        ids = [t for t in collected if t.startswith(path)]
        assert ids, f"kernel family header {stem}.cuh has no backend-parametrized tests in {path[:-2]}"


def test_every_kernel_stem_has_its_benchmark():
    """A kernel family's header, wrapper, tests and benchmark share its stem (CONTRIBUTING.md, "Layout")."""
    stems = {family.stem for family in discover().values()}
    missing = sorted(f"tools/bench/bench_{stem}.py" for stem in stems
                     if not (REPO / "tools" / "bench" / f"bench_{stem}.py").is_file())
    assert not missing, f"kernel stems without a benchmark: {missing}"


def test_every_family_is_named_under_its_stem():
    """A header registers one family named like it, or more named ``<stem>_<what>`` (``dsv4_indexer_topk``
    and ``hisparse_planned`` select their instances by other template values than their header's first
    family), so a family name always says which header, wrapper, tests and benchmark are its own."""
    for name, family in sorted(discover().items()):
        stem = family.stem
        assert name == stem or name.startswith(stem + "_"), f"family {name} lives in {family.header}"
        assert f'name="{name}"' in (REPO / "jit_kernel" / f"{stem}.py").read_text(), \
            f"family {name} is not registered by its stem's wrapper jit_kernel/{stem}.py"


def _no_backend_reason(decorators: list[ast.expr]) -> str | None:
    """The reason of a ``pytest.mark.no_backend("...")`` among ``decorators`` (or a ``pytestmark`` value)."""
    for node in decorators:
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.no_backend" and node.args
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).strip()):
            return node.args[0].value
    return None


def _backend_use(path: Path) -> dict[str, tuple[bool, str | None]]:
    """Each test function of ``path``: whether its body reads ``backend``, and its ``no_backend`` reason."""
    tree = ast.parse(path.read_text())
    module_marks = [node.value for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)]
    module_reason = _no_backend_reason(module_marks)
    uses = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            reads = any(isinstance(n, ast.Name) and n.id == "backend" for stmt in node.body for n in ast.walk(stmt))
            uses[node.name] = (reads, _no_backend_reason(node.decorator_list) or module_reason)
    return uses


def test_every_kernel_test_body_uses_its_backend_or_says_why_not():
    ignoring, marked_but_reading = [], []
    for path in sorted(KERNEL_TESTS.glob("test_*.py")):
        for name, (reads, reason) in _backend_use(path).items():
            if not reads and reason is None:
                ignoring.append(f"{path.name}::{name}")
            if reads and reason is not None:
                marked_but_reading.append(f"{path.name}::{name}")
    assert not ignoring, f"these kernel tests never use `backend` (put their tensors on device_of(backend)): {ignoring}"
    assert not marked_but_reading, f"marked no_backend, yet they use `backend`: {marked_but_reading}"


#: Benchmarks that import a kernel wrapper without timing its kernels, and why.
NOT_KERNEL_BENCHMARKS = {"bench_jit_loader.py": "times builds and loads (cpu and cuda builds both), not kernels",
                         "bench_host_cost.py": "times the public calls' host side with every module export a "
                                               "no-op: no kernel runs, on any backend",
                         "bench_sass_budget.py": "reads the compiled SASS of each hot kernel (nvcc and the Triton "
                                                 "AOT build): no kernel runs, on any backend"}


def test_every_kernel_benchmark_takes_a_backend():
    # A benchmark that times a kernel family's module (it imports a family wrapper) must be able
    # to run it on the GPU too: `--backend cuda`, timed with CUDA events.
    wrappers = {family.stem for family in discover().values()} | {"dsv4"}  # dsv4: the re-exports
    for bench in sorted((REPO / "tools" / "bench").glob("bench_*.py")):
        text = bench.read_text()
        used = sorted(w for w in wrappers if re.search(rf"from sparsekv\.jit_kernel\.{w} import", text))
        if used and bench.name not in NOT_KERNEL_BENCHMARKS:
            assert takes_backend(text), f"{bench.name} times {used} but takes no --backend"


def test_every_benchmark_says_the_threads_of_each_side():
    # sparsekv.testing.bench.report refuses a result without them; this finds a benchmark that would
    # only fail when run. open_sweep (and kernel_sweep, built on it) fills them itself.
    for bench in sorted((REPO / "tools" / "bench").glob("bench_*.py")):
        tree = ast.parse(bench.read_text())
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
        if any(call.func.id in ("kernel_sweep", "open_sweep") for call in calls):
            continue
        results = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Name) and node.func.id == "BenchResult"]
        assert results, f"{bench.name} builds no BenchResult"
        for call in results:
            threads = next((k.value for k in call.keywords if k.arg == "threads"), None)
            assert isinstance(threads, ast.Dict), f"{bench.name}: BenchResult(threads={{'ours': ..., 'baseline': ...}})"
            assert {k.value for k in threads.keys if isinstance(k, ast.Constant)} >= {"ours", "baseline"}, bench.name

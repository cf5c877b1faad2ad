"""Test configuration: hypothesis profiles (`--slow` for deep runs) and a per-checkout JIT cache."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import settings

from sparsekv.testing.profiles import default_profile, register_profiles

REPO = Path(__file__).resolve().parent.parent
# needs(...) marks: skip where an optional component is missing, fail under SPARSEKV_REQUIRE_ALL=1.
pytest_plugins = ["pytester", "sparsekv.testing.components"]

# A small default keeps `make test` within minutes on 2 cores (smaller under the sanitizers); `--slow` digs deeper.
register_profiles()

# Tests build into a cache inside the checkout unless the caller chose one (kept warm across runs).
os.environ.setdefault("SPARSEKV_CACHE_DIR", str(REPO / ".cache" / "jit"))


def _interpret_triton_without_cuda() -> None:
    # Triton reads TRITON_INTERPRET when a kernel is decorated, so it is decided once per process,
    # before any test imports triton: a session without the cuda backend runs the Triton kernels on
    # CPU tensors under the interpreter; a session with it runs them on the GPU.
    from sparsekv.testing.backends import kernel_backends

    if "cuda" not in kernel_backends():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_cuda()


@pytest.fixture
def sparsekv_cli(capsys):
    """``sparsekv_cli(*args, cache_dir=..., **env)``: the ``sparsekv`` command run in this process against
    the cache root ``cache_dir`` (None: no root configured) with the extra environment ``env`` for that
    call, as a ``CompletedProcess`` of its exit code (``main`` returns it) and output. A subprocess
    would start Python and torch per call; a test of the console script itself, of a pipe, or of what
    a process decides once (``$TMPDIR``) runs ``python -m sparsekv`` instead. The logging setup the
    command makes (its handler, its levels) is undone after each call: later tests see none of it."""
    import logging

    from sparsekv import log
    from sparsekv.cli import main

    def run(*args: str, cache_dir: Path | None, **env: str) -> subprocess.CompletedProcess:
        ours, jit = logging.getLogger(log.LOGGER_NAME), logging.getLogger(log.JIT_LOGGER_NAME)
        levels, handlers = (ours.level, jit.level), list(ours.handlers)
        with pytest.MonkeyPatch.context() as patch:
            if cache_dir is None:
                patch.delenv("SPARSEKV_CACHE_DIR", raising=False)
            else:
                patch.setenv("SPARSEKV_CACHE_DIR", str(cache_dir))
            for name, value in env.items():
                patch.setenv(name, value)
            capsys.readouterr()
            try:
                code = main(list(args))
            finally:
                ours.setLevel(levels[0])
                jit.setLevel(levels[1])
                ours.handlers[:] = handlers
            out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, out, err)

    return run


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run slow tests and the deep hypothesis profile")
    parser.addoption("--failures-now", action="store_true",
                     help="print each failure's traceback when it happens, not at the end (a run cut short, as on a "
                          "GPU lent for minutes, still says why its tests failed)")


_failures_now = None  # the pytest config, under --failures-now


def pytest_runtest_logreport(report):
    # Under xdist this runs in the controller for every worker's report, so the output is in order.
    if _failures_now is not None and report.failed:
        terminal = _failures_now.pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\n--- FAILED {report.nodeid} ({report.when})")
        terminal.write_line(str(report.longrepr))
        terminal.flush()  # a run killed at its time limit keeps what it printed


def pytest_configure(config):
    global _failures_now
    if config.getoption("--failures-now"):
        _failures_now = config
    config.addinivalue_line("markers", "no_backend(reason): a kernel test whose body does not depend on the backend")
    settings.load_profile(default_profile(config.getoption("--slow")))


def _named_tests(config) -> set[str]:
    """The tests the command line names by node id (``path::name``, parameters dropped), as node ids."""
    named = set()
    for arg in config.args:
        path, sep, name = arg.partition("::")
        if sep:
            full = (config.invocation_params.dir / path).resolve()
            if full.is_relative_to(config.rootpath):
                named.add(f"{full.relative_to(config.rootpath).as_posix()}::{name.split('[')[0]}")
    return named


def pytest_collection_modifyitems(config, items):
    # Without --slow, slow tests are deselected rather than skipped: the skips of a CI run are only the
    # GPU ones (sparsekv.testing.components). A slow test named by node id runs: `make test-demos` names
    # its two, and CI runs them in its sim stage's session (Makefile: test-sim-and-demos).
    if config.getoption("--slow"):
        return
    named = _named_tests(config)
    slow, kept = [], []
    for item in items:
        (slow if "slow" in item.keywords and item.nodeid.split("[")[0] not in named else kept).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = kept


def pytest_runtest_setup(item):
    gpu = item.get_closest_marker("gpu")
    if gpu is not None:
        import torch

        from sparsekv.testing.components import skip_for_gpu

        need = gpu.kwargs.get("count", 1)
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < need:
            skip_for_gpu(f"needs {need} CUDA GPU{'s' if need > 1 else ''}, {have} visible")
    # A backend that was asked for (SPARSEKV_TEST_BACKENDS) but cannot run here fails with the
    # reason, rather than vanishing from the run or breaking collection.
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("backend") if callspec else None
    if backend is not None:
        from sparsekv.testing.backends import unavailable_reason

        reason = unavailable_reason(backend)
        if reason:
            import pytest

            pytest.fail(reason, pytrace=False)

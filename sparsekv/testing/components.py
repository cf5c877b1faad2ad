"""Tests that need an optional component (NIXL, Mooncake, nvcc, libasan, a read-only directory).

Where the component is missing such a test skips with the reason; under ``SPARSEKV_REQUIRE_ALL=1``
(set by CI's ``.ci/run``) it fails with the same reason instead, so a component that went missing
(a failed download, a broken install) cannot hide behind a skip.

Under ``SPARSEKV_REQUIRE_ALL=1`` the run also lists every test that skipped and fails if any did for
a reason other than a GPU (:func:`gpu_only`): the one skip CI's machine may take is the one it
cannot avoid, so a plain ``skipif`` or ``pytest.skip`` that bypasses :func:`needs` fails CI too.

This module is also the pytest plugin that acts on :func:`needs` marks and keeps that list
(``tests/conftest.py`` loads it with ``pytest_plugins``).
"""

from __future__ import annotations

from typing import NoReturn

import pytest

from sparsekv import env

GPU_ONLY = "gpu only: "


def component_missing(component: str, reason: str) -> NoReturn:
    """Skip the running test because ``component`` is missing, or fail it under ``SPARSEKV_REQUIRE_ALL=1``."""
    if env.require_all():
        pytest.fail(f"{component} is missing and SPARSEKV_REQUIRE_ALL=1 requires it: {reason}", pytrace=False)
    pytest.skip(f"{component} is missing: {reason}")


def needs(component: str, missing: str | None) -> pytest.MarkDecorator:
    """A mark for tests that need ``component``; ``missing`` is why it is unavailable (None: it is here).

    Before each test so marked, this plugin calls :func:`component_missing` where ``missing`` is set.
    """
    return pytest.mark.needs_component(component, missing)


def needs_engine(engine: str) -> pytest.MarkDecorator:
    """:func:`needs` for a PD transfer engine of :data:`~sparsekv.srt.disaggregation.engines.ENGINES`
    (its extra and any system library it links), whether it imports decided now."""
    from sparsekv.srt.disaggregation.engines import find_engine

    row = find_engine(engine)
    try:
        row.load()
    except ImportError as e:
        return needs(row.label, f"{row.label} cannot be imported: {e}")
    return needs(row.label, None)


def gpu_only(reason: str) -> str:
    """The reason of a skip decided by a GPU being there or not (the one kind CI may take)."""
    return GPU_ONLY + reason


def skip_for_gpu(reason: str) -> NoReturn:
    """Skip the running test for a reason :func:`gpu_only` names (it needs the cuda backend, or the absence of
    a GPU)."""
    pytest.skip(gpu_only(reason))


def skip_reason(report) -> str:
    """The reason of a skipped test or collection report ("Skipped: " taken off)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipLedger:
    """Under ``SPARSEKV_REQUIRE_ALL=1``: every skip of the run, listed at the end; any but a GPU one fails it."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []

    def _record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skips.append((report.nodeid, skip_reason(report)))

    def pytest_runtest_logreport(self, report) -> None:
        self._record(report)

    def pytest_collectreport(self, report) -> None:
        self._record(report)

    def forbidden(self) -> list[tuple[str, str]]:
        return [(node, reason) for node, reason in self.skips if not reason.startswith(GPU_ONLY)]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        terminalreporter.section("skips (SPARSEKV_REQUIRE_ALL=1: only GPU ones are allowed)")
        for node, reason in self.skips:
            verdict = "allowed" if reason.startswith(GPU_ONLY) else "NOT ALLOWED"
            terminalreporter.write_line(f"{verdict}: {node}: {reason}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session) -> None:
        if self.forbidden() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "needs_component(component, missing): an optional component a test needs")
    # Under xdist the controller sees every worker's reports: it alone keeps the ledger.
    if env.require_all() and not hasattr(config, "workerinput"):
        config.pluginmanager.register(SkipLedger(), "sparsekv-skip-ledger")


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("needs_component"):
        component, missing = mark.args
        if missing is not None:
            component_missing(component, missing)

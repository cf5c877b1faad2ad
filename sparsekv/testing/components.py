"""Tests that need an optional component (NIXL, Mooncake, nvcc, libasan, a read-only directory).

Where the component is missing such a test skips with the reason; under ``SPARSEKV_REQUIRE_ALL=1``
(set by CI's ``.ci/run``) it fails with the same reason instead, so a component that went missing
(a failed download, a broken install) cannot hide behind a skip.

This module is also the pytest plugin that acts on :func:`needs` marks (``tests/conftest.py`` loads
it with ``pytest_plugins``).
"""

from __future__ import annotations

from typing import NoReturn

import pytest

from sparsekv import env


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


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "needs_component(component, missing): an optional component a test needs")


def pytest_runtest_setup(item) -> None:
    for mark in item.iter_markers("needs_component"):
        component, missing = mark.args
        if missing is not None:
            component_missing(component, missing)

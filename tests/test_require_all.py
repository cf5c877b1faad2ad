"""SPARSEKV_REQUIRE_ALL=1 turns the skip of a test whose optional component is missing into a failure
with the same reason (CI sets it in .ci/run); without it such a test skips."""

from __future__ import annotations

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
    from pathlib import Path

    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert "export SPARSEKV_REQUIRE_ALL=1" in ci and "make test" in ci

"""sparsekv.testing.profiles: a pinned count and the drawn values follow the active hypothesis profile
(``ci`` by default, ``sanitize`` under the sanitizers, ``slow`` under ``--slow``), so a test's costly cases
come back under ``--slow``."""

from __future__ import annotations

import contextlib

from hypothesis import settings

from sparsekv.testing.profiles import (
    CI_EXAMPLES,
    SANITIZE_EXAMPLES,
    SLOW_EXAMPLES,
    default_profile,
    scaled_examples,
    values_to_draw,
)


@contextlib.contextmanager
def profile(name: str):
    before = settings.get_current_profile_name()
    settings.load_profile(name)
    try:
        yield
    finally:
        settings.load_profile(before)


def test_the_ci_profile_draws_the_cheap_values_only_and_slow_draws_the_costly_ones_too():
    with profile("ci"):
        assert values_to_draw([4], [128]) == [4]
        assert values_to_draw([False, True], []) == [False, True]
    with profile("slow"):
        assert values_to_draw([4], [128]) == [4, 128]
        assert values_to_draw([False], [True]) == [False, True]


def test_a_pinned_count_scales_with_the_profile():
    with profile("ci"):
        assert scaled_examples(6) == 6 and scaled_examples(0) == 1
    with profile("slow"):
        assert scaled_examples(5) == 5 * SLOW_EXAMPLES // CI_EXAMPLES
    with profile("sanitize"):
        assert scaled_examples(40) == 40 * SANITIZE_EXAMPLES // CI_EXAMPLES
        assert [scaled_examples(n) for n in (2, 4, 10)] == [2, 3, 3]  # never below 3 draws, or the ci count
        assert values_to_draw([4], [128]) == [4]


def test_the_sanitizers_choose_the_sanitize_profile_unless_slow(monkeypatch):
    monkeypatch.delenv("SPARSEKV_SANITIZE", raising=False)
    assert [default_profile(False), default_profile(True)] == ["ci", "slow"]
    monkeypatch.setenv("SPARSEKV_SANITIZE", "address,undefined")
    assert [default_profile(False), default_profile(True)] == ["sanitize", "slow"]
    assert settings.get_profile("sanitize").max_examples == SANITIZE_EXAMPLES < CI_EXAMPLES

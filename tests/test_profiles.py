"""sparsekv.testing.profiles: a pinned count and the drawn values follow the active hypothesis profile
(``ci`` by default, ``slow`` under ``--slow``), so a test's costly cases come back under ``--slow``."""

from __future__ import annotations

import contextlib

from hypothesis import settings

from sparsekv.testing.profiles import CI_EXAMPLES, SLOW_EXAMPLES, scaled_examples, values_to_draw


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

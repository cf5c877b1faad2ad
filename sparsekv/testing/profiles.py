"""Hypothesis profiles: a small ``ci`` one by default, a deep ``slow`` one (pytest ``--slow``).

A test that pins its own example count (a costly kernel test) still goes deeper under ``--slow``:
it asks :func:`scaled_examples` for its count, which scales with the active profile. A test whose
costly cases (a large constexpr shape under the Triton interpreter) run once each in a pinned test
draws them only under ``--slow``: :func:`values_to_draw`.

Under ``SPARSEKV_SANITIZE`` (``make test-sanitize``) the default is the ``sanitize`` profile, a fifth of
``ci``: ASan and UBSan check the code paths a kernel runs, which the first few draws and the tests'
explicit examples already reach, and every draw there costs two to three times a plain one (``make test``
ran the ``ci`` count on the same kernels). ``--slow`` is the deep profile under the sanitizers too.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from sparsekv import env

CI_EXAMPLES = 25
SANITIZE_EXAMPLES = 5
SLOW_EXAMPLES = 500


def register_profiles() -> None:
    """Register the ``ci``, ``sanitize`` and ``slow`` profiles (loading one is the caller's choice:
    :func:`default_profile`)."""
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", max_examples=CI_EXAMPLES, **common)
    settings.register_profile("sanitize", max_examples=SANITIZE_EXAMPLES, **common)
    settings.register_profile("slow", max_examples=SLOW_EXAMPLES, **common)


def default_profile(slow: bool) -> str:
    """The profile a test session loads: ``slow`` under ``--slow``, else ``sanitize`` when the session's
    modules are built with sanitizers (``SPARSEKV_SANITIZE``), else ``ci``."""
    if slow:
        return "slow"
    return "sanitize" if env.sanitize() else "ci"


def scaled_examples(ci_count: int) -> int:
    """``ci_count`` examples under the ``ci`` profile, scaled by the active one's count.

    Read when a test module is imported, i.e. after pytest loaded the profile: ``--slow`` turns a
    pinned 10 into 200. A smaller profile (``sanitize``) keeps at least 3, or ``ci_count`` if fewer:
    hypothesis's first draw is often its simplest case (an empty input, which may not call the
    kernel at all), so one or two draws could leave a pinned test's kernel unrun.
    """
    return max(1, min(ci_count, 3), round(ci_count * settings.default.max_examples / CI_EXAMPLES))


def values_to_draw(cheap: list, costly: list) -> list:
    """The values a test draws from: ``cheap`` under the ``ci`` profile, ``cheap + costly`` under a deeper
    one (``--slow``).

    For a parameter whose costly values a pinned test of the same module runs once each, so the
    default profile still reaches their paths every run. Read when a test module is imported, like
    :func:`scaled_examples`.
    """
    return [*cheap, *costly] if settings.default.max_examples > CI_EXAMPLES else list(cheap)

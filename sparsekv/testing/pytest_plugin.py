"""pytest plugin for projects that test code built on sparsekv kernels (entry point ``sparsekv``).

Installed with the package (``pytest11`` entry point), it is active in any pytest session:

* a hypothesis profile ``sparsekv`` (``deadline=None``; the first call of a kernel may compile it
  for seconds, far past hypothesis's 200 ms deadline), loaded when the session has not loaded a
  profile of its own;
* ``--sparsekv-prebuild FAMILY[,FAMILY...]`` (or ``all``): before any test runs, load every instance
  of those families' instance tables, which is what the :mod:`sparsekv.testing.strategies` draw, so
  no example pays for a compile (``-p no:sparsekv`` turns the plugin off).

Without pytest, the same in two lines::

    from sparsekv.testing.pytest_plugin import prebuild, register_profile
    register_profile(); hypothesis.settings.load_profile("sparsekv"); prebuild(["dsv4_attention"])
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

PROFILE = "sparsekv"


def register_profile() -> bool:
    """Register the ``sparsekv`` hypothesis profile (no deadline, slow examples not a health failure);
    False when hypothesis is not installed (the plugin then only offers ``--sparsekv-prebuild``)."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:
        return False
    settings.register_profile(PROFILE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    return True


def prebuild(families: Iterable[str], backend: str = "cpu") -> list[str]:
    """Load (compiling where missing) every table instance of ``families`` (``["all"]``: every family).

    Returns the instances loaded, as ``family<param=value, ...>``.

    Raises
    ------
    ValueError
        An unknown family name (the message lists the known ones).
    """
    from sparsekv.jit_kernel.build.registry import discover

    known = discover()
    names = sorted(known) if list(families) == ["all"] else list(families)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"sparsekv: --sparsekv-prebuild: unknown kernel families {unknown}; known: {sorted(known)}")
    loaded = []
    for name in names:
        family = known[name]
        for values in family.instances or ({},):
            family.module(backend=backend, **values)
            loaded.append(family.describe(values))
    return loaded


def pytest_addoption(parser) -> None:
    parser.addoption("--sparsekv-prebuild", metavar="FAMILY,...", default=None,
                     help="load every table instance of these sparsekv kernel families (or 'all') before the tests")


@pytest.hookimpl(tryfirst=True)  # before any conftest, so a profile that a conftest loads wins
def pytest_configure(config) -> None:
    if register_profile():
        from hypothesis import settings

        # "default", or "ci", which hypothesis loads by itself when it sees a CI environment: the
        # session chose no profile, so ours (no deadline: first calls compile) applies.
        if settings.get_current_profile_name() in ("default", "ci"):
            settings.load_profile(PROFILE)


def pytest_sessionstart(session) -> None:
    families = session.config.getoption("--sparsekv-prebuild")
    if families:
        prebuild([f.strip() for f in families.split(",") if f.strip()])

"""PD tests share the machine with the stress test's CPU hogs only one way at a time.

Transfers time out (30 s in the scenarios), and a room that timed out may still receive its bytes, so
a PD test that ran while ``test_pd_stress`` hogged every core could fail with a timeout that reads
as delivered-but-wrong bytes. The stress test holds ``CPU_LOAD_LOCK`` exclusively while its hogs
run; every other PD test holds it shared.
"""

from __future__ import annotations

import pytest
from pd_cpu_lock import hold_cpu_load_lock


@pytest.fixture(autouse=True)
def _no_cpu_hogs_meanwhile(request):
    if "cpu_load" in request.fixturenames:  # the stress test takes the lock exclusively itself
        yield
        return
    with hold_cpu_load_lock(exclusive=False):
        yield

"""The lock that keeps the PD stress test's CPU hogs and the other PD tests apart (conftest.py)."""

from __future__ import annotations

import fcntl
import os
import tempfile

CPU_LOAD_LOCK = os.path.join(tempfile.gettempdir(), "sparsekv-tests-cpu-load.lock")


def hold_cpu_load_lock(exclusive: bool):
    """Open and flock ``CPU_LOAD_LOCK`` (blocking); the open file, which releases it when closed."""
    f = open(CPU_LOAD_LOCK, "a+")  # noqa: SIM115 - the caller closes it
    fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    return f

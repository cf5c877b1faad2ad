"""Make a directory unwritable for a test, and writable again (root needs ``chattr +i``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sparsekv.jit_kernel import cache


def make_read_only(path: Path) -> None:
    """``path`` refuses writes from this process, or the test is skipped with the reason."""
    path.chmod(0o555)
    if os.geteuid() == 0:  # root ignores mode bits; an immutable directory refuses even root
        subprocess.run(["chattr", "+i", str(path)], check=False, capture_output=True)
    if cache._writable(path):
        undo_read_only(path)
        pytest.skip("cannot make a directory read-only here (root without chattr)")


def undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)
    path.chmod(0o700)

"""Fixtures of the JIT tests: ``read_only`` makes a directory unwritable for one test (root needs
``chattr +i``) and writable again at its end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import cache
from sparsekv.testing.components import component_missing


def _undo_read_only(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)
    path.chmod(0o700)


@pytest.fixture
def read_only():
    """``read_only(path)``: ``path`` refuses writes from this process until the test ends, or the
    test is skipped with the reason."""
    done: list[Path] = []

    def make(path: Path) -> None:
        path.chmod(0o555)
        done.append(path)
        if os.geteuid() == 0:  # root ignores mode bits; an immutable directory refuses even root
            subprocess.run(["chattr", "+i", str(path)], check=False, capture_output=True)
        if cache._writable(path):
            component_missing("a read-only directory", "root without chattr cannot make one here")

    yield make
    for path in done:
        _undo_read_only(path)

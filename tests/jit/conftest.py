"""Fixtures of the JIT tests: ``read_only`` makes a directory unwritable for one test (root needs
``chattr +i``) and writable again at its end; ``two_checkouts`` copies ``csrc/`` to two places;
``counting_cxx`` (and ``module_counting_cxx``, one per test file), ``gated_cxx``, ``hanging_cxx`` and
``forking_hanging_cxx`` are host compilers that log, wait or hang."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import cache, loader
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


@pytest.fixture
def two_checkouts(tmp_path):
    """Two copies of this checkout's ``csrc/`` at different paths and depths."""
    a, b = tmp_path / "checkout_a" / "csrc", tmp_path / "elsewhere" / "checkout_b" / "csrc"
    shutil.copytree(loader.csrc_root(), a)
    shutil.copytree(loader.csrc_root(), b)
    return a, b


def _compiler_wrapper(path: Path, compile_line: str) -> Path:
    """A shell script that answers ``--version`` as ``c++`` does and runs ``compile_line`` for a compile."""
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec c++ --version\n{compile_line}\n')
    path.chmod(0o755)
    return path


def _counting_compiler(folder: Path) -> tuple[Path, Path]:
    log = folder / "compiles.log"
    return _compiler_wrapper(folder / "counting-c++", f'echo "$$ $*" >> {log}\nexec c++ "$@"'), log


@pytest.fixture
def counting_cxx(tmp_path):
    """A host compiler that logs every compile (not --version probes) to a file, then runs c++:
    ``(wrapper, log)``."""
    return _counting_compiler(tmp_path)


@pytest.fixture(scope="module")
def module_counting_cxx(tmp_path_factory):
    """``counting_cxx`` for one test file's shared fixtures: the same name and ``--version``, so the same
    compiler identity in the cache key (a module it builds is a hit under a test's ``counting_cxx``)."""
    return _counting_compiler(tmp_path_factory.mktemp("counting"))


@pytest.fixture
def gated_cxx(tmp_path):
    """A host compiler that logs every compile, then waits to compile until four files are in a folder
    (four racing processes each leave one there as they start to load): ``(wrapper, log, folder)``."""
    log, entered = tmp_path / "compiles.log", tmp_path / "entered"
    entered.mkdir()
    wait = f'while [ "$(ls {entered} | wc -l)" -lt 4 ]; do sleep 0.05; done'
    return _compiler_wrapper(tmp_path / "gated-c++", f'echo "$$ $*" >> {log}\n{wait}\nexec c++ "$@"'), log, entered


@pytest.fixture
def hanging_cxx(tmp_path):
    """A compiler that announces a compile, then hangs (a build to kill mid-compile): ``(wrapper, started)``."""
    started = tmp_path / "compile-started"
    return _compiler_wrapper(tmp_path / "hanging-c++", f"touch {started}\nexec sleep 600"), started


@pytest.fixture
def forking_hanging_cxx(tmp_path):
    """A compiler that starts a child sharing its output, records both pids, then waits for it forever
    (killing the compiler alone would leave the child, and the loader reading their output, hanging):
    ``(wrapper, pids)``, where ``pids`` holds ``"<compiler pid> <child pid>"`` once it runs."""
    pids = tmp_path / "compile-pids"
    return _compiler_wrapper(tmp_path / "forking-c++", f"sleep 600 &\necho $$ $! > {pids}\nwait"), pids

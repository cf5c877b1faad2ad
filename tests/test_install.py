"""Installing prints no setuptools warnings, and the wheel ships what a user needs besides the code:
``py.typed``, the kernel headers and the example memory-planning cases."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = "import sys, setuptools.build_meta as b; print(getattr(b, sys.argv[1])(sys.argv[2]))"


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> Path:
    # A copy, so builds never race with other tests over build/ and *.egg-info in the checkout.
    dst = tmp_path_factory.mktemp("src") / "sparsekv"
    shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".venv", ".git", ".cache", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".hypothesis", ".pytest_cache"))
    return dst


@pytest.mark.parametrize("hook", ["build_editable", "build_wheel"])
def test_build_prints_no_warnings(source_copy, tmp_path, hook):
    done = subprocess.run([sys.executable, "-c", BUILD, hook, str(tmp_path)], cwd=source_copy, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Warning" not in output and "!!" not in output, output[-3000:]
    if hook == "build_wheel":
        names = set(zipfile.ZipFile(tmp_path / done.stdout.split()[-1]).namelist())
        assert {"sparsekv/py.typed", "sparsekv/srt/model_executor/cases/examples.json",
                "sparsekv/csrc/include/sparsekv/ffi.h", "sparsekv/csrc/hisparse.cuh"} <= names


def test_make_demo_installs_no_pd_engine_and_make_test_installs_both(tmp_path):
    """`make install` / `make demo` set up what the demo and the kernels need; the PD engines (NIXL,
    Mooncake and the system libraries it fetches) come with `make install-pd`, which `make test` runs."""
    def planned(target: str) -> str:
        done = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    engines = ("nixl", "mooncake", "fetch_mooncake_libs")
    for target in ("install", "demo"):
        assert not [e for e in engines if e in planned(target)], planned(target)
    for target in ("install-pd", "test"):
        assert all(e in planned(target) for e in engines), planned(target)

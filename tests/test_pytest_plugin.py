"""The pytest plugin sparsekv installs (entry point ``sparsekv``), as a project outside this repository
sees it: the ``sparsekv`` hypothesis profile without a deadline, and ``--sparsekv-prebuild``."""

from __future__ import annotations

import os
import subprocess
import sys

OUTSIDE_TEST = '''
import torch
from hypothesis import given, settings, strategies as st

from sparsekv.jit_kernel.build import loader
from sparsekv.jit_kernel.gather_rows import gather_rows

PREBUILT = len(loader.COMPILED)  # collection runs after the session start, where the prebuild ran


def test_the_profile_has_no_deadline():
    assert settings.get_current_profile_name() == "sparsekv" and settings.default.deadline is None


@given(st.integers(1, 5))
def test_a_kernel_under_hypothesis_never_compiles(n):
    src = torch.arange(4 * n, dtype=torch.uint8).reshape(n, 4)
    dst = torch.zeros_like(src)
    idx = torch.arange(n, dtype=torch.int64)
    gather_rows(dst, idx, src, idx)
    # The cache was empty: the prebuild compiled the instances, no example did.
    assert torch.equal(dst, src) and PREBUILT >= 1 and len(loader.COMPILED) == PREBUILT
'''


def test_an_outside_project_gets_the_profile_and_prebuilds(tmp_path):
    (tmp_path / "test_outside.py").write_text(OUTSIDE_TEST)
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(tmp_path / "cache"))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_outside.py"]
    done = subprocess.run([*argv, "--sparsekv-prebuild", "gather_rows"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout
    bad = subprocess.run([*argv, "--sparsekv-prebuild", "no_such_family"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "unknown kernel families ['no_such_family']" in bad.stdout + bad.stderr

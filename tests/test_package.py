"""Package contract: lazy package names resolve, and importing does no work (no torch for the
planner, no directories, no compile)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import sparsekv.jit_kernel
import sparsekv.srt
import sparsekv.srt.mem_cache


@pytest.mark.parametrize("package", [sparsekv.jit_kernel, sparsekv.srt, sparsekv.srt.mem_cache],
                         ids=lambda p: p.__name__)
def test_every_lazy_name_resolves(package):
    for name in package.__all__:
        assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_importing_creates_nothing_and_the_planner_stays_torch_free(tmp_path):
    cache_dir = tmp_path / "cache"
    probe = (
        "import sys\n"
        "import sparsekv, sparsekv.jit_kernel, sparsekv.srt.mem_cache, sparsekv.srt.model_executor.pool_configurator\n"
        "light = 'torch' not in sys.modules\n"
        "import sparsekv.jit_kernel.gather_rows, sparsekv.jit_kernel.hisparse\n"
        "import sparsekv.srt.managers.hisparse_coordinator\n"
        "print(light)\n"
    )
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir), HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "True"
    assert not cache_dir.exists() and not (tmp_path / "home").exists()

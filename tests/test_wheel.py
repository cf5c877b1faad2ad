"""The wheel ships csrc/: build it, install it into a fresh venv, JIT-build and run a kernel there."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_installs_and_runs_a_kernel_from_its_own_csrc(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("sparsekv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sparsekv/csrc/gather_rows.cuh" in names
    assert "sparsekv/csrc/include/sparsekv/portability.h" in names
    assert "sparsekv/csrc/sim/sim.h" in names  # the sim backend's emulation header
    assert "sparsekv/jit_kernel/build/loader.py" in names and "sparsekv/srt/__init__.py" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # The dependencies (torch, tvm-ffi) come from this environment's site-packages through a .pth
    # file, so the test needs no network; sparsekv itself comes only from the wheel.
    venv_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    (venv_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)

    script = textwrap.dedent("""
        import torch
        import sparsekv.jit_kernel.build.loader as loader
        from sparsekv.jit_kernel.gather_rows import gather_rows
        print(loader.csrc_root())
        src = torch.arange(30, dtype=torch.uint8).reshape(3, 10)
        dst = torch.zeros(3, 10, dtype=torch.uint8)
        gather_rows(dst, torch.tensor([0, 1, 2]), src, torch.tensor([2, 0, 1]))
        assert torch.equal(dst, src[[2, 0, 1]])
        print("OK")
    """)
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    csrc, ok = done.stdout.split()
    assert Path(csrc).is_relative_to(venv) and ok == "OK"

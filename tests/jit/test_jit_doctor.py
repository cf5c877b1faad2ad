"""`sparsekv jit doctor`: on this machine it reports what is there and what is missing; without a C++
compiler the cpu backend is unusable and the exit status says so, with the reason and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sparsekv.jit_kernel.build import toolchain


def doctor(*args: str, **extra_env) -> subprocess.CompletedProcess:
    env = dict(os.environ, **extra_env)
    return subprocess.run([sys.executable, "-m", "sparsekv", "jit", "doctor", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _driver_present() -> bool:
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        return int(err) == 0
    except Exception:  # noqa: BLE001 - no libcuda
        return False


def test_doctor_reports_this_machine(tmp_path):
    done = doctor("--json", SPARSEKV_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["usable"] is True
    assert checks["host compiler"]["status"] == "ok"
    cxx = toolchain.host_compiler(None)
    # The path, then the --version line once ("/usr/bin/c++: c++ (Debian ...)", not "c++ c++ (...)").
    version = cxx.identity.split(" ", 1)[1]
    assert checks["host compiler"]["value"] == f"{cxx.path}: {version}"
    import tvm_ffi

    assert checks["tvm-ffi"]["value"] == tvm_ffi.__version__
    assert str(tmp_path / "cache") in checks["cache"]["value"] and "mode 700" in checks["cache"]["value"]
    if not _driver_present():
        assert checks["GPU"]["status"] == "warn" and "no NVIDIA driver" in checks["GPU"]["value"]
        assert "cpu backend works" in checks["GPU"]["fix"]
    text = doctor(SPARSEKV_CACHE_DIR=str(tmp_path / "cache"))
    assert text.returncode == 0 and text.stdout.rstrip().endswith("cpu backend: usable")
    for name in ("python", "torch", "triton", "tvm-ffi", "cuda-python", "host compiler", "strict mode"):
        assert f"] {name}: " in text.stdout


def test_doctor_without_a_compiler_fails_with_the_reason(tmp_path):
    done = doctor(SPARSEKV_CACHE_DIR=str(tmp_path / "cache"), PATH=str(tmp_path / "empty"), CXX="", SPARSEKV_CXX="")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "[fail] host compiler: host C++ compiler 'c++' not found on PATH" in done.stdout
    assert "fix: install g++" in done.stdout and "cpu backend: NOT usable" in done.stdout

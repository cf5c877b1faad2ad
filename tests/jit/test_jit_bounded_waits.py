"""Bounded JIT waits: a compiler that hangs is killed at SPARSEKV_JIT_COMPILE_TIMEOUT, and a load
waiting for another process's build gives up, naming that process, when it is stopped, gone or too slow.

The bounds are set small here (seconds); the code enforces them, the tests check the errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sparsekv.jit_kernel.build import cache, loader
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS


def plan_for():
    return loader.make_plan(GATHER_ROWS.name, ("int64_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                            kernels=GATHER_ROWS.kernels, backend="cpu", arch=None, probe_dir=None)


def _gone(pid: int) -> bool:
    """Whether ``pid`` has died (a SIGKILL is delivered asynchronously: give it a moment)."""
    for _ in range(200):
        if cache._process_state(pid) in (None, "Z"):
            return True
        time.sleep(0.05)
    return False


def test_a_hanging_compiler_is_killed_at_the_compile_timeout(tmp_path, monkeypatch, forking_hanging_cxx):
    cxx, pids = forking_hanging_cxx
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSEKV_CXX", str(cxx))
    monkeypatch.setenv("SPARSEKV_JIT_COMPILE_TIMEOUT", "2")
    plan = plan_for()
    for _attempt in range(2):  # a timeout is not remembered: the next load compiles again
        with pytest.raises(loader.JitCompileTimeoutError) as info:
            loader.find_or_build(plan, cache.open_roots())
        message = str(info.value)
        compiler, child = map(int, pids.read_text().split())
        assert "took longer than 2 s (SPARSEKV_JIT_COMPILE_TIMEOUT)" in message and f"pid {compiler}" in message
        assert "remembered" not in message and info.value.command[0] == str(cxx)
        # The compiler and the child it started are killed (the child held the output pipe).
        assert _gone(compiler) and _gone(child), (compiler, child)
        pids.unlink()
    assert cache.valid_artifact(tmp_path / "cache" / plan.entry_name()) is None


@pytest.mark.parametrize("variable", ["SPARSEKV_JIT_COMPILE_TIMEOUT", "SPARSEKV_JIT_LOCK_TIMEOUT"])
def test_a_bad_timeout_is_refused_before_anything_is_built(tmp_path, monkeypatch, variable):
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    for bad in ("0", "-1", "ten", "inf", "nan"):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(ValueError, match=f"{variable} must be a positive number of seconds, got '{bad}'"):
            loader.find_or_build(plan_for(), cache.open_roots())
    assert not (tmp_path / "cache").exists()


HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    from sparsekv.jit_kernel.build import cache
    root, entry, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    (root / ".locks").mkdir(mode=0o700)
    lock = cache._wait_for_lock(cache._lock_path(root, entry), entry)  # as a builder takes it
    if how == "gone":  # exit, leaving the lock with a process that inherited it
        child = subprocess.Popen(["sleep", "600"], pass_fds=(lock.fileno(),), start_new_session=True)
        print(os.getpid(), child.pid, flush=True)
        os._exit(0)
    print(os.getpid(), 0, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["stopped", "gone", "running"])
def test_a_lock_wait_ends_naming_the_holder(tmp_path, monkeypatch, how):
    """A builder SIGSTOPped, or gone while a process it started holds the lock, ends the wait as
    stalled; one that runs but never finishes ends it at SPARSEKV_JIT_LOCK_TIMEOUT."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(root))
    monkeypatch.setenv("SPARSEKV_JIT_LOCK_TIMEOUT", "2")
    roots = cache.open_roots()
    plan = plan_for()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(roots.write), plan.entry_name(), how],
                              stdout=subprocess.PIPE, text=True)
    pid, inheritor = map(int, holder.stdout.readline().split())
    try:
        if how == "stopped":
            os.kill(pid, signal.SIGSTOP)
        elif how == "gone":
            holder.wait()
        with pytest.raises(cache.CacheLockTimeoutError) as info:
            loader.find_or_build(plan, roots)
        message = str(info.value)
        assert info.value.pid == pid and f"pid {pid}" in message and plan.entry_name() in message
        assert {"stopped": f"is stopped (state T: SIGSTOP, ^Z or a debugger); resume it (`kill -CONT {pid}`)",
                "gone": "has exited, but the lock is still held",
                "running": "(SPARSEKV_JIT_LOCK_TIMEOUT) waiting for"}[how] in message
        assert cache.valid_artifact(roots.write / plan.entry_name()) is None  # nothing was built meanwhile
    finally:
        if inheritor:
            os.kill(inheritor, signal.SIGKILL)
        if holder.poll() is None:
            holder.kill()
            os.kill(pid, signal.SIGCONT)
        holder.wait()

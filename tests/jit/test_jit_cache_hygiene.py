"""Cache hygiene an operator relies on: leftovers of killed or failed builds are swept, an unwritable
fallback is a clear error, `jit verify --repair` heals what the warm path cannot see, `jit prune`
and SPARSEKV_CACHE_MAX_SIZE bound the cache."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import cache, loader
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS

CSRC = loader.csrc_root()


def plan_for(csrc: Path = CSRC):
    return loader.make_plan(GATHER_ROWS.name, ("int64_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                            kernels=GATHER_ROWS.kernels, backend="cpu", arch=None, probe_dir=None, csrc=csrc)


@pytest.fixture
def jit(sparsekv_cli):
    """``jit(*args, cache_dir=..., **env)``: ``sparsekv jit ARGS`` in this process (``sparsekv_cli``)."""
    return functools.partial(sparsekv_cli, "jit")


def staging(cache_dir: Path) -> list[Path]:
    parent = cache_dir / ".staging"
    return sorted(parent.iterdir()) if parent.is_dir() else []


LOAD_SCRIPT = ("import torch; from sparsekv.jit_kernel.gather_rows import GATHER_ROWS; "
               "GATHER_ROWS.module(index_dtype=torch.int64)")


def _kill_mid_compile(cache_dir: Path, cxx: Path, started: Path) -> None:
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir), SPARSEKV_CXX=str(cxx))
    proc = subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the loader and its compiler, as the OOM killer or `kill -9` would
    proc.wait()
    assert len(staging(cache_dir)) == 1  # the half-built entry is left behind


def test_sigkilled_build_is_swept_by_the_next_load(tmp_path, monkeypatch, hanging_cxx):
    cache_dir = tmp_path / "cache"
    _kill_mid_compile(cache_dir, *hanging_cxx)
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(cache_dir))
    loader.find_or_build(plan_for(), cache.open_roots())
    assert staging(cache_dir) == []
    assert len(cache.entries(cache_dir)) == 1


def test_sigkilled_build_is_swept_by_clean_stale(tmp_path, hanging_cxx, jit):
    cache_dir = tmp_path / "cache"
    _kill_mid_compile(cache_dir, *hanging_cxx)
    dry = jit("clean", "--stale", "--dry-run", cache_dir=cache_dir)
    assert dry.returncode == 0 and "would remove 0 stale entries and 1 leftovers" in dry.stdout
    assert len(staging(cache_dir)) == 1
    done = jit("clean", "--stale", cache_dir=cache_dir)
    assert done.returncode == 0 and "removed 0 stale entries and 1 leftovers" in done.stdout, done.stdout
    assert staging(cache_dir) == []
    assert list((cache_dir / ".locks").iterdir()) == []  # its lock file, held by nobody, is gone too


def test_failed_compile_is_swept_by_the_next_load_and_by_clean_stale(tmp_path, monkeypatch, jit):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    with open(csrc / "gather_rows.cuh", "a") as f:
        f.write("\nthis is not C++;\n")
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(loader, "_failed", {})
    with pytest.raises(loader.JitCompileError) as info:
        loader.find_or_build(plan_for(csrc), cache.open_roots())
    (left,) = staging(cache_dir)
    assert str(left) in info.value.cwd  # kept for the reproduce command until the next sweep
    loader.find_or_build(plan_for(), cache.open_roots())  # the next load (another module) sweeps it
    assert staging(cache_dir) == []

    monkeypatch.setattr(loader, "_failed", {})  # as a new process: compile again, fail again
    with pytest.raises(loader.JitCompileError):
        loader.find_or_build(plan_for(csrc), cache.open_roots())
    assert len(staging(cache_dir)) == 1
    done = jit("clean", "--stale", cache_dir=cache_dir)
    assert "and 1 leftovers" in done.stdout and staging(cache_dir) == []


def test_live_builders_staging_is_never_swept(tmp_path, hanging_cxx):
    cxx, started = hanging_cxx
    cache_dir = tmp_path / "cache"
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir), SPARSEKV_CXX=str(cxx))
    proc = subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not started.exists():
            assert proc.poll() is None
            time.sleep(0.05)
        assert cache.sweep_leftovers(cache_dir) == []
        assert len(staging(cache_dir)) == 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_unwritable_fallback_is_a_clear_error_and_hits_still_load(tmp_path, monkeypatch, read_only):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    # No root configured, and a default that cannot be created: the fallback is the root.
    monkeypatch.delenv("SPARSEKV_CACHE_DIR")
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    read_only(xdg)
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    fallback = cache.fallback_root()
    loader.find_or_build(plan_for(), cache.open_roots())
    read_only(fallback)
    loader.find_or_build(plan_for(), cache.open_roots())  # a hit needs no write
    monkeypatch.setenv("SPARSEKV_EXTRA_CFLAGS", "-DSPARSEKV_UNWRITABLE_TEST=1")
    with pytest.raises(cache.CacheUnwritableError) as info:
        loader.find_or_build(plan_for(), cache.open_roots())
    message = str(info.value)
    assert str(xdg / "sparsekv") in message and str(fallback) in message and "SPARSEKV_CACHE_DIR" in message
    assert ".locks" not in message


@pytest.mark.parametrize("configured", [True, False])
def test_unwritable_cache_in_the_cli_is_one_line(tmp_path, read_only, configured):
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o700)
    fallback_parent = tmp_path / "tmp"
    fallback_parent.mkdir()
    fallback = fallback_parent / f"sparsekv-cache-{os.getuid()}"
    fallback.mkdir(mode=0o700)
    read_only(cache_dir)
    read_only(fallback)
    # Unconfigured: the default (under a read-only XDG_CACHE_HOME) is unusable and the fallback read-only.
    # A process of its own: Python reads $TMPDIR once per process.
    env = dict(os.environ, TMPDIR=str(fallback_parent), XDG_CACHE_HOME=str(cache_dir))
    env["SPARSEKV_CACHE_DIR"] = str(cache_dir)
    if not configured:
        del env["SPARSEKV_CACHE_DIR"]
    done = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "build", "gather_rows"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert ("is read-only" if configured else "is writable by uid") in done.stderr


def _corrupt_keeping_size_and_mtime(so: Path) -> None:
    st = so.stat()
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_verify_repair_heals_a_same_size_corruption_with_restored_mtime(tmp_path, monkeypatch, jit):
    cache_dir = tmp_path / "cache"
    # Built by a process of its own: a build loads the module, and this test rewrites it in place (a
    # library this process had mapped would crash it).
    built = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "build", "gather_rows"], capture_output=True,
                           text=True, env=dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir)), timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (bad, good) = sorted(cache.entries(cache_dir), key=lambda e: "int64" not in e.name)
    so = bad / cache.ARTIFACT
    _corrupt_keeping_size_and_mtime(so)
    assert cache.valid_artifact(bad) is not None  # the warm path (a stat) cannot see it

    checked = jit("verify", "--json", cache_dir=cache_dir)
    assert checked.returncode == 1
    report = json.loads(checked.stdout)
    assert report["bad"] == 1
    (row,) = [r for r in report["entries"] if not r["ok"]]
    assert row["entry"] == bad.name and "sha256" in row["problem"] and not row["removed"]
    assert so.exists()

    repaired = jit("verify", "--repair", cache_dir=cache_dir)
    assert repaired.returncode == 0 and f"BAD {bad.name}" in repaired.stdout and "removed" in repaired.stdout
    assert not bad.exists() and good.exists()
    assert jit("verify", cache_dir=cache_dir).stdout.strip() == "verified 1 entries: 1 ok, 0 bad"
    # The next load rebuilds it, bit-identical in behaviour (the kernel runs correctly).
    script = ("import torch; from sparsekv.jit_kernel.gather_rows import gather_rows\n"
              "src = torch.arange(40, dtype=torch.uint8).reshape(4, 10); dst = torch.zeros_like(src)\n"
              "gather_rows(dst, torch.arange(4), src, torch.tensor([3, 2, 1, 0]))\n"
              "assert torch.equal(dst, src.flip(0))")
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert jit("verify", cache_dir=cache_dir).stdout.strip() == "verified 2 entries: 2 ok, 0 bad"


def _age(entry: Path, days: float) -> None:
    t = time.time() - days * 86400
    os.utime(entry, (t, t))


def test_prune_by_age_and_by_size_removes_least_recently_loaded_first(tmp_path, jit):
    cache_dir = tmp_path / "cache"
    assert jit("build", "gather_rows", cache_dir=cache_dir).returncode == 0
    old, new = sorted(cache.entries(cache_dir))
    _age(old, 40)
    _age(new, 1)
    dry = jit("prune", "--older-than", "30", "--dry-run", "--json", cache_dir=cache_dir)
    assert json.loads(dry.stdout)["removed"] == [old.name] and old.exists()
    assert jit("prune", "--older-than", "30", cache_dir=cache_dir).returncode == 0
    assert cache.entries(cache_dir) == [new]

    assert jit("build", "gather_rows", cache_dir=cache_dir).returncode == 0
    entries = cache.entries(cache_dir)
    _age(new, 2)  # now the least recently loaded
    size = max(cache.entry_bytes(e) for e in entries)
    assert jit("prune", "--max-size", str(size), cache_dir=cache_dir).returncode == 0
    assert [e.name for e in cache.entries(cache_dir)] == [e.name for e in entries if e != new]
    usage = jit("prune", cache_dir=cache_dir)
    assert usage.returncode == 2 and "--older-than" in usage.stderr


def test_cache_max_size_evicts_after_each_build(tmp_path, jit):
    cache_dir = tmp_path / "cache"
    assert jit("build", "--instance", "gather_rows:index_dtype=int32", cache_dir=cache_dir).returncode == 0
    (first,) = cache.entries(cache_dir)
    _age(first, 1)
    cap = str(cache.entry_bytes(first) + 1024)
    done = jit("build", "--instance", "gather_rows:index_dtype=int64", cache_dir=cache_dir,
               SPARSEKV_CACHE_MAX_SIZE=cap)
    assert done.returncode == 0, done.stderr
    (kept,) = cache.entries(cache_dir)
    assert "int64" in kept.name


def test_lock_file_unlinked_under_a_waiting_builder_still_excludes(tmp_path, monkeypatch):
    """A sweep may unlink a lock file while a builder waits on it; when that builder wakes up on the
    old inode it must re-open and wait for whoever holds the new file, never build alongside it."""
    import fcntl
    import queue
    import threading

    root = tmp_path / "cache"
    root.mkdir()
    lock = cache._lock_path(root, "e")
    acquired = threading.Event()
    # The waiter's blocking flock calls announce the inode they are about to wait on: the test steps
    # on those announcements, not on sleeps.
    waits: queue.Queue[int] = queue.Queue()
    real_flock = fcntl.flock

    def announcing_flock(handle, operation):
        if threading.current_thread().name == "waiter" and not operation & fcntl.LOCK_NB:
            waits.put(os.fstat(handle.fileno()).st_ino)
        return real_flock(handle, operation)

    monkeypatch.setattr(cache.fcntl, "flock", announcing_flock)
    with cache._build_lock(root, "e"):
        old_inode = lock.stat().st_ino
        waiter = threading.Thread(target=lambda: (cache._open_locked(lock, blocking=True), acquired.set()),
                                  name="waiter", daemon=True)
        waiter.start()
        assert waits.get(timeout=30) == old_inode  # the waiter waits on the old inode
        lock.unlink()
        newcomer = cache._open_locked(lock, blocking=False)  # locks the new file
        assert newcomer is not None
        new_inode = os.fstat(newcomer.fileno()).st_ino
    # The first holder released the old inode; the waiter must now wait for the newcomer.
    assert waits.get(timeout=30) == new_inode and not acquired.is_set()
    newcomer.close()
    assert acquired.wait(30)
    waiter.join()

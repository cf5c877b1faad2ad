"""The JIT loader: cache key, racing builders, corrupted artifacts, read-only and unsafe caches."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import cache, loader
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS
from sparsekv.testing.components import component_missing

CSRC = loader.csrc_root()


def plan_for(csrc: Path, *, backend: str = "cpu", arch: str | None = None, probe_dir: Path | None = None):
    return loader.make_plan(GATHER_ROWS.name, ("int64_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                            kernels=GATHER_ROWS.kernels, backend=backend, arch=arch, probe_dir=probe_dir, csrc=csrc)


def test_key_is_the_same_for_two_checkouts_and_holds_no_absolute_path(two_checkouts):
    a, b = two_checkouts
    plan_a, plan_b = plan_for(a), plan_for(b)
    assert plan_a.entry_name() == plan_b.entry_name()
    doc = json.dumps(plan_a.key_doc())
    for path in (str(a), str(b), str(CSRC), plan_a.cxx.path):
        assert path not in doc
    assert "/" not in "".join(plan_a.key_doc()["include_closure"]).replace("include/sparsekv/", "")


def test_key_covers_the_transitive_include_closure(two_checkouts):
    a, _ = two_checkouts
    base = plan_for(a).entry_name()
    closure = plan_for(a).closure
    assert {"gather_rows.cuh", "include/sparsekv/portability.h", "include/sparsekv/ffi.h"} <= set(closure)
    for rel in closure:
        with open(a / rel, "a") as f:
            f.write("\n// edited\n")
        edited = plan_for(a).entry_name()
        assert edited != base, rel
        (a / rel).write_bytes(closure[rel])
        assert plan_for(a).entry_name() == base


def test_unrelated_edits_do_not_change_the_key(two_checkouts):
    a, _ = two_checkouts
    base = plan_for(a).entry_name()
    (a / "unrelated_kernel.cuh").write_text("// a header nothing includes\n")
    (a / "include" / "sparsekv" / "unrelated.h").write_text("// nor this one\n")
    assert plan_for(a).entry_name() == base


def test_key_covers_flags_backend_and_arch(two_checkouts, monkeypatch):
    a, _ = two_checkouts
    base = plan_for(a).entry_name()
    monkeypatch.setenv("SPARSEKV_EXTRA_CFLAGS", "-DSPARSEKV_SOMETHING=1")
    assert plan_for(a).entry_name() != base
    monkeypatch.delenv("SPARSEKV_EXTRA_CFLAGS")
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        component_missing("nvcc", "the cuda-backend half of the key cannot be computed")
    cuda_90 = plan_for(a, backend="cuda", arch="9.0a").entry_name()
    cuda_both = plan_for(a, backend="cuda", arch="9.0a,10.0a").entry_name()
    assert len({base, cuda_90, cuda_both}) == 3


def test_key_covers_the_compiler_identity(two_checkouts, tmp_path, monkeypatch):
    a, _ = two_checkouts
    base = plan_for(a).entry_name()
    other = tmp_path / "bin" / "c++"
    other.parent.mkdir()
    # A different compiler "version" (a wrapper whose --version differs) must give another key.
    other.write_text("#!/bin/sh\n"
                     "if [ \"$1\" = --version ]; then echo 'c++ (other) 99.0'; exit 0; fi\n"
                     "exec c++ \"$@\"\n")
    other.chmod(0o755)
    monkeypatch.setenv("SPARSEKV_CXX", str(other))
    assert plan_for(a).entry_name() != base


def _worker_script(cache_dir: Path, cxx: Path, barrier: Path | None = None) -> str:
    """A process that loads gather_rows and checks one call. With a ``barrier`` folder it says ``ready``
    once imported, waits for a line on stdin, and leaves a file there just before its first call."""
    return textwrap.dedent(f"""
        import os, sys, torch
        os.environ["SPARSEKV_CACHE_DIR"] = {str(cache_dir)!r}
        os.environ["SPARSEKV_CXX"] = {str(cxx)!r}
        from sparsekv.jit_kernel.gather_rows import gather_rows
        src = torch.arange(40, dtype=torch.uint8).reshape(4, 10)
        dst = torch.zeros(4, 10, dtype=torch.uint8)
        idx = torch.tensor([3, 2, 1, 0])
        if {barrier is not None!r}:
            print("ready", flush=True)
            sys.stdin.readline()
            open(os.path.join({str(barrier)!r}, str(os.getpid())), "w").close()
        gather_rows(dst, torch.arange(4), src, idx)
        assert torch.equal(dst, src.flip(0))
        print("OK")
    """)


def test_racing_processes_build_once_and_all_succeed(tmp_path, gated_cxx):
    # They race by construction, not by the clock: the compiler starts only once all four processes
    # are about to load, so three of them enter the loader while the fourth's build is running.
    cxx, log, entered = gated_cxx
    cache_dir = tmp_path / "cache"
    script = _worker_script(cache_dir, cxx, barrier=entered)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    # A barrier: every process has imported torch and the wrapper before any of them loads the module.
    if [p.stdout.readline() for p in procs] != ["ready\n"] * 4:
        for p in procs:
            p.kill()
        pytest.fail(f"a worker died before the barrier: {[p.communicate()[1][-2000:] for p in procs]}")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [r[1][-2000:] for r in results]
    assert [out for out, _ in results] == ["OK\n"] * 4, results
    published = [e for e in cache.entries(cache_dir) if e.name.startswith("gather_rows__int64t__cpu")]
    assert len(published) == 1
    assert len(log.read_text().splitlines()) == 1  # the compiler ran exactly once
    assert list((cache_dir / ".staging").iterdir()) == []


def _build_in(cache_dir: Path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(cache_dir))
    roots = cache.open_roots()
    plan = plan_for(CSRC, probe_dir=None)
    return plan, roots, loader.find_or_build(plan, roots)


def _run_worker(cache_dir: Path, cxx: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _worker_script(cache_dir, cxx)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stderr[-2000:]


def _published_artifact(cache_dir: Path) -> Path:
    (entry,) = [e for e in cache.entries(cache_dir) if e.name.startswith("gather_rows__int64t__cpu")]
    return entry / cache.ARTIFACT


# Corruption happens between processes (a crash mid-copy, a bad disk): the artifact is damaged in
# one process and found by the next. (Damaging a library a live process has mapped would crash that
# process whatever the loader did, so these tests use fresh processes.)
@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte"])
def test_corrupted_artifact_is_rebuilt_transparently(tmp_path, counting_cxx, damage):
    cxx, log = counting_cxx
    cache_dir = tmp_path / "cache"
    _run_worker(cache_dir, cxx)
    so = _published_artifact(cache_dir)
    data = bytearray(so.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 3]
    else:
        data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    assert cache.valid_artifact(so.parent) is None
    _run_worker(cache_dir, cxx)
    assert cache.valid_artifact(_published_artifact(cache_dir).parent) is not None
    assert len(log.read_text().splitlines()) == 2  # built, then rebuilt once


def test_a_read_only_configured_cache_is_read_and_a_miss_there_is_an_error(tmp_path, monkeypatch, read_only):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    plan, roots, _ = _build_in(tmp_path / "cache", monkeypatch)
    root = roots.write
    read_only(root)
    ro_roots = cache.open_roots()
    assert ro_roots.read == (root,)
    # A hit in the read-only root loads.
    loader.find_or_build(plan, ro_roots)
    # A miss (another flag set) is refused, naming the root; nothing is built elsewhere.
    monkeypatch.setenv("SPARSEKV_EXTRA_CFLAGS", "-DSPARSEKV_READ_ONLY_TEST=1")
    with pytest.raises(cache.CacheUnwritableError, match=f"SPARSEKV_CACHE_DIR={root} is read-only"):
        loader.find_or_build(plan_for(CSRC), ro_roots)
    assert not cache.fallback_root().exists()


def test_a_module_published_only_in_the_fallback_is_compiled_again_under_a_configured_root(
        tmp_path, monkeypatch, counting_cxx):
    import tempfile

    cxx, log = counting_cxx
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("SPARSEKV_CXX", str(cxx))
    # No root configured and an unusable default (a file where its directory would be): the fallback, alone.
    monkeypatch.delenv("SPARSEKV_CACHE_DIR")
    (tmp_path / "xdg").write_text("not a directory\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fallback = cache.open_roots()
    assert fallback.read == () and fallback.write == cache.fallback_root() and fallback.read == (fallback.write,)
    plan = plan_for(CSRC)
    loader.find_or_build(plan, fallback)
    assert (cache.fallback_root() / plan.entry_name() / cache.ARTIFACT).is_file()
    # A configured root reads itself only: the fallback's module is compiled again into it.
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "own"))
    own = cache.open_roots()
    assert own.read == () and own.write == tmp_path / "own"
    assert own.read == (tmp_path / "own",)
    loader.find_or_build(plan_for(CSRC), own)
    assert [e.name for e in cache.entries(tmp_path / "own")] == [plan.entry_name()]
    assert len(log.read_text().splitlines()) == 2  # compiled in the fallback, then again in the configured root


def test_a_usable_default_root_is_used_alone(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cache.fallback_root().mkdir(mode=0o700)  # present, but not read: the default is usable
    monkeypatch.delenv("SPARSEKV_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    roots = cache.open_roots()
    assert roots.root == tmp_path / "xdg" / "sparsekv" and roots.read == ()
    assert roots.write == tmp_path / "xdg" / "sparsekv" and roots.read == (roots.write,)


def test_cache_dir_writable_by_others_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "shared-cache"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(root))
    with pytest.raises(cache.CacheSecurityError, match="writable by other users"):
        cache.open_roots()


def test_artifact_writable_by_others_is_never_loaded(tmp_path, monkeypatch):
    plan, roots, _ = _build_in(tmp_path / "cache", monkeypatch)
    so = roots.write / plan.entry_name() / cache.ARTIFACT
    so.chmod(0o666)
    assert cache.valid_artifact(so.parent) is None
    loader.find_or_build(plan, roots)  # rebuilt privately instead
    assert stat.S_IMODE(so.stat().st_mode) & 0o022 == 0


def test_compile_error_carries_the_compiler_message_and_a_reproduce_command(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    with open(csrc / "gather_rows.cuh", "a") as f:
        f.write("\nthis is not C++;\n")
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    roots = cache.open_roots()
    with pytest.raises(loader.JitCompileError) as info:
        loader.find_or_build(plan_for(csrc), roots)
    message = str(info.value)
    assert "Reproduce with" in message and "module.cpp" in message and "error" in message


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CXX", "no-such-compiler-anywhere")
    with pytest.raises(RuntimeError, match="SPARSEKV_CXX"):
        plan_for(CSRC)


def test_bad_arch_is_rejected_before_compiling():
    from sparsekv.jit_kernel.build.arch import ArchError, parse_arch_list

    assert parse_arch_list("10.0a, 9.0a 9.0a") == ("9.0a", "10.0a")
    with pytest.raises(ArchError, match="not supported"):
        parse_arch_list("7.0")
    with pytest.raises(ArchError, match="malformed"):
        parse_arch_list("sm_90")


def test_warm_load_in_a_fresh_process_spawns_no_compiler(tmp_path, counting_cxx):
    cxx, log = counting_cxx
    cache_dir = tmp_path / "cache"
    script = _worker_script(cache_dir, cxx)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert len(log.read_text().splitlines()) == 1
    # The --version probe is cached on disk too: the second process ran no compiler process at all.
    probes = list((cache_dir / ".toolchain").glob("*.json"))
    assert len(probes) == 1


def test_strict_mode_refuses_to_compile_on_a_miss_and_loads_hits(tmp_path, monkeypatch, counting_cxx):
    cxx, log = counting_cxx
    monkeypatch.setenv("SPARSEKV_CXX", str(cxx))
    monkeypatch.setenv("SPARSEKV_JIT_STRICT", "1")
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    roots = cache.open_roots()
    with pytest.raises(loader.JitCacheMissError, match="sparsekv jit build"):
        loader.find_or_build(plan_for(CSRC), roots)
    assert not log.exists()
    monkeypatch.delenv("SPARSEKV_JIT_STRICT")
    loader.find_or_build(plan_for(CSRC), roots)
    monkeypatch.setenv("SPARSEKV_JIT_STRICT", "1")
    loader.find_or_build(plan_for(CSRC), roots)  # a hit loads fine in strict mode
    assert len(log.read_text().splitlines()) == 1


@pytest.fixture
def own_csrc(tmp_path, monkeypatch, counting_cxx):
    """``(csrc, load_fresh, compiles)``: a private copy of csrc and cache, a load as a new process would
    do it (no in-process memo), and the number of compiles so far."""
    cxx, log = counting_cxx
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    monkeypatch.setenv("SPARSEKV_CXX", str(cxx))
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "csrc_root", lambda: csrc)

    def load_fresh():
        return loader.load_jit(GATHER_ROWS.name, "int64_t", header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                               kernels=GATHER_ROWS.kernels)

    def compiles() -> int:
        return len(log.read_text().splitlines()) if log.exists() else 0

    return csrc, load_fresh, compiles


def test_warm_index_shortcut_follows_header_edits(tmp_path, own_csrc):
    """The stat index lets a warm load skip hashing headers, but never serves a stale module."""
    csrc, load_fresh, compiles = own_csrc
    load_fresh()
    (index,) = (tmp_path / "cache" / loader.INDEX_DIR).glob("gather_rows__*.json")
    load_fresh()
    assert compiles() == 1
    # Same bytes, new mtime: the index misses, the content key still hits, the index is rewritten.
    header = csrc / "include" / "sparsekv" / "portability.h"
    os.utime(header, ns=(header.stat().st_atime_ns, header.stat().st_mtime_ns + 10**9))
    load_fresh()
    assert compiles() == 1
    assert json.loads(index.read_text())["files"][str(header)][1] == header.stat().st_mtime_ns
    # New bytes in a transitively included header: a new key, so a rebuild.
    with open(header, "a") as f:
        f.write("\n// edited\n")
    load_fresh()
    assert compiles() == 2


def test_a_header_edited_while_its_module_compiles_is_not_indexed_as_that_module(tmp_path, monkeypatch, own_csrc):
    # Seen on the shared cache: an edit landing during a compile left the index pointing the edited
    # header at the module built from the old bytes, and every later process loaded it.
    csrc, load_fresh, compiles = own_csrc
    header = csrc / "include" / "sparsekv" / "portability.h"
    build = loader.find_or_build

    def build_then_edit(plan, roots, reason="not in cache"):
        module = build(plan, roots, reason)
        with open(header, "a") as f:
            f.write("\n// edited during the compile\n")
        return module

    monkeypatch.setattr(loader, "find_or_build", build_then_edit)
    load_fresh()
    assert not list((tmp_path / "cache" / loader.INDEX_DIR).glob("gather_rows__*.json"))
    monkeypatch.setattr(loader, "find_or_build", build)
    load_fresh()  # the edited bytes: a new key, so a second compile (then indexed)
    assert compiles() == 2
    assert list((tmp_path / "cache" / loader.INDEX_DIR).glob("gather_rows__*.json"))


def test_the_compilers_read_the_header_bytes_the_key_hashed(tmp_path, monkeypatch, own_csrc):
    # Seen on the shared cache: the key hashed the headers when the plan was made, the compilers read
    # them from csrc/ later, so a header switched in between (an edit, a checkout, a rebase) was built
    # into the entry named by the other bytes, and every later load of those bytes got this build.
    csrc, load_fresh, compiles = own_csrc
    header = csrc / GATHER_ROWS.header
    keyed = header.read_bytes()
    planted = keyed + b'\n#error "compiled bytes the cache key does not cover"\n'
    compile_ = loader._compile

    def switch_then_compile(plan, *args):
        header.write_bytes(planted)  # after the plan hashed the header, before a compiler reads it
        compile_(plan, *args)

    monkeypatch.setattr(loader, "_compile", switch_then_compile)
    load_fresh()  # built from the keyed bytes: the planted #error is not compiled
    monkeypatch.setattr(loader, "_compile", compile_)
    (entry,) = cache.entries(tmp_path / "cache")
    recorded = json.loads((entry / cache.KEY_FILE).read_text())["include_closure"][GATHER_ROWS.header]
    assert recorded == hashlib.sha256(keyed).hexdigest()
    assert not (entry / loader.SNAPSHOT_DIR).exists()  # the snapshot is not published
    # The planted bytes now on disk are their own key, and their build reads them.
    with pytest.raises(loader.JitCompileError, match="the cache key does not cover"):
        load_fresh()
    assert compiles() == 2
    header.write_bytes(keyed)
    assert plan_for(csrc).entry_name() == entry.name
    load_fresh()  # the keyed bytes again: a hit on the entry built above
    assert compiles() == 2


def test_a_miss_during_cuda_graph_capture_raises_instead_of_compiling(tmp_path, monkeypatch, counting_cxx):
    import torch

    cxx, log = counting_cxx
    monkeypatch.setenv("SPARSEKV_CXX", str(cxx))
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    # No GPU here: stand in for torch's capture state, which is all the loader reads.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(loader.JitCacheMissError, match="capturing a graph"):
        loader.find_or_build(plan_for(CSRC), cache.open_roots())
    assert not log.exists()

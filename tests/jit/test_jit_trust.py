"""What the warm path trusts: a module copied into another entry's place (with that entry's size and
mtime, all the warm path stats) is refused and rebuilt, by the entry name every module embeds; an
index entry redirected to a planted directory, out of the root or to another entry is not followed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from sparsekv.jit_kernel.build import cache, loader
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS

# A fresh process (a library its process has loaded from a path stays loaded): gather rows with
# int32 or int64 indices, check the bytes, print the entry name the module it used embeds.
WORKER = textwrap.dedent("""
    import sys, torch
    from sparsekv.jit_kernel.gather_rows import GATHER_ROWS, gather_rows
    dtype = getattr(torch, sys.argv[1])
    src = torch.arange(40, dtype=torch.uint8).reshape(4, 10)
    dst = torch.zeros(4, 10, dtype=torch.uint8)
    gather_rows(dst, torch.arange(4, dtype=dtype), src, torch.tensor([3, 2, 1, 0], dtype=dtype))
    assert torch.equal(dst, src.flip(0))
    print(GATHER_ROWS.module(index_dtype=dtype).get_function("sparsekv_module_key")())
""")


def plan_for(index_type: str):
    return loader.make_plan(GATHER_ROWS.name, (index_type,), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                            kernels=GATHER_ROWS.kernels, backend="cpu", arch=None, probe_dir=None)


def worker(dtype: str) -> str:
    done = subprocess.run([sys.executable, "-c", WORKER, dtype], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, module_counting_cxx):
    """Both gather_rows instances built (and indexed) in a fresh cache by a counting compiler, once for
    this file (per xdist worker): the root. Each test plants its change in a copy of it."""
    cxx, log = module_counting_cxx
    root = tmp_path_factory.mktemp("trust") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARSEKV_CACHE_DIR", str(root))
        mp.setenv("SPARSEKV_CXX", str(cxx))
        for dtype, index_type in (("int64", "int64_t"), ("int32", "int32_t")):
            assert worker(dtype) == plan_for(index_type).entry_name()
    assert len(log.read_text().splitlines()) == 2
    return root


@pytest.fixture
def built(pristine, tmp_path, monkeypatch, module_counting_cxx):
    """A copy of ``pristine`` (times and modes kept: every entry valid where it lies) as this test's own
    cache root, and the compiler that built it (its path is in the index's stat signature), its log
    emptied: ``(root, {dtype: entry dir}, compile log)``."""
    cxx, log = module_counting_cxx
    root = tmp_path / "cache"
    shutil.copytree(pristine, root)
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(root))
    monkeypatch.setenv("SPARSEKV_CXX", str(cxx))
    log.write_text("")
    entries = {dtype: root / plan_for(index_type).entry_name() for dtype, index_type in (("int64", "int64_t"),
                                                                                        ("int32", "int32_t"))}
    return root, entries, log


def test_a_module_swapped_into_another_entry_is_refused_and_rebuilt(built):
    root, entries, log = built
    # The larger module's place gets the other module, padded to its size, with its mtime: its
    # key.json still vouches for it by size and mtime.
    target, source = sorted(entries.values(), key=lambda e: (e / cache.ARTIFACT).stat().st_size, reverse=True)
    so = target / cache.ARTIFACT
    st = so.stat()
    data = (source / cache.ARTIFACT).read_bytes()
    so.write_bytes(data + bytes(st.st_size - len(data)))
    os.utime(so, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.valid_artifact(target) == so
    dtype = next(d for d, e in entries.items() if e == target)
    assert worker(dtype) == target.name  # refused, rebuilt, and the right module used
    assert len(log.read_text().splitlines()) == 1
    assert worker(dtype) == target.name and len(log.read_text().splitlines()) == 1


def _other_entry_of_the_same_instance(monkeypatch) -> str:
    monkeypatch.setenv("SPARSEKV_EXTRA_CFLAGS", "-DSPARSEKV_TRUST_TEST=1")
    plan = plan_for("int64_t")
    loader.find_or_build(plan, cache.open_roots())
    monkeypatch.delenv("SPARSEKV_EXTRA_CFLAGS")
    return plan.entry_name()


@pytest.mark.parametrize("redirect", ["planted directory", "out of the root", "another entry"])
def test_an_index_entry_redirected_elsewhere_is_not_followed(built, tmp_path, monkeypatch, redirect):
    root, entries, log = built
    # A directory holding a valid entry (the int32 one, which also embeds its own name).
    planted = tmp_path / "planted" / entries["int32"].name
    planted.parent.mkdir(mode=0o700)
    shutil.copytree(entries["int32"], planted)  # times and modes kept: valid where it lies
    target = {"planted directory": str(planted), "out of the root": os.path.relpath(planted, root),
              "another entry": None}[redirect]
    if target is None:
        target = _other_entry_of_the_same_instance(monkeypatch)
    compiles = len(log.read_text().splitlines())
    (index,) = [p for p in (root / loader.INDEX_DIR).iterdir() if json.loads(p.read_text())["entry"] ==
                entries["int64"].name]
    doc = json.loads(index.read_text())
    index.write_text(json.dumps(dict(doc, entry=target)))
    assert worker("int64") == entries["int64"].name  # the module of the request's own key
    assert len(log.read_text().splitlines()) == compiles  # found by its key, nothing rebuilt
    assert json.loads(index.read_text())["entry"] == entries["int64"].name  # and the index repaired


def test_a_module_that_embeds_another_name_is_refused(built):
    _, entries, _ = built
    so = entries["int32"] / cache.ARTIFACT
    with pytest.raises(loader.JitModuleMismatchError, match=f"{so} is not the module of cache entry "
                                                            f"{entries['int64'].name} \\(it was built as "
                                                            f"{entries['int32'].name}\\)"):
        loader._load(so, entries["int64"].name)
    assert loader._load(so, entries["int32"].name).get_function("sparsekv_module_key")() == entries["int32"].name

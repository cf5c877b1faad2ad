"""Compile manners: each compile is logged at INFO with why it is built (not in cache, a header
changed, the compiler changed, the flags changed); the first compile of a process also says once,
at WARNING, that compiling started and how to prebuild."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

from sparsekv.jit_kernel.build import loader


def _request(tmp_path, **changes) -> loader.ModuleRequest:
    header = tmp_path / "csrc" / "family.cuh"
    compiler = tmp_path / "bin" / "c++"
    for path in (header, compiler):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("v1")
    request = loader.ModuleRequest(name="family", template_args=("int32_t",), header="family.cuh", exports=(),
                                   kernels=(), backend="cpu", archs=(), extra_cflags=(), sanitize=(),
                                   csrc=str(header.parent), compilers=(str(compiler),))
    return replace(request, **changes)


def _index(root, request: loader.ModuleRequest) -> None:
    """The index a load of ``request`` leaves (as ``loader._write_index`` writes it)."""
    files = [os.path.join(request.csrc, request.header), *request.compilers]
    doc = {"entry": "family-0", "files": loader._stat_signature(files), "request": loader._request_summary(request)}
    (root / loader.INDEX_DIR).mkdir(parents=True, exist_ok=True)
    (root / loader.INDEX_DIR / f"{request.name}__{request.digest()}.json").write_text(json.dumps(doc))


def test_the_reason_names_what_changed_since_the_last_load(tmp_path):
    root = tmp_path / "cache"
    roots = SimpleNamespace(read=(root,))
    request = _request(tmp_path)
    assert loader.rebuild_reason(request, roots) == "not in cache"
    _index(root, request)
    # Same instance, same flags, files unchanged: the artifact is gone, nothing else differs.
    assert loader.rebuild_reason(request, roots) == "not in cache"
    assert loader.rebuild_reason(replace(request, extra_cflags=("-DX=1",)), roots) == "flags changed"
    assert loader.rebuild_reason(replace(request, template_args=("int64_t",)), roots) == "not in cache"
    (tmp_path / "bin" / "c++").write_text("v2, another size")
    assert loader.rebuild_reason(request, roots) == "compiler changed"
    (tmp_path / "csrc" / "family.cuh").write_text("v2, another size")
    assert loader.rebuild_reason(request, roots) == "header changed: family.cuh"


def test_a_process_says_once_that_it_compiles_and_each_compile_says_why(tmp_path):
    script = ("import sys, torch; from sparsekv.jit_kernel.gather_rows import GATHER_ROWS; "
              "[GATHER_ROWS.module(index_dtype=getattr(torch, d)) for d in sys.argv[1:]]")
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(tmp_path), SPARSEKV_LOG_LEVEL="INFO")
    env.pop("SPARSEKV_EXTRA_CFLAGS", None)

    def run(dtypes=("int32", "int64"), **extra):
        done = subprocess.run([sys.executable, "-c", script, *dtypes], capture_output=True, text=True,
                              env={**env, **extra}, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stderr

    first = run()
    assert len(re.findall(r"WARNING: sparsekv: compiling JIT kernels in this process .*sparsekv jit build", first)) == 1
    assert re.findall(r"INFO: JIT: compiling (gather_rows<\w+>) \(cpu\) \((.*)\)", first) == [
        ("gather_rows<int32_t>", "not in cache"), ("gather_rows<int64_t>", "not in cache")]
    assert run() == ""  # warm: nothing compiles, nothing is said
    flags = run(("int32",), SPARSEKV_EXTRA_CFLAGS="-DSPARSEKV_REBUILD_REASON_TEST=1")  # one compile is enough
    assert re.findall(r"INFO: JIT: compiling gather_rows<int32_t> \(cpu\) \((.*)\)", flags) == ["flags changed"]

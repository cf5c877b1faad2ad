"""Actionable JIT errors: the compiler's first errors, a hint, a command that reproduces them; a failed
module is not recompiled in the same process until its sources change; a strict-mode miss names the
module, its arguments, backend and arch."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import cache, loader, toolchain
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS
from sparsekv.testing.components import needs

CSRC = loader.csrc_root()


def plan_for(csrc: Path = CSRC, backend: str = "cpu", arch: str | None = None):
    return loader.make_plan(GATHER_ROWS.name, ("int64_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                            kernels=GATHER_ROWS.kernels, backend=backend, arch=arch, probe_dir=None, csrc=csrc)


@pytest.fixture
def compiles(counting_cxx, monkeypatch):
    """``compiles()``: how many compiles the host compiler (a counting wrapper) has run so far."""
    wrapper, log = counting_cxx
    monkeypatch.setenv("SPARSEKV_CXX", str(wrapper))
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


def test_compile_error_is_actionable_and_remembered_until_the_sources_change(tmp_path, monkeypatch, compiles):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    header = csrc / "gather_rows.cuh"
    original = header.read_bytes()
    # Many errors: the message keeps the first ones, the exception keeps them all.
    header.write_bytes(original + b"\n" + b"".join(b"int broken_%d = not_declared_%d;\n" % (i, i) for i in range(60)))
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_failed", {})
    roots = cache.open_roots()
    with pytest.raises(loader.JitCompileError) as info:
        loader.find_or_build(plan_for(csrc), roots)
    error = info.value
    message = str(error)
    assert "compiling gather_rows<int64_t> (cpu) failed" in message
    assert re.search(r"not_declared_0.{1,3}was not declared", message)  # the compiler's own first error
    assert "not_declared_59" not in message and "not_declared_59" in error.output  # trimmed, not lost
    assert len(message.splitlines()) < loader.ERROR_LINES + 10
    assert "Reproduce with:" in message and error.command[0].endswith("counting-c++")
    assert compiles() == 1

    # The reproduce command, run as printed, gives the same error.
    command = message.split("Reproduce with:\n", 1)[1].strip()
    again = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and re.search(r"not_declared_0.{1,3}was not declared", again.stderr + again.stdout)
    assert compiles() == 2

    # A second load in the process fails fast, without running the compiler.
    with pytest.raises(loader.JitCompileError, match="remembered") as second:
        loader.find_or_build(plan_for(csrc), roots)
    assert "not_declared_0" in str(second.value)
    assert compiles() == 2

    header.write_bytes(original)  # fixed sources: a new key, compiled at once
    loader.find_or_build(plan_for(csrc), roots)
    assert compiles() == 3


@pytest.mark.parametrize(("output", "hint"), [
    ("nvcc fatal   : Unsupported gpu architecture 'compute_99'", "arch is not supported"),
    ("x.cu:1:10: fatal error: cuda_runtime.h: No such file or directory", "CUDA_HOME"),
    ("m.cpp:3:10: fatal error: foo.h: No such file or directory", "a header was not found"),
    ("/usr/bin/ld: cannot find -lasan", "sanitizer runtime"),
    ("c++: error: unrecognized command-line option '-fbogus'", "SPARSEKV_EXTRA_CFLAGS"),
    ("m.cpp:1:1: error: expected unqualified-id", ""),
])
def test_hints_for_common_causes(output, hint):
    assert (loader.compile_hint(output) == "") == (hint == "")
    assert hint in loader.compile_hint(output)


def _has_nvcc() -> bool:
    try:
        toolchain.nvcc(None)
    except toolchain.ToolchainError:
        return False
    return True


@needs("nvcc", None if _has_nvcc() else "nvcc is not installed")
def test_an_arch_nvcc_does_not_know_gets_the_arch_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(loader.JitCompileError) as info:
        loader.find_or_build(plan_for(backend="cuda", arch="9.9"), cache.open_roots())
    assert "Hint: the CUDA arch is not supported by this nvcc" in str(info.value)
    assert "nvcc" in " ".join(info.value.command)


def test_strict_miss_names_family_args_backend_and_arch(tmp_path, monkeypatch, compiles):
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSEKV_JIT_STRICT", "1")
    with pytest.raises(loader.JitCacheMissError) as info:
        loader.find_or_build(plan_for(), cache.open_roots())
    message = str(info.value)
    assert "gather_rows<int64_t> (cpu)" in message and "SPARSEKV_JIT_STRICT=1" in message
    assert "sparsekv jit build gather_rows" in message
    if _has_nvcc():
        with pytest.raises(loader.JitCacheMissError, match=r"gather_rows<int64_t> \(cuda, arch 9\.0a,10\.0a\)"):
            loader.find_or_build(plan_for(backend="cuda", arch="10.0a,9.0a"), cache.open_roots())
    assert compiles() == 0
    monkeypatch.delenv("SPARSEKV_JIT_STRICT")
    loader.find_or_build(plan_for(), cache.open_roots())
    monkeypatch.setenv("SPARSEKV_JIT_STRICT", "1")
    loader.find_or_build(plan_for(), cache.open_roots())  # a hit loads
    assert compiles() == 1


def test_a_strict_miss_through_a_family_suggests_an_instance_the_cli_accepts(tmp_path, monkeypatch):
    """The suggested `--instance 'NAME:k=v'` is exactly what `sparsekv jit build --instance` parses."""
    import re

    import torch

    from sparsekv.cli import jit as cli
    from sparsekv.jit_kernel.gather_rows import GATHER_ROWS

    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSEKV_JIT_STRICT", "1")
    with pytest.raises(loader.JitCacheMissError) as info:
        GATHER_ROWS.module(index_dtype=torch.int64)
    spec = re.search(r"--instance '([^']+)'", str(info.value)).group(1)
    assert spec == "gather_rows:index_dtype=int64"
    name, _, rest = spec.partition(":")
    values = cli.resolve_instance(GATHER_ROWS, cli.parse_values(rest.split(","), spec))
    assert GATHER_ROWS.template_args(values) == GATHER_ROWS.template_args({"index_dtype": torch.int64})

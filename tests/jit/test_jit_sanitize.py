"""Sanitizer builds of the cpu backend ("memcheck without a GPU"): SPARSEKV_SANITIZE enters the key,
a planted out-of-bounds write and a signed overflow are reported, and a process that did not preload
the ASan runtime gets a clear error instead of an abort."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import loader
from sparsekv.testing.components import needs

HERE = Path(__file__).resolve().parent
PLANTED = "planted_oob.cuh"


def _runtime(name: str) -> str | None:
    found = subprocess.run(["c++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


PRELOAD = [_runtime("libasan.so"), _runtime("libstdc++.so")]
needs_asan = needs("libasan", "the compiler's libasan is not installed" if None in PRELOAD else None)


@pytest.fixture(scope="module")
def csrc(tmp_path_factory) -> Path:
    """The project's headers plus the planted kernel."""
    root = tmp_path_factory.mktemp("planted") / "csrc"
    shutil.copytree(loader.csrc_root(), root)
    shutil.copy(HERE / "data" / PLANTED, root / PLANTED)
    return root


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One cache for the module: each sanitizer setting is its own key, so each compiles once."""
    return tmp_path_factory.mktemp("planted-cache")


SCRIPT = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from sparsekv.jit_kernel.build import cache, loader
    export, template, arg = sys.argv[2], sys.argv[3], sys.argv[4]
    # Both planted entries in one module: one build per sanitizer setting.
    exports = {{name: f"sparsekv::planted::{{name}}" for name in ("write_past_end", "add_one")}}
    plan = loader.make_plan("planted", (template,), header={planted!r}, exports=exports, kernels=(),
                            backend="cpu", arch=None, probe_dir=None, csrc=Path(sys.argv[1]))
    module = loader.find_or_build(plan, cache.open_roots())
    if export == "write_past_end":
        module.write_past_end(torch.zeros(int(arg), dtype=torch.int32))
    else:
        print(module.add_one(int(arg)))
    print("survived", flush=True)
""").format(planted=PLANTED)


def run_planted(csrc: Path, cache_dir: Path, export: str, template: str, arg: str, *, preload: bool = True,
                sanitize: str = "address,undefined") -> subprocess.CompletedProcess:
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir), SPARSEKV_SANITIZE=sanitize,
               ASAN_OPTIONS="detect_leaks=0")
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = " ".join(PRELOAD)
    return subprocess.run([sys.executable, "-c", SCRIPT, str(csrc), export, template, arg],
                          capture_output=True, text=True, env=env, timeout=600)


@needs_asan
def test_a_planted_out_of_bounds_write_is_reported(csrc, cache_dir):
    done = run_planted(csrc, cache_dir, "write_past_end", "int32_t", "7")
    assert done.returncode != 0 and "survived" not in done.stdout
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in done.stderr
    assert "WRITE of size 4" in done.stderr and "write_past_end" in done.stderr  # names the kernel


@needs_asan
def test_a_planted_signed_overflow_is_reported(csrc, cache_dir):
    ok = run_planted(csrc, cache_dir, "add_one", "int32_t", "41")
    assert ok.returncode == 0 and ok.stdout.split() == ["42", "survived"], ok.stderr[-3000:]
    bad = run_planted(csrc, cache_dir, "add_one", "int32_t", str(2**31 - 1))
    assert bad.returncode != 0 and "runtime error: signed integer overflow" in bad.stderr


def test_without_sanitizers_the_planted_bugs_go_unnoticed(csrc, cache_dir):
    """The control: the same bugs, executed in a plain build, are silent, which is why the sanitizer run exists."""
    overflow = run_planted(csrc, cache_dir, "add_one", "int32_t", str(2**31 - 1), preload=False, sanitize="")
    # The overflow ran (it wrapped to INT32_MIN) and nothing said so.
    assert overflow.returncode == 0 and overflow.stdout.split() == [str(-(2**31)), "survived"], overflow.stderr[-3000:]
    assert "runtime error" not in overflow.stderr
    # One int past a 7-int tensor lands in the allocation's padding: the process goes on, unaware.
    write = run_planted(csrc, cache_dir, "write_past_end", "int32_t", "7", preload=False, sanitize="")
    assert write.returncode == 0 and write.stdout.split() == ["survived"], write.stderr[-3000:]
    assert "AddressSanitizer" not in write.stderr


def test_asan_module_without_the_runtime_preloaded_is_a_clear_error(csrc, cache_dir):
    done = run_planted(csrc, cache_dir, "add_one", "int32_t", "41", preload=False, sanitize="address")
    assert done.returncode == 1 and "JitSanitizerError" in done.stderr and "LD_PRELOAD" in done.stderr
    assert "AddressSanitizer" not in done.stderr  # refused before loading, not aborted by ASan


def test_sanitizers_are_part_of_the_key(monkeypatch):
    from sparsekv.jit_kernel.gather_rows import GATHER_ROWS

    def entry() -> str:
        return loader.make_plan(GATHER_ROWS.name, ("int64_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                                kernels=(), backend="cpu", arch=None, probe_dir=None).entry_name()

    monkeypatch.delenv("SPARSEKV_SANITIZE", raising=False)  # `make test-sanitize` sets it
    plain = entry()
    monkeypatch.setenv("SPARSEKV_SANITIZE", "address")
    asan = entry()
    monkeypatch.setenv("SPARSEKV_SANITIZE", "undefined,address")
    both = entry()
    assert len({plain, asan, both}) == 3
    monkeypatch.setenv("SPARSEKV_SANITIZE", "thread")
    with pytest.raises(ValueError, match="unknown sanitizers"):
        entry()

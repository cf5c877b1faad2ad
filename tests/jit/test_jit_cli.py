"""`sparsekv jit` manners: help with examples, one-line errors with exit 2 (usage) or 1 (failure),
tracebacks only under --debug, a quiet broken pipe, no progress bar off a terminal, consistent
counts, and one log line per compile with -v or SPARSEKV_JIT_VERBOSE=1."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest

from sparsekv.cli import jit as cli
from sparsekv.cli import main
from sparsekv.jit_kernel.build import cache
from sparsekv.jit_kernel.build.registry import discover
from sparsekv.srt.model_executor.deployment import model_instances
from sparsekv.testing.components import gpu_only

NO_ARCH_ENV = {"SPARSEKV_CUDA_ARCH": "", "TVM_FFI_CUDA_ARCH_LIST": ""}


@pytest.fixture
def jit(sparsekv_cli):
    """``jit(*args, cache_dir=..., **env)``: ``sparsekv jit ARGS`` in this process (``sparsekv_cli``)."""
    return functools.partial(sparsekv_cli, "jit")


@pytest.mark.parametrize("action", sorted(cli.ACTIONS))
def test_every_subcommand_has_help_with_an_example(action, tmp_path, jit):
    done = jit(action, "--help", cache_dir=tmp_path)
    assert done.returncode == 0
    assert "examples:" in done.stdout and f"sparsekv jit {action}" in done.stdout.split("examples:")[1]


def _gpu_visible() -> bool:
    try:
        from cuda.bindings import runtime

        err, count = runtime.cudaGetDeviceCount()
        return int(err) == 0 and count > 0
    except Exception:  # noqa: BLE001 - no driver at all
        return False


BAD_ARGUMENTS = [
    (("nosuch",), 2, "invalid choice"),
    (("build",), 2, "--all"),
    (("build", "no_such_kernel"), 2, "unknown kernel family 'no_such_kernel'"),
    (("build", "--backend", "cuda", "--arch", "banana", "--all"), 2, "'banana' is malformed"),
    (("build", "--instance", "gather_rows:index_dtype=float"), 2, "index_dtype"),
    (("build", "--instance", "gather_rows:dtype=int64_t"), 2, "no parameter 'dtype'"),
    (("build", "--instance", "gather_rows:index_type"), 2, "expected k=v"),
    (("build", "--hot-buffer", "8", "gather_rows"), 2, "go with --model"),
    (("build", "--model", "dsv4-pro", "--hot-buffer", "8"), 2, "must be >="),
    (("build", "--model", "dsv4-flash", "--page-size", "3"), 2, "--page-size must be one of (128, 256, 512)"),
    (("build", "--jobs", "0", "gather_rows"), 2, "an integer >= 1"),
    (("build", "--triton", "--arch", "9.0a", "dsv4_quant.nosuch"), 2, "no Triton kernel is named 'dsv4_quant.nosuch'"),
    (("build", "--triton", "--all"), 2, "--triton builds the Triton kernels only"),
    (("prune",), 2, "--older-than"),
    (("prune", "--max-size", "lots"), 2, "not a size"),
    (("explain-key",), 2, "name a kernel family"),
    (("explain-key", "--diff", "missing-a.json", "missing-b.json"), 1, "cannot read"),
    (("import", "missing.tar"), 1, "not a readable bundle"),
    # A missing parameter names it and shows a form that works, never a Python function's name.
    (("explain-key", "gather_rows"), 2, "index_dtype not given; e.g. 'gather_rows:index_dtype="),
    (("build", "--instance", "hisparse:num_top_k=abc"), 2, "hot_buffer_size not given; e.g. 'hisparse:"),
    (("export", "out.tar"), 2, "--all, --instance or --model"),
]


@pytest.mark.parametrize(("args", "code", "message"), BAD_ARGUMENTS, ids=[" ".join(a) for a, _, _ in BAD_ARGUMENTS])
def test_bad_arguments_give_one_line_and_the_exit_code(args, code, message, tmp_path, monkeypatch, capsys):
    # In this process (``main`` returns the exit code; an exception escaping it fails the test): none of
    # these compiles, and a fresh interpreter would import torch again for each, about 2 CPU s.
    for name, value in {"SPARSEKV_CACHE_DIR": str(tmp_path / "cache"), **NO_ARCH_ENV}.items():
        monkeypatch.setenv(name, value)
    returncode = main(["jit", *args])
    out, err = capsys.readouterr()
    assert returncode == code, err
    assert "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not re.search(r"\b_[a-z]\w*\(\)", err), err  # no Python-internal function names


@pytest.mark.skipif(_gpu_visible(), reason=gpu_only("a GPU is visible: its arch is used"))
def test_cuda_build_without_an_arch_or_a_gpu_says_what_to_set(tmp_path, jit):
    done = jit("build", "--backend", "cuda", "--all", cache_dir=tmp_path, **NO_ARCH_ENV)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "SPARSEKV_CUDA_ARCH" in done.stderr


def test_a_compile_error_is_the_compiler_message_without_a_traceback_unless_debug(tmp_path, jit):
    flags = {"SPARSEKV_EXTRA_CFLAGS": "-include sparsekv_no_such_header.h"}
    done = jit("build", "--instance", "gather_rows:index_dtype=int64", cache_dir=tmp_path, **flags)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("sparsekv jit build: error: JitCompileError: compiling gather_rows<int64_t> (cpu) "
                                  "failed")
    assert "sparsekv_no_such_header.h: No such file or directory" in done.stderr
    assert "Hint: a header was not found" in done.stderr and "Reproduce with:" in done.stderr
    debug = jit("build", "--debug", "--instance", "gather_rows:index_dtype=int64", cache_dir=tmp_path, **flags)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "JitCompileError" in debug.stderr


def test_broken_pipe_is_quiet(tmp_path):
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(tmp_path))
    # `sparsekv jit list | head -1`, with a reader that is gone before anything is written.
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "list"], stdout=write, stderr=subprocess.PIPE,
                          text=True, env=env, timeout=300)
    os.close(write)
    assert done.returncode == 0 and done.stderr == ""
    shell = subprocess.run(f"{sys.executable} -m sparsekv jit list --json | head -1", shell=True, capture_output=True,
                           text=True, env=env, timeout=300)
    assert shell.stdout.strip() == "[" and shell.stderr == ""


def test_build_progress_logs_and_counts(tmp_path, jit):
    cache_dir = tmp_path / "cache"
    built = jit("build", "gather_rows", "-v", cache_dir=cache_dir)
    assert built.returncode == 0, built.stderr
    assert "\r" not in built.stderr + built.stdout  # no progress bar off a terminal
    compiles = re.findall(r"sparsekv\.jit(?: INFO)?: JIT: compiled gather_rows<(int32_t|int64_t)> \(cpu\) in [0-9.]+ s",
                          built.stderr)
    assert sorted(compiles) == ["int32_t", "int64_t"]  # one line per compile, with its time
    quiet = jit("build", "gather_rows", cache_dir=cache_dir)
    assert quiet.stderr == ""
    # SPARSEKV_LOG_LEVEL=INFO shows the same lines: tests/cli/test_cli_manners.py (one compile each way).
    bad_level = jit("info", cache_dir=cache_dir, SPARSEKV_LOG_LEVEL="loud")
    assert bad_level.returncode == 2 and "SPARSEKV_LOG_LEVEL" in bad_level.stderr

    # info, clean --dry-run and clean count the same entries.
    (cache_dir / "not-an-entry").mkdir()
    info = json.loads(jit("info", "--json", cache_dir=cache_dir).stdout)
    assert info["entries"] == 2 == len(cache.entries(cache_dir))
    dry = json.loads(jit("clean", "--dry-run", "--json", cache_dir=cache_dir).stdout)
    assert len(dry["entries"]) == 2 and len(cache.entries(cache_dir)) == 2
    cleaned = jit("clean", cache_dir=cache_dir)
    assert "removed 2 entries" in cleaned.stdout
    assert json.loads(jit("info", "--json", cache_dir=cache_dir).stdout)["entries"] == 0


def test_list_json_carries_what_the_table_shows(tmp_path, jit):
    assert jit("build", "--instance", "gather_rows:index_dtype=int32", cache_dir=tmp_path).returncode == 0
    rows = json.loads(jit("list", "--json", cache_dir=tmp_path).stdout)
    families = discover()
    assert len(rows) == sum(len(f.instances) for f in families.values())
    cached = {r["instance"]: r["cached"] for r in rows if r["cached"]}
    assert list(cached) == ["gather_rows<index_dtype=torch.int32>"]
    assert cached["gather_rows<index_dtype=torch.int32>"][0]["state"] == "current"
    table = jit("list", cache_dir=tmp_path).stdout
    assert re.search(r"gather_rows<index_dtype=torch.int32>\s+cached: cpu\n", table)


def test_verbose_env_shows_one_line_per_compile_in_a_library_process(tmp_path):
    script = ("import torch; from sparsekv.jit_kernel.gather_rows import GATHER_ROWS; "
              "GATHER_ROWS.module(index_dtype=torch.int32)")
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(tmp_path), SPARSEKV_JIT_VERBOSE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "compiled" in line]
    compiled = r"sparsekv\.jit INFO: JIT: compiled gather_rows<int32_t> \(cpu\) in [0-9.]+ s"
    assert len(lines) == 1 and re.fullmatch(compiled, lines[0])
    assert "-shared module.cpp" in done.stderr  # and the command line
    env.pop("SPARSEKV_JIT_VERBOSE")
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stderr == ""


def test_instances_of_a_model_resolve_to_table_entries():
    families = discover()
    for model, top_k in (("dsv4-flash", 512), ("dsv4-pro", 1024)):
        resolved = {name: cli.resolve_instance(families[name], values)
                    for name, values in model_instances(model)}
        assert (resolved["hisparse"]["num_top_k"], resolved["hisparse"]["hot_buffer_size"]) == (top_k, 2 * top_k)
        assert resolved["hisparse"] in families["hisparse"].instances
        assert resolved["hisparse_copy"]["page_slots"] == 64  # C4 page of the default 256-token page
    pro_512 = dict(model_instances("dsv4-pro", page_size=512))
    assert pro_512["hisparse_copy"]["page_slots"] == 128


def test_parse_values_types():
    assert cli.parse_values(["k=64", "b=true", "t=int64_t", "h=0x10"], "x") == {"k": 64, "b": True, "t": "int64_t",
                                                                               "h": 16}

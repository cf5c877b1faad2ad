"""The `sparsekv` console script: version, `jit list/info/build/clean` against a private cache."""

from __future__ import annotations

import json
import subprocess
import sys

import sparsekv
from sparsekv.jit_kernel.build.registry import discover


def test_version():
    done = subprocess.run([sys.executable, "-m", "sparsekv", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"sparsekv {sparsekv.__version__}"


def test_jit_build_list_info_clean(tmp_path, sparsekv_cli):
    # One instance (one compile); building a family's whole table by name: test_jit_cli.py.
    cache_dir = tmp_path / "cache"
    built = sparsekv_cli("jit", "build", "--instance", "gather_rows:index_dtype=int32", cache_dir=cache_dir)
    assert built.returncode == 0, built.stderr
    assert "built 1 module instances for the cpu backend" in built.stdout
    assert "\r" not in built.stderr  # no progress bar when stderr is not a terminal

    listed = sparsekv_cli("jit", "list", cache_dir=cache_dir)
    assert listed.returncode == 0
    for family in discover().values():
        assert family.name in listed.stdout
    gather_lines = {line.split()[0]: line for line in listed.stdout.splitlines() if "gather_rows<" in line}
    assert len(gather_lines) == 2 and "cached: cpu" in gather_lines["gather_rows<index_dtype=torch.int32>"]
    assert gather_lines["gather_rows<index_dtype=torch.int64>"].rstrip().endswith("cached: -")

    info = json.loads(sparsekv_cli("jit", "info", "--json", cache_dir=cache_dir).stdout)
    assert info["entries"] == 1 and info["bytes"] > 0 and info["cache_dir"] == str(cache_dir)

    assert sparsekv_cli("jit", "clean", cache_dir=cache_dir).returncode == 0
    assert json.loads(sparsekv_cli("jit", "info", "--json", cache_dir=cache_dir).stdout)["entries"] == 0


def test_unknown_family_is_a_usage_error(tmp_path, sparsekv_cli):
    done = sparsekv_cli("jit", "build", "no_such_kernel", cache_dir=tmp_path / "cache")
    assert done.returncode == 2 and "unknown kernel family" in done.stderr


def test_list_marks_stale_entries_and_clean_stale_removes_only_them(tmp_path, sparsekv_cli, monkeypatch):
    cache_dir = tmp_path / "cache"
    instance = ("--instance", "gather_rows:index_dtype=int32")  # one instance: two compiles in all

    def listed() -> str:
        lines = sparsekv_cli("jit", "list", cache_dir=cache_dir).stdout.splitlines()
        return next(line for line in lines if line.startswith("gather_rows<index_dtype=torch.int32>"))

    # An entry built with other flags is one a load would no longer use.
    monkeypatch.setenv("SPARSEKV_EXTRA_CFLAGS", "-DSPARSEKV_OLD_FLAGS=1")
    assert sparsekv_cli("jit", "build", *instance, cache_dir=cache_dir).returncode == 0
    monkeypatch.delenv("SPARSEKV_EXTRA_CFLAGS")
    assert sparsekv_cli("jit", "build", *instance, cache_dir=cache_dir).returncode == 0
    line = listed()
    assert line.count("cpu (stale)") == 1 and line.count("cpu") == 2, line
    cleaned = sparsekv_cli("jit", "clean", "--stale", cache_dir=cache_dir)
    assert "removed 1 stale entries" in cleaned.stdout
    assert listed().rstrip().endswith("cached: cpu")


def test_clean_stale_keeps_a_current_instance_outside_the_table(tmp_path, sparsekv_cli):
    # Open instantiation: a (K, H) no table lists compiles at first use, and is not stale for that.
    cache_dir = tmp_path / "cache"
    code = ("from sparsekv.jit_kernel.hisparse import SWAP_IN; "
            "SWAP_IN.module(num_top_k=4, hot_buffer_size=4)")
    import os

    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir))
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=600).returncode == 0
    cleaned = sparsekv_cli("jit", "clean", "--stale", cache_dir=cache_dir)
    assert "removed 0 stale entries" in cleaned.stdout
    assert json.loads(sparsekv_cli("jit", "info", "--json", cache_dir=cache_dir).stdout)["entries"] == 1

"""`sparsekv jit explain-key`: every key input, no absolute path (two checkouts agree), each input
perturbed changes the key, and `--diff` names the inputs two machines disagree on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tvm_ffi

from sparsekv.cli import jit as cli
from sparsekv.cli import main
from sparsekv.jit_kernel.build import loader, toolchain
from sparsekv.jit_kernel.build.registry import discover
from sparsekv.testing.components import needs

CSRC = loader.csrc_root()
FAMILY = discover()["gather_rows"]


def explain(csrc: Path = CSRC, instance: dict | None = None, backend: str = "cpu", arch=None) -> dict:
    return cli.explain(FAMILY, instance or {"index_dtype": torch.int64}, backend, arch, csrc=csrc)


def test_two_checkouts_explain_identically_and_without_paths(two_checkouts):
    a, b = two_checkouts
    doc_a, doc_b = explain(a), explain(b)
    assert doc_a == doc_b
    text = json.dumps(doc_a)
    for path in (str(a), str(b), str(CSRC), toolchain.host_compiler_path()):
        assert path not in text
    assert set(doc_a["key"]["include_closure"]) == {"gather_rows.cuh", "include/sparsekv/ffi.h",
                                                    "include/sparsekv/kv_layout.h",
                                                    "include/sparsekv/portability.h"}
    assert doc_a["entry"] == loader.entry_name(doc_a["key"])


def _nvcc_missing() -> bool:
    try:
        toolchain.nvcc(None)
    except toolchain.ToolchainError:
        return True
    return False


def _fake_compiler(tmp_path: Path, version: str) -> str:
    path = tmp_path / "bin" / "c++"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'#!/bin/sh\n[ "$1" = --version ] && echo "{version}" && exit 0\nexec c++ "$@"\n')
    path.chmod(0o755)
    return str(path)


# (name, how to perturb it, the key fields that must change)
PERTURBATIONS = {
    "header bytes": (lambda a, mp, tmp: open(a / "include/sparsekv/portability.h", "a").write("\n// x\n"),
                     {"include_closure.include/sparsekv/portability.h"}),
    "template args": (None, {"template_args", "sources.module.cpp"}),
    "extra flags": (lambda a, mp, tmp: mp.setenv("SPARSEKV_EXTRA_CFLAGS", "-DX=1"), {"extra_cflags"}),
    "sanitizers": (lambda a, mp, tmp: mp.setenv("SPARSEKV_SANITIZE", "undefined"), {"sanitize"}),
    "compiler": (lambda a, mp, tmp: mp.setenv("SPARSEKV_CXX", _fake_compiler(tmp, "c++ (other) 99.1")), {"cxx"}),
    "tvm-ffi": (lambda a, mp, tmp: mp.setattr(tvm_ffi, "__version__", "9.9.9"), {"tvm_ffi"}),
    "loader format": (lambda a, mp, tmp: mp.setattr(loader, "LOADER_FORMAT", loader.LOADER_FORMAT + 1),
                      {"loader_format"}),
    "compile flags": (lambda a, mp, tmp: mp.setattr(loader, "CXX_FLAGS", loader.CXX_FLAGS + ("-g",)), {"cxx_flags"}),
}


@pytest.mark.parametrize("what", sorted(PERTURBATIONS))
def test_each_key_input_perturbed_changes_the_key(what, two_checkouts, monkeypatch, tmp_path):
    a, _ = two_checkouts
    base = explain(a)
    perturb, fields = PERTURBATIONS[what]
    if perturb is None:
        after = explain(a, instance={"index_dtype": torch.int32})
    else:
        perturb(a, monkeypatch, tmp_path)
        after = explain(a)
    assert after["entry"] != base["entry"]
    changed = {field for field, _, _ in cli.diff_keys(base, after)}
    assert changed == fields


@needs("nvcc", "nvcc is not installed" if _nvcc_missing() else None)
def test_backend_and_arch_change_the_key():
    cpu, sm90 = explain(), explain(backend="cuda", arch="9.0a")
    both = explain(backend="cuda", arch="9.0a,10.0a")
    assert len({cpu["entry"], sm90["entry"], both["entry"]}) == 3
    assert {f for f, _, _ in cli.diff_keys(sm90, both)} == {"archs"}


def test_every_field_of_the_key_document_enters_the_entry_name():
    doc = explain()["key"]
    base = loader.entry_name(doc)
    for field, value in doc.items():
        other = (value + ["x"] if isinstance(value, list) else dict(value, x="y") if isinstance(value, dict)
                 else value + 1 if isinstance(value, int) else "x" if value is None else value + "x")
        assert loader.entry_name(dict(doc, **{field: other})) != base, field


def test_cli_json_and_diff(tmp_path, monkeypatch, capsys):
    """``sparsekv jit explain-key`` through ``main`` in this process (a process per call would import
    torch again each time; nothing compiles); the command as a process: ``test_cli_json_in_a_process``."""
    monkeypatch.setenv("SPARSEKV_CACHE_DIR", str(tmp_path / "cache"))

    def run(*args, **extra):
        with monkeypatch.context() as patch:
            for name, value in extra.items():
                patch.setenv(name, value)
            returncode = main(["jit", "explain-key", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, returncode, out, err)

    a = run("gather_rows", "index_dtype=int64", "--json")
    assert a.returncode == 0, a.stderr
    doc = json.loads(a.stdout)
    assert doc == explain()
    b = run("gather_rows", "index_dtype=int64", "--json", SPARSEKV_EXTRA_CFLAGS="-DFAST=1")
    (tmp_path / "a.json").write_text(a.stdout)
    (tmp_path / "b.json").write_text(b.stdout)
    diff = run("--diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json")
    assert diff.returncode == 1  # as diff(1): the keys differ
    assert json.loads(diff.stdout) == {"identical": False,
                                       "differences": [{"field": "extra_cflags", "a": [], "b": ["-DFAST=1"]}]}
    text = run("--diff", str(tmp_path / "a.json"), str(tmp_path / "a.json"))
    assert text.stdout.strip() == "identical keys" and text.returncode == 0
    one = run("--diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert one.stdout.splitlines()[0] == "1 key input differs:"
    plain = run("gather_rows", "index_dtype=int64")
    assert plain.stdout.splitlines()[0] == f"gather_rows<index_dtype=torch.int64> -> entry {doc['entry']}"


def test_cli_json_in_a_process(tmp_path):
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "explain-key", "gather_rows", "index_dtype=int64",
                           "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout) == explain()

"""Ahead-of-time compile of the Triton kernels for sm_90a and sm_100a, with no GPU: a kernel that
cannot compile for Hopper or Blackwell fails here. The CLI prints each kernel's registers and shared
memory from the compiled cubin and metadata; a second build finds every kernel in the cache (its key:
source, signature, constexprs, warps, arch and triton version). The quantizer's and the store's PTX
store 64-bit words; the store's has no FMA.

CI cost (a Triton compile is seconds of one core): by default a sample, :func:`sample`, every kernel
for one arch at least; ``--slow`` compiles every kernel for both."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsekv.testing.components import needs

pytestmark = needs("triton", None if importlib.util.find_spec("triton") else "triton is not installed")

ARCHS = ["9.0a", "10.0a"]


def sample(names: list[str]) -> set[tuple[str, str]]:
    """The (kernel, arch) pairs compiled by default: each kernel's first variant (``partial[bf16]`` of
    ``dsv4_attention.partial[...]``: the tables list the serving one first, the one ``test_sass.py``
    builds for both archs, sharing triton's cache) for both archs, each other variant for one arch,
    alternating, so every family and every kernel meet both archs."""
    pairs, seen = set(), {}
    for name in names:
        variant = seen.setdefault(name.split("[")[0], 0)
        seen[name.split("[")[0]] += 1
        pairs |= {(name, arch) for arch in ARCHS} if variant == 0 else {(name, ARCHS[variant % 2])}
    return pairs


def build(cache_dir: Path, pairs: set[tuple[str, str]], every: bool) -> dict:
    """``jit build --triton --json`` of ``pairs``: one call for every kernel and arch (``every``), else one
    per arch naming its kernels; the reports of all calls."""
    # Compiling needs real @triton.jit functions: the interpreter, on in CPU sessions, stays out.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SPARSEKV_CACHE_DIR"] = str(cache_dir)
    calls = [[",".join(ARCHS)]] if every else [[arch, *sorted(n for n, a in pairs if a == arch)] for arch in ARCHS]
    kernels = []
    for arch, *names in calls:
        done = subprocess.run([sys.executable, "-m", "sparsekv", "jit", "build", "--triton", "--arch", arch, *names,
                               "--json"], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        kernels += json.loads(done.stdout)["kernels"]
    return {"kernels": kernels}


@pytest.fixture(scope="module")
def aot_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("triton-aot")


def test_the_sample_compiles_every_kernel_and_every_family_for_both_archs():
    from sparsekv.jit_kernel.triton.aot import aot_kernels

    names = [k.name for k in aot_kernels()]
    pairs = sample(names)
    assert {n for n, _ in pairs} == set(names) and len(pairs) < 2 * len(names)
    for base in {n.split("[")[0] for n in names}:
        assert {a for n, a in pairs if n.split("[")[0] == base} == set(ARCHS), base
    # the variants test_sass.py disassembles for both archs
    assert {("dsv4_attention.partial[bf16]", a) for a in ARCHS} <= pairs
    assert {("dsv4_indexer.scores[fp8,bf16]", a) for a in ARCHS} <= pairs


def test_every_triton_kernel_compiles_for_sm90a_and_sm100a_and_reports_its_resources(aot_cache, request):
    from sparsekv.jit_kernel.triton.aot import aot_kernels

    every = request.config.getoption("--slow")
    names = [k.name for k in aot_kernels()]
    expected = {(n, arch) for n in names for arch in ARCHS} if every else sample(names)
    doc = build(aot_cache, expected, every)
    built = {(r["kernel"], r["arch"]): r for r in doc["kernels"]}
    assert set(built) == expected
    for (name, arch), report in sorted(built.items()):
        print(f"{name:<40} {arch:>6} {report['registers']:>4} registers {report['shared_bytes']:>7} B shared")
        assert 1 <= report["registers"] <= 255, report
        entry = aot_cache / ".triton" / report["key"]
        assert (entry / "kernel.cubin").stat().st_size == report["cubin_bytes"]
        # The PTX is for the arch asked for (the 'a' variants carry wgmma / tcgen05).
        ptx = (entry / "kernel.ptx").read_text()
        assert f".target sm_{arch.replace('.', '')}" in ptx, ptx[:400]
    # The attention and indexer-score dots run on the tensor cores (wgmma on Hopper, tcgen05 on
    # Blackwell), their operands staged in shared memory; a 16-head attention program's products
    # (M = 16, below wgmma's 64) on the warp MMA.
    tensor_core = {"9.0a": "wgmma.mma_async", "10.0a": "tcgen05.mma"}
    for name, arch in built:
        if name.startswith(("dsv4_attention.partial", "dsv4_indexer.scores")):
            report = built[name, arch]
            ptx = (aot_cache / ".triton" / report["key"] / "kernel.ptx").read_text()
            assert ("mma.sync.aligned.m16n8k16" if "16 heads" in name else tensor_core[arch]) in ptx, name
            assert report["shared_bytes"] > 0, report
        # The attention's last program of a row combines: one acq_rel atomic arrival per program, and the
        # other programs' partials read from L2 (ld.global.cg), past the SM's L1.
        if name.startswith("dsv4_attention.partial"):
            ptx = (aot_cache / ".triton" / built[name, arch]["key"] / "kernel.ptx").read_text()
            arrivals = re.findall(r"atom\.global\.(?:gpu\.acq_rel|acq_rel\.gpu)\.add", ptx)
            assert len(arrivals) == 1 and "ld.global.cg" in ptx, name
    # The quantizer and the store write their records as 64-bit words (the indexer scales: one 32-bit
    # word), never byte by byte.
    for name, arch in built:
        if name.startswith(("dsv4_quant.", "dsv4_store.")):
            ptx = (aot_cache / ".triton" / built[name, arch]["key"] / "kernel.ptx").read_text()
            assert "st.global.b64" in ptx and "st.global.b8" not in ptx and "st.global.u8" not in ptx, name
        if name.startswith("dsv4_store."):  # each product and sum rounded as the header does: no FMA
            ptx = (aot_cache / ".triton" / built[name, arch]["key"] / "kernel.ptx").read_text()
            assert "fma." not in ptx and "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, name
    # The compressor (alone and fused with the store) rounds as the header does: float32 adds and
    # multiplies carry .rn (FMA contraction off, so ptxas cannot fuse them), acc / sum is the IEEE
    # division, not div.full's approximation, and libdevice's expf runs its non-flushing variant (the
    # header's). The fused store writes its records as words, like the quantizer.
    for name, arch in built:
        if name.startswith(("dsv4_compress.", "dsv4_compress_store.prefill", "dsv4_compress_store.decode")):
            ptx = (aot_cache / ".triton" / built[name, arch]["key"] / "kernel.ptx").read_text()
            assert "div.rn.f32" in ptx and not re.search(r"\bdiv\.(full|approx)\.f32", ptx), name
            assert not re.search(r"\b(add|sub|mul)\.f32", ptx), name
            assert not re.search(r"\bfma\.\w+\.ftz\.f32", ptx), name  # libdevice's expf keeps subnormals
            if name.startswith("dsv4_compress_store."):  # the decode step's one byte: its emitted flag
                bytes_stored = len(re.findall(r"st\.global\.[bu]8", ptx))
                assert bytes_stored == (1 if ".decode" in name else 0), (name, bytes_stored)
    assert len({r["key"] for r in doc["kernels"]}) == len(expected)  # the arch is part of the key
    again = build(aot_cache, expected, every)
    assert all(r["cached"] for r in again["kernels"])
    assert {r["key"] for r in again["kernels"]} == {r["key"] for r in doc["kernels"]}


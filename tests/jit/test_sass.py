"""SASS checks without a GPU: every hot kernel, built for sm_90a and sm_100a by nvcc (the headers)
and by the Triton AOT build (the twins), read with cuobjdump (``sparsekv.testing.sass``) and held
to the properties of issue 36: no local memory, wide gathers and stores, the hardware fp8 decode
and encode, tensor cores with N >= 16, the intended CTAs per SM.

The expectations are one table, :data:`SASS_TABLE`: per kernel, its launch (threads per CTA, the
CTAs per SM its design intends) and, per property it is held to, ``PASS`` or the reason it fails
today, for both archs or per arch. A failing entry is ``xfail(strict=True)``: when a kernel
improves, its test fails until the entry is changed to ``PASS`` -- edit the table in the same
commit as the kernel. A property a kernel is not held to is left out. ``docs/sass.md`` shows the
table; a test below keeps it equal to this one.

CI cost: only each hot kernel's serving instance is built, with the key the nvcc build of
``tests/jit/test_jit_cuda.py`` uses (``--arch 9.0a,10.0a``; it builds the first instance this table
names of each family) and the Triton AOT path (triton's own cache shares its compiles with
``test_triton_aot.py``). The rows of an instance no other test builds by default (the indexer
caches' store and compress-store headers, the fp4 indexer's scores) are ``slow=True``: they run
under ``--slow``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from sparsekv.testing.components import needs
from sparsekv.testing.sass import (
    PROPERTIES,
    KernelSass,
    Launch,
    cuda_artifact,
    disassemble,
    inner_loop,
    missing_sass_tools,
)

REPO = Path(__file__).resolve().parents[2]
ARCHS = ("9.0a", "10.0a")
PASS = "pass"

# (build, module, kernel): the launch, then property -> PASS | reason | {arch: PASS | reason}; slow=True:
# tested under --slow only (an instance no other test builds: two cold nvcc compiles, see docs/sass.md).
# build "cuda": module = the header family's instance (as `sparsekv jit build --instance` names it),
# kernel = a substring of the kernel's mangled name;
# build "triton": module = the AotKernel's name, kernel = "".
SASS_TABLE = {
    ("cuda", "dsv4_attention:q_dtype=bfloat16", "partial_kernel"): dict(
        launch=Launch(256, 1),
        no_local=PASS, wide_gather=PASS, fp8_convert=PASS, tensor_cores=PASS, occupancy=PASS),
    ("cuda", "dsv4_attention:q_dtype=float32", "partial_kernel"): dict(
        launch=Launch(256, 1),
        no_local=PASS, wide_gather=PASS, fp8_convert=PASS, tensor_cores=PASS, occupancy=PASS),
    ("triton", "dsv4_attention.partial[bf16]", ""): dict(
        launch=Launch(256, 1),
        no_local=PASS, wide_gather=PASS, fp8_convert=PASS, tensor_cores=PASS,
        occupancy=PASS),
    ("triton", "dsv4_attention.partial[fp32,16 heads]", ""): dict(
        launch=Launch(128, 2),
        no_local=PASS, wide_gather=PASS, fp8_convert=PASS, tensor_cores=PASS, occupancy=PASS),
    ("cuda", "dsv4_indexer:layout=fp8,q_dtype=bfloat16", "scores_kernel"): dict(
        launch=Launch(256, 2),
        no_local=PASS, wide_gather=PASS, fp8_convert=PASS, tensor_cores=PASS, occupancy=PASS),
    ("cuda", "dsv4_indexer:layout=fp4,q_dtype=bfloat16", "scores_kernel"): dict(
        launch=Launch(256, 2), slow=True, no_local=PASS, wide_gather=PASS, tensor_cores=PASS, occupancy=PASS),
    ("triton", "dsv4_indexer.scores[fp8,bf16]", ""): dict(
        launch=Launch(128, 2),
        no_local=PASS, wide_gather=PASS, fp8_convert=PASS, tensor_cores=PASS, occupancy=PASS),
    ("triton", "dsv4_indexer.scores[fp4,bf16]", ""): dict(
        launch=Launch(128, 2), no_local=PASS, wide_gather=PASS, tensor_cores=PASS, occupancy=PASS),
    ("cuda", "dsv4_indexer_topk", "topk_kernel"): dict(launch=Launch(1024, 1), no_local=PASS, occupancy=PASS),
    ("cuda", "dsv4_indexer_topk", "topk_clear_kernel"): dict(launch=Launch(1024, 1), no_local=PASS, occupancy=PASS),
    ("triton", "dsv4_indexer.topk_chunk", ""): dict(launch=Launch(256, 2), no_local=PASS, occupancy=PASS),
    ("triton", "dsv4_indexer.topk_finish", ""): dict(launch=Launch(512, 1), no_local=PASS, occupancy=PASS),
    # The compressor's kernels (PoolEvents<ratio, bf16 ring, 16-byte loads>): C4's and C128's 16-byte
    # variants (C128's a CTA per event chunk), then the channel-a-lane ones (rows off a 16-byte boundary).
    ("cuda", "dsv4_compress", "PoolEventsILl4ELb0ELb1E"): dict(
        launch=Launch(256, 2), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl4ELb1ELb1E"): dict(
        launch=Launch(256, 2), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl128ELb0ELb1E"): dict(
        launch=Launch(256, 1), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl128ELb1ELb1E"): dict(
        launch=Launch(256, 1), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl4ELb0ELb0E"): dict(launch=Launch(256, 4), no_local=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl4ELb1ELb0E"): dict(launch=Launch(256, 4), no_local=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl128ELb0ELb0E"): dict(launch=Launch(256, 4), no_local=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PoolEventsILl128ELb1ELb0E"): dict(launch=Launch(256, 4), no_local=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "OnlineC128"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "RingWrite"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress", "PlanRawStep"): dict(launch=Launch(256, 4), no_local=PASS, occupancy=PASS),
    ("triton", "dsv4_compress.pool[C4,d512]", ""): dict(
        launch=Launch(64, 4), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    # The fused compress-store's kernels: HeldStore<kind, bf16 ring> (C4 from 16-byte aligned rows,
    # the compressor's held form), SplitStore<kind, bf16 ring> (C128 from 16-byte aligned rows, the
    # compressor's split form), StreamedStore<kind> (a channel a lane: rows off 16 bytes).
    ("cuda", "dsv4_compress_store:cache_kind=V4", "HeldStoreINS_10dsv4_store2V4ELb0E"): dict(
        launch=Launch(256, 2, flag_stores=1),
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=V4", "HeldStoreINS_10dsv4_store2V4ELb1E"): dict(
        launch=Launch(256, 2, flag_stores=1),
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=V4", "SplitStoreINS_10dsv4_store2V4ELb0E"): dict(
        launch=Launch(256, 1, flag_stores=1),
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=V4", "SplitStoreINS_10dsv4_store2V4ELb1E"): dict(
        launch=Launch(256, 1, flag_stores=1),
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=V4", "StreamedStore"): dict(
        launch=Launch(256, 4, flag_stores=1),
        no_local=PASS,
        wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=V4", "StoreRingWrite"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP8", "HeldStoreINS_10dsv4_store10IndexerFp8ELb0E"): dict(
        launch=Launch(256, 2, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP8", "HeldStoreINS_10dsv4_store10IndexerFp8ELb1E"): dict(
        launch=Launch(256, 2, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP8", "SplitStoreINS_10dsv4_store10IndexerFp8ELb0E"): dict(
        launch=Launch(256, 1, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP8", "SplitStoreINS_10dsv4_store10IndexerFp8ELb1E"): dict(
        launch=Launch(256, 1, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP8", "StreamedStore"): dict(
        launch=Launch(256, 4, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP4", "HeldStoreINS_10dsv4_store10IndexerFp4ELb0E"): dict(
        launch=Launch(256, 2, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP4", "HeldStoreINS_10dsv4_store10IndexerFp4ELb1E"): dict(
        launch=Launch(256, 2, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP4", "SplitStoreINS_10dsv4_store10IndexerFp4ELb0E"): dict(
        launch=Launch(256, 1, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP4", "SplitStoreINS_10dsv4_store10IndexerFp4ELb1E"): dict(
        launch=Launch(256, 1, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_compress_store:cache_kind=INDEXER_FP4", "StreamedStore"): dict(
        launch=Launch(256, 4, flag_stores=1), slow=True,
        no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("triton", "dsv4_compress_store.prefill[V4,C4,fp32 ring]", ""): dict(
        launch=Launch(128, 4), no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("triton", "dsv4_compress_store.prefill[INDEXER_FP8,C4,fp32 ring]", ""): dict(
        launch=Launch(128, 4), no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("triton", "dsv4_compress_store.prefill[INDEXER_FP4,C4,fp32 ring]", ""): dict(
        launch=Launch(128, 4), no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("triton", "dsv4_compress_store.decode[V4,C4,fp32 ring]", ""): dict(
        launch=Launch(128, 4, flag_stores=1), no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS,
        occupancy=PASS),
    ("triton", "dsv4_compress_store.decode[INDEXER_FP8,C4,fp32 ring]", ""): dict(
        launch=Launch(128, 4, flag_stores=1), no_local=PASS, wide_gather=PASS, wide_store=PASS, fp8_encode=PASS,
        occupancy=PASS),
    ("triton", "dsv4_compress_store.decode[INDEXER_FP4,C4,fp32 ring]", ""): dict(
        launch=Launch(128, 4, flag_stores=1), no_local=PASS, wide_gather=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "dsv4_quant", "QuantizeRowsINS_9kv_layout2V4EtE"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_quant", "QuantizeRowsINS_9kv_layout10IndexerFp8EtE"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_quant", "QuantizeRowsINS_9kv_layout10IndexerFp4EtE"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_store=PASS, occupancy=PASS),
    ("triton", "dsv4_quant.fp8_ds_mla[bf16]", ""): dict(
        launch=Launch(64, 4), no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_store:cache_kind=V4", "NormRopeStore"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_store:cache_kind=INDEXER_FP8", "NormRopeStore"): dict(
        launch=Launch(256, 4), slow=True, no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("cuda", "dsv4_store:cache_kind=INDEXER_FP4", "NormRopeStore"): dict(
        launch=Launch(256, 4), slow=True, no_local=PASS, wide_store=PASS, occupancy=PASS),
    ("triton", "dsv4_store.norm_rope_store[V4]", ""): dict(
        launch=Launch(64, 4), no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("triton", "dsv4_store.norm_rope_store[INDEXER_FP8]", ""): dict(
        launch=Launch(64, 4), no_local=PASS, wide_store=PASS, fp8_encode=PASS, occupancy=PASS),
    ("triton", "dsv4_store.norm_rope_store[INDEXER_FP4]", ""): dict(
        launch=Launch(64, 4), no_local=PASS, wide_store=PASS, occupancy=PASS),
    ("cuda", "gather_rows:index_dtype=int64", "GatherRows"): dict(
        launch=Launch(256, 4), no_local=PASS,
        wide_gather=PASS,
        occupancy=PASS),
    ("cuda", "hisparse:num_top_k=512,hot_buffer_size=1024,layout=dsv4,page_slots=64",
     "swap_in_kernel"): dict(
        launch=Launch(512, 1), no_local=PASS,
        wide_gather=PASS,
        occupancy=PASS),
    ("cuda", "hisparse:num_top_k=512,hot_buffer_size=1024,layout=dsv4,page_slots=64", "MissCopies"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "hisparse_index:num_top_k=512,hot_buffer_size=1024,layout=dsv4,page_slots=64,protect_recent=256,"
             "protect_near=16", "swap_in_kernel"): dict(launch=Launch(512, 1), no_local=PASS, wide_gather=PASS,
                                                        occupancy=PASS),
    ("cuda", "hisparse_planned:layout=dsv4,page_slots=64", "CopyPlanned"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "hisparse_copy:page_slots=64", "TransferTokens"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, occupancy=PASS),
    ("cuda", "hisparse_copy:page_slots=64", "CopyPages"): dict(
        launch=Launch(256, 4), no_local=PASS, wide_gather=PASS, occupancy=PASS),
}


def kernel_label(key: tuple) -> str:
    build, module, kernel = key
    return f"{build} {module}{' ' + kernel if kernel else ''}"


def instance(spec: str) -> tuple[str, dict]:
    """``family:k=v,...`` -> (family, values): dtype names become torch dtypes, digits ints."""
    family, _, pairs = spec.partition(":")
    values = {}
    for pair in filter(None, pairs.split(",")):
        key, value = pair.split("=")
        values[key] = getattr(torch, value) if isinstance(getattr(torch, value, None), torch.dtype) else \
            int(value) if value.isdigit() else value
    return family, values


def expectation(entry: dict, prop: str, arch: str) -> str:
    value = entry[prop]
    return value[arch] if isinstance(value, dict) else value


def _cases():
    for key, entry in SASS_TABLE.items():
        for prop in PROPERTIES:
            if prop not in entry:
                continue
            for arch in ARCHS:
                expected = expectation(entry, prop, arch)
                marks = [] if expected == PASS else [pytest.mark.xfail(strict=True, reason=expected)]
                if entry.get("slow"):
                    marks.append(pytest.mark.slow)
                yield pytest.param(key, prop, arch, marks=marks, id=f"{kernel_label(key)}-{prop}-sm_{arch}")


@cache
def _triton_cubins() -> dict:
    """``{(name, arch): cubin path}`` of the hot Triton kernels, built by the AOT path in a child
    process (CPU sessions interpret Triton, and interpreted kernels do not compile)."""
    names = [module for build, module, _ in SASS_TABLE if build == "triton"]
    script = "\n".join([
        "import json, sys",
        "from sparsekv.jit_kernel.build import cache",
        "from sparsekv.jit_kernel.triton import aot",
        "names, archs = json.loads(sys.argv[1]), json.loads(sys.argv[2])",
        "root = cache.open_roots().write",
        "print(json.dumps([[k.name, a, str(root / '.triton' / aot.build(k, a, root)['key'] / 'kernel.cubin')]",
        "                  for k in aot.aot_kernels() if k.name in names for a in archs]))"])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(names), json.dumps(ARCHS)], capture_output=True,
                          text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(name, arch): Path(path) for name, arch, path in json.loads(done.stdout)}


@cache
def _header_sass(module: str) -> dict:
    """Every kernel of a header instance's library, both archs: one ``cuobjdump`` read (seconds each)
    serves all of its rows."""
    family, values = instance(module)
    return disassemble(cuda_artifact(family, values, ARCHS))


@cache
def _sass(key: tuple, arch: str):
    build, module, kernel = key
    sm = "sm_" + arch.replace(".", "")
    if build == "triton":
        found = list(disassemble(_triton_cubins()[module, arch]).values())
    else:
        found = [k for (a, name), k in _header_sass(module).items() if a == sm and kernel in name]
    assert len(found) == 1, f"{kernel_label(key)} on {sm}: {len(found)} kernels match"
    return found[0]


NO_TOOLS = missing_sass_tools()


@needs("nvcc or cuobjdump", NO_TOOLS)
@pytest.mark.parametrize(("key", "prop", "arch"), list(_cases()))
def test_sass(key, prop, arch):
    holds, detail = PROPERTIES[prop](_sass(key, arch), SASS_TABLE[key]["launch"])
    assert holds, f"{kernel_label(key)} sm_{arch} {prop}: {detail}"


@needs("nvcc or cuobjdump", NO_TOOLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_triton_fp4_scores_multiply_without_flushing_subnormals(arch):
    # The FP4 decode makes the code 0.5 as the float32 subnormal 2^-127 times 2^126 (and a UE8M0 scale
    # byte of 0 is the subnormal 2^-127): exact only if no multiply flushes subnormals to zero (.FTZ).
    sass = _sass(("triton", "dsv4_indexer.scores[fp4,bf16]", ""), arch)
    multiplies = [op for op in sass.opcodes if op.startswith(("FMUL", "FFMA"))]
    assert multiplies and not [op for op in multiplies if ".FTZ" in op], sorted(set(multiplies))


@pytest.mark.slow  # the fp4 scores' instance, as its row of SASS_TABLE
@needs("nvcc or cuobjdump", NO_TOOLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_header_fp4_scores_scale_on_bf16_multiplies_that_keep_subnormals(arch):
    # mma::e2m1x8_to_bf16x2 multiplies each e2m1 pair by its block's scale on bf16x2 (HMUL2.BF16):
    # the scale byte 0 is the bf16 subnormal 2^-127, exact only if the multiply keeps subnormals.
    sass = _sass(("cuda", "dsv4_indexer:layout=fp4,q_dtype=bfloat16", "scores_kernel"), arch)
    multiplies = [op for op in inner_loop(sass) if op.startswith(("HMUL2", "HFMA2"))]
    assert multiplies and all(".BF16" in op and ".FTZ" not in op for op in multiplies), sorted(set(multiplies))


def test_the_inner_loop_is_the_innermost_loop_and_not_a_branch_back_from_out_of_line_code():
    # A loop over 0x100..0x400 holding a loop over 0x200..0x280; a block past the loop (0x500)
    # branching back into its middle (0x300): its span 0x300..0x500 holds the epilogue, no loop.
    addresses = list(range(0x100, 0x520, 0x10))
    kernel = KernelSass("sm_90a", "k", opcodes=[f"OP{a:x}" for a in addresses], addresses=addresses,
                        branches=[(0x280, 0x200), (0x400, 0x100), (0x500, 0x300)])
    assert inner_loop(kernel) == [f"OP{a:x}" for a in range(0x200, 0x290, 0x10)]
    kernel.branches = [(0x400, 0x100), (0x500, 0x300)]  # no nested loop: the outer one
    assert inner_loop(kernel) == [f"OP{a:x}" for a in range(0x100, 0x410, 0x10)]
    kernel.branches = [(0x200, 0x100), (0x500, 0x180)]  # the branch back spans more than the loop
    assert inner_loop(kernel) == [f"OP{a:x}" for a in range(0x100, 0x210, 0x10)]


def render_table() -> str:
    """The markdown table of :data:`SASS_TABLE` that ``docs/sass.md`` shows."""
    props = list(PROPERTIES)
    lines = ["| kernel | threads, CTAs/SM | " + " | ".join(props) + " |", "|---|---|" + "---|" * len(props)]
    for key, entry in SASS_TABLE.items():
        cells = []
        for prop in props:
            if prop not in entry:
                cells.append("-")
                continue
            marks = [expectation(entry, prop, arch) == PASS for arch in ARCHS]
            cells.append("pass" if all(marks) else "FAIL" if not any(marks) else
                         " / ".join(f"sm_{a.replace('.', '')} {'pass' if m else 'FAIL'}" for a, m in zip(ARCHS, marks)))
        launch = entry["launch"]
        label = kernel_label(key) + (" (`--slow`)" if entry.get("slow") else "")
        lines.append(f"| {label} | {launch.threads}, {launch.ctas_per_sm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_docs_show_this_table():
    text = (REPO / "docs" / "sass.md").read_text()
    shown = re.search(r"<!-- sass-table -->\n(.*?)\n<!-- /sass-table -->", text, re.S)
    assert shown and shown.group(1).strip() == render_table(), "regenerate docs/sass.md: " + render_table()

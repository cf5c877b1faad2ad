"""Host cost of every public decode-path call, with the kernel replaced by a no-op (issue 36 item 2).

For each public call a decode step makes, given its ``out=`` buffers, at a decode shape on the cpu
backend (8 rows; attention top-k 512 of 64 heads, with ``impl="header"`` and ``"auto"``, and split in
two with a workspace, the GPU's decode case; indexer 64k
entries, top-k 512, and the two as ``lightning_indexer``; the C4 compressor's decode step, alone and
fused with the store; the store and quantizer 8 entries; a 4096-row gather; the DSV4 swap-in at batch
8 with a 1024-slot hot buffer; a 512-token HiSparse copy over 4 layers), measured in the same run:

* ``host_us``: the public call with every compiled module's export replaced by a no-op (the loader
  behind ``KernelFamily.module`` returns a stub whose exports do nothing; the family's own memo of
  loaded modules runs as in a real call): what the Python wrapper, its checks and the
  ``sparsekv::`` op layer cost on the host. A check-only export (``check_*``: the entry's checks
  without a launch, which ``lightning_indexer`` makes before writing the scores) crosses the FFI to
  tvm-ffi's no-op here: that crossing is the wrapper's cost, not the kernel's;
* ``raw_us`` (the baseline): tvm-ffi's own no-op (``testing.nop``) called with the very arguments
  the wrapper hands the module: one crossing of the FFI with those tensors (one per module call
  that launches; check-only exports are not in it);
* ``host_over_raw``: their ratio; the target is at most 3. Both are the median process time
  (``time.process_time``: what other processes take of a shared core is not counted) of 7 samples
  of at least 50 ms, host and raw sampled in turn so that both see the same load;
* ``bound_us``: the call made by a bound call (:func:`sparsekv.jit_kernel.bound_call.bind`, once, before
  timing), its module calls made to tvm-ffi's no-op itself (the FFI crossing is in it);
  ``bound_over_raw``: its ratio to ``raw_us``; ``bound_planned``: the bound call is its module calls
  alone (not the whole call);
* ``entry_checks_us``: what the stub skips, the compiled entries' own O(1) argument checks (every
  entry checks its arguments at every call, for direct callers): the call's module calls, with no
  rows (batch 0, nothing gathered or copied, the swap-in's one row padding), made to the real cpu
  modules less the same calls made to tvm-ffi's no-op;
* ``torch_ops``: torch operators run per call (``aten::`` and the ``sparsekv::`` op itself, the
  nested ones included: torch's profiler);
  ``allocations``: tensors allocated per call (torch's profiler, ``profile_memory``);
  ``module_calls``: exports of compiled modules called (kernel launches on a GPU, and check-only
  exports);
* ``dispatched_us``: the same call with every ``sparsekv::`` op called through ``torch.library``'s
  dispatcher, as a traced or compiled graph calls it (an eager call runs the op's body directly);
  ``torch_library_us`` = ``dispatched_us - host_us``: what that layer would add.

Also ``lightning_indexer (triton)``: the call with ``impl="triton"`` (the Triton twin's path, under
``TRITON_INTERPRET=1``: on CPU tensors the twin runs only there) with its two Triton launchers
replaced by no-ops (their own argument checks with them), against the header call's raw crossings
(no Triton launch runs on this machine); ``precheck_us``: its top-k pre-check alone, the Python mirror
of the top-k entry's checks behind a metadata memo (a hit).

And ``attention input checks``: the attention's input contract alone (``check_attention_arguments``,
which the Triton twin and FlashMLA run before dispatch; the header's C++ entry makes the same
checks), in its O(1) mode (the Triton launcher's copy of it measured 472 us before its memory-sharing
check became one sweep); and the Triton fused compress
+ store launchers' checks for a 4096-token C4 chunk and a 64-row decode step, whose index checks of
host-readable tables are one numpy pass each (a Python loop per event, write and row before: 4.5-5.7
ms for the 4096-token chunk on the 2-core VM, 0.38-0.42 ms after).

A timed figure, not a test: host times depend on the machine. Prints JSON; ``--plot`` draws host
and raw time per call.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from unittest import mock

import torch
from bench_hisparse import ITEM_BYTES, Case  # the sibling script: benchmarks run as files from their folder

from sparsekv.cli import CliParser
from sparsekv.jit_kernel import torch_op
from sparsekv.jit_kernel.bound_call import bind
from sparsekv.jit_kernel.build import registry
from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention, workspace_floats
from sparsekv.jit_kernel.dsv4_compress_store import compress_decode_step
from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk, lightning_indexer
from sparsekv.jit_kernel.dsv4_quant import quantize_fp8_ds_mla
from sparsekv.jit_kernel.dsv4_store import StoreTarget, norm_rope_store
from sparsekv.jit_kernel.gather_rows import gather_rows
from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_dsv4_mla
from sparsekv.jit_kernel.hisparse_copy import pointer_table, transfer_cache_dsv4_mla
from sparsekv.kv_layout import INDEXER_FP8, V4
from sparsekv.rope import RopeParams
from sparsekv.testing.bench import BenchResult, add_common_args, bar_plot, report, time_call

BATCH, HEADS, PAGE, TOPK, ENTRIES = 8, 64, 64, 512, 1 << 16
TARGET = 3.0


#: Exports that check a call's arguments and launch nothing.
CHECK_ONLY_PREFIX = "check_"


class _Stub:
    """A compiled module whose every export is a no-op that records the arguments of each call (made at
    its first use and kept, as a loaded module's function is); ``args`` of the exports that launch,
    ``checks`` those of the check-only ones."""

    def __init__(self) -> None:
        self.args: list[tuple] = []
        self.checks: list[tuple] = []

    def __getattr__(self, name: str):
        calls = self.checks if name.startswith(CHECK_ONLY_PREFIX) else self.args

        def export(*args):
            calls.append(args)

        setattr(self, name, export)
        return export


def _median_us(fn) -> float:
    return time_call(fn, clock=time.process_time).median_s * 1e6


def _paired_us(*fns, rounds: int = 7) -> tuple[float, ...]:
    """Median process time per call of each of ``fns`` (µs), sampled in turn (one sample of each a round),
    so that all see the same machine load."""
    samples = [[_sample_us(fn) for fn in fns] for _ in range(rounds)]
    return tuple(statistics.median(column) for column in zip(*samples))


def _sample_us(fn) -> float:
    return time_call(fn, repeats=1, clock=time.process_time).median_s * 1e6


def calls(empty: bool = False) -> dict:
    """Public decode-path call name -> a zero-argument call with its out= buffers given; ``empty``: with
    no rows (batch 0, nothing gathered or copied; the swap-in's one row is padding), so that the
    compiled entry runs its argument checks and no kernel work."""
    g = torch.Generator().manual_seed(0)
    batch, gathered, copied = (0, 0, 0) if empty else (BATCH, 4096, 512)
    cache = torch.zeros(BATCH * TOPK // PAGE, V4.page_bytes(PAGE), dtype=torch.uint8)
    q = torch.randn(batch, HEADS, 512, generator=g).to(torch.bfloat16)
    indices = torch.randint(0, BATCH * TOPK, (batch, TOPK), generator=g, dtype=torch.int32)
    sink, out, lse = torch.zeros(HEADS), torch.empty(batch, HEADS, 512), torch.empty(batch, HEADS)
    k_cache = torch.zeros(ENTRIES // PAGE, INDEXER_FP8.page_bytes(PAGE), dtype=torch.uint8)
    iq = torch.randn(batch, HEADS, 128, generator=g).to(torch.bfloat16)
    weights = torch.rand(batch, HEADS, generator=g)
    table = torch.arange(ENTRIES // PAGE, dtype=torch.int32).repeat(batch, 1)
    positions = torch.full((batch,), 4 * ENTRIES - 1)
    scores, tokens = torch.randn(batch, ENTRIES, generator=g), torch.empty(batch, TOPK, dtype=torch.int32)
    x = torch.randn(batch, 512, generator=g)
    slots = torch.arange(batch)
    rope = RopeParams(160000, 16, 65536, 32, 1).table(1 << 16, torch.device("cpu"))
    src, dst = torch.zeros(8192, 584, dtype=torch.uint8), torch.zeros(4096, 584, dtype=torch.uint8)
    src_idx, dst_idx = torch.randperm(8192)[:gathered], torch.randperm(4096)[:gathered]
    swap = Case(TOPK, 2 * TOPK, max(batch, 1), 0.001, True, "cpu")  # the swap-in's tables at top-k 512, batch 8
    padding = {"num_real_reqs": torch.zeros(1, dtype=torch.int32)} if empty else {}
    slots_out, top_scores = torch.empty(batch, TOPK, dtype=torch.int32), torch.empty(batch, ENTRIES)
    kv, score = torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g)
    ape, ring = torch.zeros(4, 1024), torch.zeros(BATCH * 16, 2048)
    raw = torch.arange(batch) * 16 + 3  # every row completes a C4 entry
    state_rows = torch.arange(batch)[:, None] * 16 + (raw[:, None] - 7 + torch.arange(8)) % 16
    entries, emitted = torch.empty(batch, 512), torch.empty(batch, dtype=torch.bool)
    store = StoreTarget(cache, torch.ones(512), 1e-6, PAGE, rope, "V4")
    src_layers = [torch.zeros(64, V4.page_bytes(PAGE), dtype=torch.uint8) for _ in range(4)]
    dst_layers = [torch.zeros(64, V4.page_bytes(PAGE), dtype=torch.uint8) for _ in range(4)]
    copy_src, copy_dst = torch.randperm(64 * PAGE)[:copied], torch.randperm(64 * PAGE)[:copied]
    return {
        "sparse_decode_attention": functools.partial(sparse_decode_attention, q, cache, indices, sink, PAGE, out=out,
                                                     lse=lse, impl="header"),
        "sparse_decode_attention (auto)": functools.partial(sparse_decode_attention, q, cache, indices, sink, PAGE,
                                                            out=out, lse=lse),
        "sparse_decode_attention (2 splits)": functools.partial(
            sparse_decode_attention, q, cache, indices, sink, PAGE, out=out, lse=lse, num_splits=2,
            workspace=torch.zeros(workspace_floats(batch, HEADS, 2)), impl="header"),
        "lightning_indexer": functools.partial(lightning_indexer, iq, weights, k_cache, table, positions, TOPK,
                                               page_slots=PAGE, scores=top_scores, out=tokens, out_slots=slots_out,
                                               impl="header"),
        "compress_decode_step": functools.partial(compress_decode_step, kv, score, ape, 4, ring, state_rows, raw,
                                                  out=entries, emitted=emitted),
        "compress_decode_step (store)": functools.partial(compress_decode_step, kv, score, ape, 4, ring, state_rows,
                                                          raw, store=store, entry_slots=slots, out=entries,
                                                          emitted=emitted, impl="header"),
        "transfer_cache_dsv4_mla": functools.partial(transfer_cache_dsv4_mla, pointer_table(src_layers),
                                                     pointer_table(dst_layers), copy_src, copy_dst, page_slots=PAGE),
        "indexer_scores": functools.partial(indexer_scores, iq, weights, k_cache, table, positions, page_slots=PAGE,
                                            out=scores, impl="header"),
        "indexer_topk": functools.partial(indexer_topk, scores, positions, TOPK, out=tokens, impl="header"),
        "norm_rope_store": functools.partial(norm_rope_store, x, torch.ones(512), 1e-6, positions, cache, slots, PAGE,
                                             rope),
        "quantize_fp8_ds_mla": functools.partial(quantize_fp8_ds_mla, x, cache, slots, PAGE),
        "gather_rows": functools.partial(gather_rows, dst, dst_idx, src, src_idx),
        "load_cache_to_device_buffer_dsv4_mla": functools.partial(
            load_cache_to_device_buffer_dsv4_mla, swap.top_k, swap.tokens, swap.host_cache_locs,
            swap.device_buffer_locs, swap.host_cache, swap.device_buffer, swap.out, swap.req, swap.seq, swap.lru,
            ITEM_BYTES, swap.k, swap.h, **padding),
    }


def attention_checks():
    """The attention's input contract at the attention call's shape, in its O(1) mode: what a Triton or
    FlashMLA call pays on the GPU without ``SPARSEKV_CHECK_INDICES`` (a header call leaves these checks
    to its C++ entry)."""
    from sparsekv.jit_kernel.dsv4_attention import check_attention_arguments

    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, 512, generator=g).to(torch.bfloat16)
    cache = torch.zeros(BATCH * TOPK // PAGE, V4.page_bytes(PAGE), dtype=torch.uint8)
    indices = torch.zeros(BATCH, TOPK, dtype=torch.int32)
    args = (q, cache, indices, torch.zeros(HEADS), PAGE, 512**-0.5, None, None, -1, 1,
            torch.empty(BATCH, HEADS, 512), torch.empty(BATCH, HEADS), None, None)
    return functools.partial(check_attention_arguments, *args, impl="triton", read_values=False)


def triton_lightning_indexer(header_call, nop) -> dict | None:
    """The ``lightning_indexer (triton)`` row: ``header_call`` (:func:`calls`' ``lightning_indexer``) with
    ``impl="triton"``, its Triton launchers no-ops, against the header call's raw crossings; None
    without triton."""
    try:
        from sparsekv.jit_kernel.triton import dsv4_indexer as twin
    except ImportError:
        return None
    from sparsekv.jit_kernel import dsv4_indexer

    stub = _Stub()
    with _modules_replaced_by(stub):
        header_call()
    raw_args = stub.args[:]
    keywords = dict(header_call.keywords, impl="triton")
    call = functools.partial(header_call.func, *header_call.args, **keywords)
    _, _, _, table, positions, num_top_k = header_call.args
    precheck = functools.partial(dsv4_indexer._check_topk_arguments, keywords["scores"], positions, num_top_k, table,
                                 keywords["page_slots"], keywords["out"], keywords["out_slots"], None, "triton")
    launchers = twin.indexer_scores, twin.indexer_topk
    twin.indexer_scores = twin.indexer_topk = _nothing
    try:
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):  # what lets impl="triton" take CPU tensors
            call()
            host_us, raw_us, precheck_us = _paired_us(call, lambda: [nop(*a) for a in raw_args], precheck)
    finally:
        twin.indexer_scores, twin.indexer_topk = launchers
    return {"case": "lightning_indexer (triton)", "host_us": host_us, "raw_us": raw_us,
            "host_over_raw": host_us / raw_us, "within_target": host_us / raw_us <= TARGET, "precheck_us": precheck_us}


def triton_compress_store_checks() -> dict:
    """The Triton fused compress + store launchers' argument checks (host-readable tables are read:
    the index checks the interpreter needs), for a 4096-token C4 prefill chunk and a decode step of
    64 rows; empty without triton."""
    try:
        from sparsekv.jit_kernel.triton.dsv4_compress_store import (
            check_compress_decode_store_arguments,
            check_compress_store_arguments,
        )
    except ImportError:
        return {}
    from sparsekv.srt.mem_cache.compressor_state import CompressorState

    g = torch.Generator().manual_seed(0)
    tokens, ring, rows = 4096, 16, 64
    kv, score = torch.randn(tokens, 1024, generator=g), torch.randn(tokens, 1024, generator=g)
    ape, state = torch.zeros(4, 1024), torch.zeros(rows * ring, 2048)
    plan = CompressorState(state, ape, 4, ring).plan_raw([[0]], [0], [tokens], None, torch.device("cpu"))
    events = plan.sources.shape[0]
    cache = torch.zeros(-(-events // PAGE) + 1, V4.page_bytes(PAGE), dtype=torch.uint8)
    rope = RopeParams(160000, 16, 65536, 32, 1).table(tokens, torch.device("cpu"))
    store = (torch.ones(512), 1e-6)
    prefill = functools.partial(check_compress_store_arguments, kv, score, ape, 4, state, plan.sources, plan.writes,
                                *store, plan.anchors, cache, torch.arange(events), PAGE, rope.cos, rope.sin, "V4")
    positions = torch.arange(rows) * 4 + 3  # every row completes an entry
    state_rows = torch.arange(rows)[:, None] * ring + (positions[:, None] - 7 + torch.arange(8)) % ring
    decode = functools.partial(check_compress_decode_store_arguments, kv[:rows], score[:rows], ape, 4, state,
                               state_rows, positions, torch.empty(rows, 512), torch.empty(rows, dtype=torch.bool),
                               *store, cache, torch.arange(rows), PAGE, rope.cos, rope.sin, "V4")
    return {"triton compress_store checks (4096 tokens)": prefill,
            "triton compress_decode_store checks (64 rows)": decode}


def entry_checks_us(empty_call, nop) -> float:
    """What the compiled entries' own argument checks cost a call (µs), which the no-op stub of ``host_us``
    skips: the module calls of ``empty_call`` (:func:`calls` with no rows, bound) made to the real
    compiled modules of the cpu backend, less the same calls made to tvm-ffi's no-op (the crossing);
    sampled in turn. An upper bound: it includes the kernel's setup for no rows."""
    entry = bind(empty_call.func, *empty_call.args, **empty_call.keywords)
    with _modules_replaced_by(_NopModule(nop)):
        crossing = bind(empty_call.func, *empty_call.args, **empty_call.keywords)
    entry_us, crossing_us = _paired_us(entry, crossing)
    return entry_us - crossing_us


def measure(name: str, call, nop) -> dict:
    stub = _Stub()
    with _modules_replaced_by(stub):
        call()
        raw_args = stub.args[:]  # a call of two ops (lightning_indexer) crosses the FFI twice
        stub.args.clear()
        stub.checks.clear()
        call()
        module_calls = len(stub.args) + len(stub.checks)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
        events = prof.events()
        torch_ops = sum(1 for e in events if "::" in e.name)  # aten:: and sparsekv:: operators
        allocations = sum(1 for e in events if e.name == "[memory]" and e.cpu_memory_usage > 0)
        dispatched_us = _median_us(functools.partial(_through_torch_library, call))
    with _modules_replaced_by(_NopModule(nop)):  # a bound call's module calls cross the FFI, to its no-op
        bound = bind(call.func, *call.args, **call.keywords)
    raw = functools.partial(nop, *raw_args[0]) if len(raw_args) == 1 else lambda: [nop(*a) for a in raw_args]
    # The stub's own recording is no part of the wrapper; a check-only export crosses the FFI.
    with _modules_replaced_by(_NopModule(_nothing, checks=nop)):
        host_us, raw_us, bound_us = _paired_us(call, raw, bound)
    return {"case": name, "host_us": host_us, "raw_us": raw_us, "host_over_raw": host_us / raw_us,
            "within_target": host_us / raw_us <= TARGET, "bound_us": bound_us, "bound_over_raw": bound_us / raw_us,
            "bound_planned": bound.planned, "torch_ops": torch_ops, "allocations": allocations,
            "module_calls": module_calls, "dispatched_us": dispatched_us, "torch_library_us": dispatched_us - host_us}


def _nothing(*args) -> None:
    """A module export that does nothing (a Python function: no FFI crossing)."""


class _NopModule:
    """A compiled module whose every export is ``nop`` (tvm-ffi's no-op, or :func:`_nothing`; ``checks``
    for the check-only exports, default ``nop``), kept at its first use as a loaded module's function is."""

    def __init__(self, nop, checks=None) -> None:
        self.nop, self.checks = nop, nop if checks is None else checks

    def __getattr__(self, name: str):
        export = self.checks if name.startswith(CHECK_ONLY_PREFIX) else self.nop
        setattr(self, name, export)
        return export


@contextlib.contextmanager
def _modules_replaced_by(module):
    """Every family's ``module()`` hands out ``module`` (its memo runs as in a real call; its misses load
    ``module`` instead of the compiled one)."""
    real_load, loaded = registry.load_jit, [(f, dict(f._loaded)) for f in registry.REGISTRY.values()]
    registry.load_jit = lambda *_, **__: module
    for family, _ in loaded:
        family._loaded.clear()
    try:
        yield
    finally:
        registry.load_jit = real_load
        for family, modules in loaded:
            family._loaded.clear()
            family._loaded.update(modules)


def _through_torch_library(call) -> None:
    """``call()`` with every ``sparsekv::`` op called through ``torch.library``'s dispatcher (what a traced
    or compiled graph runs), not the eager path that calls the op's body directly."""
    plain, dispatcher = torch_op._plain_eager, torch_op._through_dispatcher
    torch_op._plain_eager, torch_op._through_dispatcher = (lambda *_: False), (lambda _: True)
    try:
        call()
    finally:
        torch_op._plain_eager, torch_op._through_dispatcher = plain, dispatcher


def main() -> None:
    import tvm_ffi

    parser = CliParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nop = tvm_ffi.get_global_func("testing.nop")
    result = BenchResult(name="host cost per public decode-path call (cpu backend, kernel a no-op)",
                         baseline="tvm-ffi testing.nop with the module call's arguments (same run)",
                         threads={"ours": 1, "baseline": 1},
                         notes={"target": f"host_us <= {TARGET} x raw_us with out= buffers given", "batch": BATCH})
    for (name, call), empty_call in zip(calls().items(), calls(empty=True).values()):
        row = measure(name, call, nop)
        row["entry_checks_us"] = entry_checks_us(empty_call, nop)
        result.rows.append(row)
    twin_row = triton_lightning_indexer(calls()["lightning_indexer"], nop)
    if twin_row is not None:
        result.rows.append(twin_row)
    result.rows.append({"case": "attention input checks", "host_us": _median_us(attention_checks())})
    for name, checks in triton_compress_store_checks().items():
        result.rows.append({"case": name, "host_us": _median_us(checks)})
    report(result, args, lambda r, path: bar_plot(r, path, label_key="case", value_keys=("host_us", "raw_us"),
                                                  ylabel="us per call (log)", log=True))


if __name__ == "__main__":
    main()

"""The kernel entries as ``sparsekv::`` custom ops: each traces under ``torch.compile(fullgraph=True)``
with no graph break and, compiled (``backend="aot_eager"``: the graph is functionalized from the
schemas and traced through the fakes, so an undeclared write is a wrong result), writes the same bytes
as an eager call; ``opcheck`` passes on every op;
meta tensors give output shapes without running a kernel; a compiled call refuses bad input with the
eager call's exception, before anything is written; given its buffers a call allocates nothing."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from sparsekv.jit_kernel.dsv4 import (
    RopeParams,
    RopeTable,
    StoreTarget,
    compress_decode_step,
    compress_pool,
    dequantize_fp8_ds_mla,
    indexer_scores,
    indexer_topk,
    lightning_indexer,
    norm_rope_store,
    quantize_fp8_ds_mla,
    quantize_indexer_keys,
    sparse_decode_attention,
)
from sparsekv.jit_kernel.dsv4_attention import check_attention_arguments, workspace_floats
from sparsekv.jit_kernel.dsv4_indexer import visible_entries
from sparsekv.jit_kernel.gather_rows import gather_rows
from sparsekv.jit_kernel.hisparse import (
    copy_cache_planned_mla,
    load_cache_to_device_buffer_dsv4_mla,
    transfer_cache_dsv4_mla,
    transfer_pages_dsv4_mla,
)
from sparsekv.jit_kernel.hisparse_copy import pointer_table
from sparsekv.jit_kernel.torch_op import CheckMemo, first_true, index_checks_on_device, kernel_op, metadata_key
from sparsekv.kv_layout import INDEXER_HEAD_DIM, INDEXER_LAYOUTS, V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.allocations import allocations
from sparsekv.testing.backends import device_of
from sparsekv.testing.components import skip_for_gpu
from sparsekv.testing.strategies.dsv4_attention import random_rows, v4_cache
from sparsekv.testing.strategies.dsv4_indexer import write_indexer_keys

P = 16  # slots per page of the small caches below


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test compiles its own functions; no recompile limit carried over
    yield
    torch._dynamo.reset()


def compiled(fn: Callable) -> Callable:
    # aot_eager, not eager: AOT autograd functionalizes the graph by each op's declared writes and traces
    # it through the fakes, so a write missing from `mutates_args` (or a wrong fake) changes the result.
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(-1).view(torch.uint8)


def assert_same_bytes(xs, ys) -> None:
    for x, y in zip(xs, ys, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(as_bytes(x), as_bytes(y))


def world(device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Small decode-step tensors on ``device``: a V4 cache, an fp8 indexer cache, a page table, queries."""
    g = torch.Generator().manual_seed(seed)
    pages, batch, heads, index_heads = 4, 2, 3, 2
    index_cache = torch.zeros(pages, INDEXER_LAYOUTS["fp8"].page_bytes(P), dtype=torch.uint8)
    write_indexer_keys(torch.randn(pages * P, INDEXER_HEAD_DIM, generator=g), index_cache, torch.arange(pages * P),
                       P, "fp8")
    tensors = {
        "kv_cache": v4_cache(random_rows(pages * P, g), P),
        "copy_src": v4_cache(random_rows(2 * 32, g), 32),  # copies take C4 pages of 32, 64 or 128 slots
        "index_cache": index_cache,
        "page_table": torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
        "positions": torch.tensor([4 * P + 9, 4 * 2 * P - 1]),
        "q": torch.randn(batch, heads, 512, generator=g),
        "q_index": torch.randn(batch, index_heads, INDEXER_HEAD_DIM, generator=g),
        "weights": torch.rand(batch, index_heads, generator=g),
        "sink": torch.randn(heads, generator=g),
        "rows": random_rows(5, g),
        "indices": torch.tensor([[3, -1, 17, 40, 3], [63, 0, 1, -1, 22]], dtype=torch.int32),
    }
    on = {name: t.to(device) for name, t in tensors.items()}
    on["copy_dst"] = torch.zeros_like(on["copy_src"])
    if device.type != "meta":  # the copies' per-layer address tables (built once, outside a step)
        on["src_ptrs"], on["dst_ptrs"] = pointer_table([on["copy_src"]]), pointer_table([on["copy_dst"]])
    return on


def op_cases(device: torch.device) -> dict[str, Callable[[dict], tuple[torch.Tensor, ...]]]:
    """Per op: a function of a fresh :func:`world` returning every tensor the call returns or writes."""

    def gather(w):
        dst = torch.zeros(6, 24, dtype=torch.uint8, device=device)
        src = w["kv_cache"][:, :24]
        gather_rows(dst, torch.tensor([5, 0, 2], device=device), src, torch.tensor([1, 3, 0], device=device))
        return (dst,)

    def quantize(w):
        slots = torch.tensor([7, 0, 33, 12, 60], device=device)
        quantize_fp8_ds_mla(w["rows"], w["kv_cache"], slots, P)
        return (w["kv_cache"], dequantize_fp8_ds_mla(w["kv_cache"], slots, P))

    def attention(w):
        return sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P)

    def attention_bf16_split(w):
        batch, heads = w["q"].shape[:2]
        out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device=device)
        lse = torch.empty(batch, heads, device=device)
        workspace = torch.zeros(workspace_floats(batch, heads, 2, torch.bfloat16), device=device)
        sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, num_splits=2, out=out, lse=lse,
                                out_dtype=torch.bfloat16, workspace=workspace, extra_kv_cache=w["kv_cache"],
                                extra_indices=w["indices"].flip(1).contiguous(), extra_page_slots=P)
        return out, lse

    def indexer(w):
        scores = indexer_scores(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"],
                                page_slots=P)
        tokens, slots = indexer_topk(scores, w["positions"], 6, page_table=w["page_table"], page_slots=P)
        return scores, tokens, slots

    def lightning(w):
        return lightning_indexer(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"], 4,
                                 page_slots=P)

    def store(w):
        norm_rope_store(w["rows"], torch.linspace(0.5, 2, 512, device=device), 1e-6, torch.tensor([0, 9, 4, 300, 7],
                        device=device), w["kv_cache"], torch.tensor([1, 2, 40, 3, 63], device=device), P,
                        RopeParams(10000).table(301, device))
        return (w["kv_cache"],)

    def compress(w):
        kv, score = w["rows"][:, :64].contiguous(), w["rows"][:, 64:128].contiguous()
        ape = w["rows"][:4, 128:192].contiguous()
        state = torch.zeros(2 * 8, 128, device=device)
        positions = torch.tensor([3, 7], device=device)
        state_rows = torch.stack([torch.arange(8), 8 + torch.arange(8)]).to(device)
        entries, emitted = compress_decode_step(kv[:2], score[:2], ape, 4, state, state_rows, positions)
        return compress_pool(kv[:4].repeat(2, 1), score[:4].repeat(2, 1), ape, 4), entries, emitted, state

    def copies(w):
        src_ptrs, dst_ptrs = w["src_ptrs"], w["dst_ptrs"]
        transfer_cache_dsv4_mla(src_ptrs, dst_ptrs, torch.tensor([5, 0, 63], device=device),
                                torch.tensor([1, 2, 3], device=device), src_num_slots=64, dst_num_slots=64,
                                page_slots=32)
        transfer_pages_dsv4_mla(src_ptrs, dst_ptrs, torch.tensor([0], device=device), torch.tensor([1], device=device),
                                src_num_pages=2, dst_num_pages=2, page_slots=32)
        planned = torch.zeros_like(w["kv_cache"])
        copy_cache_planned_mla(miss_src=torch.tensor([[4, 9, -1], [60, 1, 2]], device=device),
                               miss_dst=torch.tensor([[0, 17, -1], [33, 5, 6]], device=device),
                               miss_count=torch.tensor([2, 1], dtype=torch.int32, device=device),
                               num_real_reqs=torch.tensor([2], dtype=torch.int32, device=device),
                               host_cache=w["kv_cache"].view(-1)[: 64 * 584].view(64, 584),
                               device_buffer=planned.view(-1)[: 64 * 584].view(64, 584), item_size_bytes=584)
        return w["copy_dst"], planned

    return {"gather_rows": gather, "quantize_dequantize": quantize, "attention": attention,
            "attention_bf16_split": attention_bf16_split, "indexer": indexer, "lightning_indexer": lightning,
            "norm_rope_store": store, "compress": compress, "copies": copies}


@pytest.mark.parametrize("case", sorted(op_cases(torch.device("cpu"))))
def test_compiled_op_writes_the_same_bytes_as_eager(backend, case):
    device = device_of(backend)
    fn = op_cases(device)[case]
    assert_same_bytes(compiled(fn)(world(device)), fn(world(device)))


WRITES = {
    "gather_rows": ["dst"], "transfer_cache_dsv4_mla": ["dst_ptrs"], "transfer_pages_dsv4_mla": ["dst_ptrs"],
    "load_cache_to_device_buffer": ["counters", "device_buffer", "device_buffer_tokens", "index_queue",
                                    "index_queue_pos", "index_slot_of", "lru_slots", "miss_count", "miss_dst",
                                    "miss_src", "top_k_device_locs"],
    "copy_cache_planned_mla": ["device_buffer"], "quantize_fp8_ds_mla": ["cache"],
    "dequantize_fp8_ds_mla": ["out"], "quantize_indexer_keys": ["cache"], "norm_rope_store": ["cache"],
    "compress_pool": ["out"],
    "compress_extend": ["out", "state"], "compress_online_c128": ["out", "state"],
    "compress_store": ["cache", "state"], "compress_decode": ["emitted", "out", "state"],
    "compress_decode_store": ["cache", "emitted", "out", "state"], "indexer_scores": ["out"],
    "indexer_topk": ["out", "out_slots", "workspace"], "sparse_decode_attention": ["lse", "out", "workspace"],
    "plan_raw_step": ["plan"],
}


@pytest.mark.no_backend("reads the registered schemas; nothing runs")
def test_every_entry_is_a_sparsekv_op_with_its_writes_declared():
    expected = WRITES
    writes = {}
    for name in expected:
        schema = getattr(torch.ops.sparsekv, name).default._schema
        writes[name] = sorted(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        assert not schema.returns, name  # out-variants: outputs are arguments
    assert writes == expected


@pytest.mark.no_backend("meta tensors: shapes only, no kernel runs")
def test_meta_tensors_give_output_shapes_without_running_a_kernel():
    w = world(torch.device("meta"))
    out, lse = sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out_dtype=torch.bfloat16)
    assert (out.shape, out.dtype, lse.shape) == ((2, 3, 512), torch.bfloat16, (2, 3))
    tokens, slots = lightning_indexer(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"], 7,
                                      page_slots=P)
    assert tokens.shape == slots.shape == (2, 7) and tokens.device.type == "meta"
    assert dequantize_fp8_ds_mla(w["kv_cache"], torch.zeros(9, dtype=torch.int64, device="meta"), P).shape == (9, 512)
    t = step_tensors(torch.device("meta"))
    entries, emitted = compress_decode_step(t["main_kv"], t["main_score"], t["main_ape"], 4, t["main_state"],
                                            t["state_rows"], t["positions"])
    assert (entries.shape, entries.dtype, emitted.shape, emitted.dtype) == ((2, 512), torch.float32, (2,), torch.bool)


# ---- one whole decode step: compressor step -> store -> indexer -> top-k -> swap-in -> attention ----

TOP_K, HOT, C4P = 5, 7, 64  # a swap-in instance of the table; C4 page slots of 256-token pages
STEP_BATCH, STEP_HEADS, STEP_INDEX_HEADS, STEP_PAGES = 2, 4, 3, 2


def step_tensors(device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """The state of one C4 layer of a two-request batch: compressor rings (main 512 wide, indexer 128 wide),
    the V4 and indexer caches, HiSparse tables and the step's inputs. Row 0 is longer than the hot
    buffer (misses), row 1 fits it; both tokens complete an entry this step."""
    g = torch.Generator().manual_seed(seed)
    host_pages = STEP_BATCH * STEP_PAGES
    index_cache = torch.zeros(host_pages, INDEXER_LAYOUTS["fp8"].page_bytes(C4P), dtype=torch.uint8)
    write_indexer_keys(torch.randn(host_pages * C4P, INDEXER_HEAD_DIM, generator=g), index_cache,
                       torch.arange(host_pages * C4P), C4P, "fp8")
    page_table = torch.randperm(host_pages, generator=g).reshape(STEP_BATCH, STEP_PAGES).int()
    entry = torch.arange(STEP_PAGES * C4P)
    columns = HOT + C4P
    device_pages = -(-STEP_BATCH * columns // C4P) + 1
    positions = torch.tensor([4 * 90 - 1, 4 * 5 - 1])  # both complete an entry: 90 and 5 visible after it
    ring = 16
    t = {
        "main_state": torch.randn(STEP_BATCH * ring, 4 * 512, generator=g),
        "index_state": torch.randn(STEP_BATCH * ring, 4 * 128, generator=g),
        "state_rows": torch.stack([b * ring + (positions[b] - 7 + torch.arange(8)) % ring for b in range(STEP_BATCH)]),
        "positions": positions,
        "entry_slots": torch.stack([page_table[b, e // C4P].long() * C4P + e % C4P
                                    for b, e in enumerate((positions + 1) // 4 - 1)]),
        "main_kv": torch.randn(STEP_BATCH, 1024, generator=g), "main_score": torch.randn(STEP_BATCH, 1024, generator=g),
        "main_ape": torch.randn(4, 1024, generator=g), "main_weight": torch.rand(512, generator=g) + 0.5,
        "index_kv": torch.randn(STEP_BATCH, 256, generator=g), "index_score": torch.randn(STEP_BATCH, 256, generator=g),
        "index_ape": torch.randn(4, 256, generator=g), "index_weight": torch.rand(128, generator=g) + 0.5,
        "kv_cache": v4_cache(random_rows(host_pages * C4P, g), C4P),
        "index_cache": index_cache,
        "page_table": page_table,
        "host_cache_locs": (page_table.long()[:, entry // C4P] * C4P + entry % C4P).contiguous(),
        "device_buffer": v4_cache(random_rows(device_pages * C4P, g), C4P),
        "device_buffer_locs": torch.randperm(device_pages * C4P, generator=g)[: STEP_BATCH * columns]
        .reshape(STEP_BATCH, columns).int(),
        "device_buffer_tokens": torch.cat([torch.full((1, columns), -1, dtype=torch.int32),
                                           torch.cat([torch.arange(HOT, dtype=torch.int32),
                                                      torch.full((C4P,), -1, dtype=torch.int32)])[None]]),
        "lru_slots": torch.arange(HOT, dtype=torch.int16).repeat(STEP_BATCH, 1),
        "req_pool_indices": torch.arange(STEP_BATCH),
        "seq_lens": visible_entries(positions),
        "q": torch.randn(STEP_BATCH, STEP_HEADS, 512, generator=g),
        "q_index": torch.randn(STEP_BATCH, STEP_INDEX_HEADS, INDEXER_HEAD_DIM, generator=g),
        "weights": torch.rand(STEP_BATCH, STEP_INDEX_HEADS, generator=g),
        "sink": torch.randn(STEP_HEADS, generator=g),
        # Caller-owned outputs of every op: with them the step allocates nothing.
        "main_entries": torch.empty(STEP_BATCH, 512), "index_entries": torch.empty(STEP_BATCH, 128),
        "main_emitted": torch.empty(STEP_BATCH, dtype=torch.bool),
        "index_emitted": torch.empty(STEP_BATCH, dtype=torch.bool),
        "scores": torch.empty(STEP_BATCH, STEP_PAGES * C4P),
        "tokens": torch.empty(STEP_BATCH, TOP_K, dtype=torch.int32),
        "slots": torch.empty(STEP_BATCH, TOP_K, dtype=torch.int32),
        "top_k_device_locs": torch.empty(STEP_BATCH, TOP_K, dtype=torch.int32),
        "out": torch.empty(STEP_BATCH, STEP_HEADS, 512, dtype=torch.bfloat16),
        "lse": torch.empty(STEP_BATCH, STEP_HEADS),
        "workspace": torch.zeros(workspace_floats(STEP_BATCH, STEP_HEADS, 1, torch.bfloat16)),  # zeroed once
    }
    rope = RopeParams(160000, 16, 65536, 32, 1).table(int(positions.max()) + 1)
    t["rope_cos"], t["rope_sin"] = rope.cos, rope.sin  # the model's table, built once like its weights
    return {name: value.to(device) for name, value in t.items()}


def decode_step(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One C4 layer's decode step, every op writing into the caller's buffers (what an engine captures)."""
    rope = RopeTable(t["rope_cos"], t["rope_sin"])
    compress_decode_step(t["main_kv"], t["main_score"], t["main_ape"], 4, t["main_state"], t["state_rows"],
                         t["positions"], store=StoreTarget(t["kv_cache"], t["main_weight"], 1e-6, C4P, rope),
                         entry_slots=t["entry_slots"], out=t["main_entries"], emitted=t["main_emitted"])
    compress_decode_step(t["index_kv"], t["index_score"], t["index_ape"], 4, t["index_state"], t["state_rows"],
                         t["positions"], store=StoreTarget(t["index_cache"], t["index_weight"], 1e-6, C4P, rope,
                                                           "INDEXER_FP8"),
                         entry_slots=t["entry_slots"], out=t["index_entries"], emitted=t["index_emitted"])
    lightning_indexer(t["q_index"], t["weights"], t["index_cache"], t["page_table"], t["positions"], TOP_K,
                      page_slots=C4P, scores=t["scores"], out=t["tokens"], out_slots=t["slots"])
    load_cache_to_device_buffer_dsv4_mla(
        t["tokens"], t["device_buffer_tokens"], t["host_cache_locs"], t["device_buffer_locs"], t["kv_cache"],
        t["device_buffer"], t["top_k_device_locs"], t["req_pool_indices"], t["seq_lens"], t["lru_slots"],
        V4.bytes_per_token, TOP_K, HOT)
    return sparse_decode_attention(t["q"], t["device_buffer"], t["top_k_device_locs"], t["sink"], C4P, out=t["out"],
                                   lse=t["lse"], out_dtype=torch.bfloat16, workspace=t["workspace"])


def test_a_compiled_decode_step_writes_the_same_bytes_as_eager(backend):
    device = device_of(backend)
    eager, traced = step_tensors(device), step_tensors(device)
    decode_step(eager)
    compiled(decode_step)(traced)
    for name in eager:
        assert torch.equal(as_bytes(eager[name]), as_bytes(traced[name])), name
    # The step did real work: both tokens completed an entry, the top-k is full, misses were loaded.
    assert bool(eager["main_emitted"].all()) and bool((eager["tokens"] >= 0).all())
    assert not torch.equal(as_bytes(eager["device_buffer"]), as_bytes(step_tensors(device)["device_buffer"]))


class RecordOps(TorchDispatchMode):
    """Records every ``sparsekv::`` op call (a dispatch mode also routes eager calls through the ops)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sparsekv":  # the arguments as the op found them (opcheck reruns it on them)
            self.calls.append((func, pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs or {}))))
        return func(*args, **(kwargs or {}))


def test_each_op_of_a_decode_step_writes_only_what_it_declares(backend):
    """torch.library.opcheck on every op call of the step: the schema's declared writes are exactly the
    arguments the kernel changes, and the fake implementation agrees with the real one."""
    with RecordOps() as recorder:
        decode_step(step_tensors(device_of(backend)))
    names = [func.__name__ for func, _ in recorder.calls]
    assert names == ["compress_decode_store.default"] * 2 + ["indexer_scores.default", "indexer_topk.default",
                                                            "load_cache_to_device_buffer.default",
                                                            "sparse_decode_attention.default"]
    for func, (args, kwargs) in recorder.calls:
        torch.library.opcheck(func, args, kwargs, test_utils=("test_schema", "test_faketensor"))


def streaming_steps(device: torch.device) -> None:
    """The ops only prefill reaches, through their public entries: the raw ring's streaming step (C4),
    the fused one that stores entries, the online C128 fold, and the plain indexer-key store."""
    t, g = step_tensors(device), torch.Generator().manual_seed(1)
    kv, score = (torch.randn(9, 1024, generator=g).to(device) for _ in range(2))
    CompressorState(torch.zeros(2 * 16, 2048, device=device), t["main_ape"], 4, ring_size=16).extend(
        [0], [[1]], [0], kv, score)
    rope = RopeTable(t["rope_cos"], t["rope_sin"])
    CompressorState(t["main_state"], t["main_ape"], 4, ring_size=16).extend(
        [0], [[0]], [0], kv, score, store=StoreTarget(t["kv_cache"], t["main_weight"], 1e-6, C4P, rope),
        entry_slots=lambda b, anchor: 3 + anchor // 4)
    kv, score = (torch.randn(130, 64, generator=g).to(device) for _ in range(2))
    CompressorState(torch.zeros(4, 128, device=device), torch.randn(128, 64, generator=g).to(device), 128,
                    ring_size=4, online=True).extend([0], [[0]], [0], kv, score)
    w = world(device)
    quantize_indexer_keys(torch.randn(3, INDEXER_HEAD_DIM, generator=g).to(device), w["index_cache"],
                          torch.tensor([5, 0, 40], device=device), page_slots=P)


def every_op_call(device: torch.device, worlds: list) -> list:
    """Every ``sparsekv::`` op call of the op cases, the decode step and the streaming steps, as recorded.

    The copies' pointer tables hold addresses of their world's buffers: ``worlds`` keeps those alive
    for as long as the calls may be replayed."""
    with RecordOps() as recorder:
        for case in op_cases(device).values():
            worlds.append(world(device))
            case(worlds[-1])
        decode_step(step_tensors(device))
        streaming_steps(device)
    return recorder.calls


def test_opcheck_passes_on_a_call_of_every_op(backend):
    """Not only the decode step's six: a call of each of the 19 ops, each checked by opcheck (declared
    writes are exactly what the kernel changes, the fake agrees with the real op)."""
    calls = every_op_call(device_of(backend), worlds := [])
    assert {func._schema.name.removeprefix("sparsekv::") for func, _ in calls} == set(WRITES)
    for func, (args, kwargs) in calls:
        torch.library.opcheck(func, args, kwargs, test_utils=("test_schema", "test_faketensor"))
    del worlds


def _call(func, args, kwargs):
    func(*args, **kwargs)


def test_every_op_compiled_alone_writes_the_same_bytes_as_eager(backend):
    """Each recorded call replayed eagerly and compiled (aot_eager) on copies of its arguments: every tensor
    argument ends the same, byte for byte. An op whose schema declares none of its writes is traced as
    pure and dropped (seen: gather_rows with mutates_args=()); one write left out beside a declared one
    (compress_store without `state`) leaves the op in the graph, and is opcheck's to catch (above)."""
    for func, (args, kwargs) in every_op_call(device_of(backend), worlds := []):
        (eager_args, eager_kwargs), (traced_args, traced_kwargs) = (
            pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs)) for _ in range(2))
        func(*eager_args, **eager_kwargs)
        torch._dynamo.reset()
        compiled(functools.partial(_call, func))(traced_args, traced_kwargs)
        eager = pytree.tree_leaves((eager_args, eager_kwargs))
        traced = pytree.tree_leaves((traced_args, traced_kwargs))
        for i, (x, y) in enumerate(zip(eager, traced, strict=True)):
            if isinstance(x, torch.Tensor):
                assert torch.equal(as_bytes(x), as_bytes(y)), (func, i)
    del worlds


@pytest.mark.gpu
def test_a_captured_decode_step_replays_without_a_host_sync(backend):
    if backend != "cuda":
        skip_for_gpu("CUDA-graph capture needs the cuda backend")
    device = device_of(backend)
    expected, static = step_tensors(device), step_tensors(device)
    decode_step(step_tensors(device))  # loads every module before the sync check and the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync of the eager step raises
    try:
        decode_step(expected)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            decode_step(static)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Capture ran nothing; start from the step's inputs again and replay.
    for name, value in step_tensors(device).items():
        static[name].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    for name in expected:
        # The workspace is scratch whose bytes depend on the implementation (the Triton twin writes the
        # bf16 output directly and leaves the header's float32 staging untouched, seen on an H200).
        if name != "workspace":
            assert torch.equal(as_bytes(expected[name]), as_bytes(static[name])), name


BAD = {
    "wrong dtype": (lambda w: w.update(q=w["q"].double()), TypeError, "`q`"),
    "wrong shape": (lambda w: w.update(q=w["q"][:, :, :256]), ValueError, "`q`"),
    "bf16 sink": (lambda w: w.update(sink=w["sink"].bfloat16()), TypeError, "`sink`"),
    "short out": (lambda w: w.update(out=torch.empty(2, 3, 100, device=w["q"].device)), ValueError, "`out`"),
}


STEP_BAD = {
    "wrong dtype": (lambda t: t.update(state_rows=t["state_rows"].float()), TypeError, "`state_rows`"),
    "wrong shape": (lambda t: t.update(state_rows=t["state_rows"][:, :4].contiguous()), ValueError, "`state_rows`"),
    "short emitted": (lambda t: t.update(index_emitted=t["index_emitted"][:1]), ValueError, "`emitted`"),
    "ring row outside state": (lambda t: t["state_rows"].__setitem__((1, 7), 10**6), IndexError, "`state_rows`"),
}


@pytest.mark.parametrize("bad", sorted(STEP_BAD))
def test_a_compiled_decode_step_refuses_bad_input_like_an_eager_one_and_writes_nothing(backend, bad):
    if bad == "ring row outside state" and backend == "cuda":
        skip_for_gpu("device-resident rows are not read by the host: the kernel skips them")
    device = device_of(backend)
    change, error, name = STEP_BAD[bad]
    messages = []
    for fn in (decode_step, compiled(decode_step)):
        t = step_tensors(device)
        change(t)
        before = {k: v.clone() for k, v in t.items()}
        with pytest.raises(error, match=name) as info:
            fn(t)
        messages.append(str(info.value))
        # The first op refused it (the main compressor step) or a later one did (the indexer's step), but no
        # op wrote anything once an argument of its own was bad: here the index ring and cache stay as they were.
        for k in ("index_state", "index_cache", "index_entries", "scores", "tokens", "out", "lse"):
            assert torch.equal(as_bytes(t[k]), as_bytes(before[k])), k
    assert messages[0] == messages[1]


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_compiled_call_refuses_bad_input_like_an_eager_one(backend, bad):
    device = device_of(backend)

    def call(w):
        out = w.get("out")
        lse = torch.full((2, 3), 7.0, device=device)
        sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out=out, lse=lse)
        return lse

    change, error, name = BAD[bad]
    messages = []
    for fn in (call, compiled(call)):
        w = world(device)
        change(w)
        lse = torch.full((2, 3), 7.0, device=device)
        w["lse"] = lse
        with pytest.raises(error, match=name) as info:
            fn(w)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_given_its_buffers_a_decode_step_allocates_nothing(backend):
    device = device_of(backend)
    t = step_tensors(device)
    decode_step(t)  # loads every module
    w = world(device)
    assert allocations(lambda: sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P)), \
        "the probe sees the allocations of a call without buffers"
    got = []
    assert allocations(lambda: got.extend(decode_step(t))) == []
    assert got[0] is t["out"] and got[1] is t["lse"]


@pytest.mark.no_backend("the index-check switch and finder in Python; no kernel runs")
def test_device_index_checks_switch_on_for_cuda_tensors_only_and_name_the_first_bad_entry(monkeypatch):
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    assert not index_checks_on_device(torch.zeros(2))  # host tables: the C++ entries check them
    assert index_checks_on_device(torch.zeros(2, device="meta").new_empty(0)) is False
    mask = torch.tensor([[False, False, False], [False, True, True]])
    assert first_true(mask) == (1, 1) and first_true(mask[0]) is None and first_true(mask[1]) == (1,)


@pytest.mark.no_backend("the index finder in Python; no kernel runs")
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), seed=st.integers(0, 2**16),
       density=st.sampled_from([0.0, 0.05, 0.5, 1.0]))
def test_first_true_is_the_first_set_entry_in_row_major_order(shape, seed, density):
    # One host read, found or not: the entry nonzero() lists first.
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density
    listed = mask.nonzero()
    assert first_true(mask) == (tuple(int(i) for i in listed[0]) if len(listed) else None)



# ---- what every op refuses before its body or its fake runs --------------------------------------

def _tensor_arguments(func, args, kwargs) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of each tensor argument of a recorded call, by the op's schema."""
    bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    return [(name, value) for name, value in bound.items() if isinstance(value, torch.Tensor)]


def _with(func, args, kwargs, name, value):
    """The call's arguments with ``name`` replaced by ``value``."""
    names = [a.name for a in func._schema.arguments]
    if name in kwargs:
        return args, kwargs | {name: value}
    args = list(args)
    args[names.index(name)] = value
    return tuple(args), kwargs


def test_a_meta_tensor_among_real_ones_is_refused_by_every_op_naming_it(backend):
    # The sweep: with a meta tensor first, 13 calls took the fake and returned having written nothing
    # (quantize_fp8_ds_mla(meta_x, cache, slots, 4)); with one later, 48 failed in the entry with
    # "Cannot pack tensors on meta", naming no argument.
    calls = every_op_call(device_of(backend), worlds := [])
    assert len({func for func, _ in calls}) >= len(WRITES)
    for func, (args, kwargs) in calls:
        written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        for name, tensor in _tensor_arguments(func, args, kwargs):
            meta_args, meta_kwargs = _with(func, args, kwargs, name, torch.empty_like(tensor, device="meta"))
            before = [t.clone() for _, t in _tensor_arguments(func, args, kwargs)]
            if written - {name}:  # a real tensor the call writes: refused, naming the meta one
                with pytest.raises(ValueError, match=f"argument `{name}` is a meta tensor but `.*`, which the call "
                                                     "writes, is not"):
                    func(*meta_args, **meta_kwargs)
            else:  # it wrote only what is now on meta: a shape call, through the fake
                func(*meta_args, **meta_kwargs)
            after = [t for _, t in _tensor_arguments(func, args, kwargs)]
            assert all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(before, after)), (func, name)
    del worlds


@pytest.mark.no_backend("meta tensors only: the fakes run, no kernel")
def test_a_public_call_with_a_meta_tensor_among_real_ones_names_it():
    w, meta = world(torch.device("cpu")), world(torch.device("meta"))
    slots = torch.tensor([7, 0, 33], dtype=torch.int64)
    before = w["kv_cache"].clone()
    with pytest.raises(ValueError, match="argument `x` is a meta tensor but `cache`, which the call writes, is not"):
        quantize_fp8_ds_mla(meta["rows"][:3], w["kv_cache"], slots, P)
    with pytest.raises(ValueError, match="argument `kv_cache` is a meta tensor but `out`, which the call writes"):
        sparse_decode_attention(w["q"], meta["kv_cache"], w["indices"], w["sink"], P)
    assert torch.equal(w["kv_cache"], before)
    # Writing only meta tensors is a shape call, whatever else is real: the fake, never the entry.
    quantize_fp8_ds_mla(w["rows"][:3], meta["kv_cache"], slots, P)


def test_every_op_with_an_impl_refuses_a_bogus_one(backend):
    # Direct ops (torch.ops.sparsekv.*) took impl='bogus' and ran the header.
    calls = every_op_call(device_of(backend), worlds := [])
    with_impl = [(func, a) for func, a in calls if "impl" in [x.name for x in func._schema.arguments]]
    assert len({func for func, _ in with_impl}) >= 8
    for func, (args, kwargs) in with_impl:
        bad_args, bad_kwargs = _with(func, args, kwargs, "impl", "bogus")
        before = [t.clone() for _, t in _tensor_arguments(func, args, kwargs)]
        with pytest.raises(ValueError, match="argument `impl` must be one of"):
            func(*bad_args, **bad_kwargs)
        after = [t for _, t in _tensor_arguments(func, args, kwargs)]
        assert all(torch.equal(as_bytes(x), as_bytes(y)) for x, y in zip(before, after)), func
    del worlds


def test_compress_decode_step_refuses_a_bogus_impl_without_a_store_too(backend):
    t = step_tensors(device_of(backend))
    state = t["main_state"].clone()
    with pytest.raises(ValueError, match="argument `impl` must be one of"):
        compress_decode_step(t["main_kv"], t["main_score"], t["main_ape"], 4, t["main_state"], t["state_rows"],
                             t["positions"], impl="bogus")
    assert torch.equal(t["main_state"], state)


def test_out_must_have_the_dtype_out_dtype_names(backend):
    # out_dtype=bf16 with a float32 out wrote float32.
    device = device_of(backend)
    w = world(device)
    out = torch.full((2, 3, 512), 7.0, device=device)
    with pytest.raises(TypeError, match="argument `out` has dtype torch.float32, but `out_dtype` is torch.bfloat16"):
        sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out=out, out_dtype=torch.bfloat16)
    assert bool((out == 7.0).all())
    expected = sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out_dtype=torch.bfloat16)[0]
    out = torch.empty(2, 3, 512, dtype=torch.bfloat16, device=device)
    assert torch.equal(sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out=out,
                                               out_dtype=torch.bfloat16)[0], expected)


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), 0.0, -1e-6])
def test_eps_must_be_finite_and_above_zero(backend, eps):
    # eps=inf was stored (every output 0).
    device = device_of(backend)
    w = world(device)
    before = w["kv_cache"].clone()
    rope = RopeParams(10000).table(301, device)
    with pytest.raises(ValueError, match="argument `eps` must be a finite number"):
        norm_rope_store(w["rows"], torch.ones(512, device=device), eps, torch.tensor([0, 9, 4, 300, 7], device=device),
                        w["kv_cache"], torch.tensor([1, 2, 40, 3, 63], device=device), P, rope)
    with pytest.raises(ValueError, match="argument `store.eps` must be a finite number"):
        StoreTarget(w["kv_cache"], torch.ones(512, device=device), eps, P, rope)
    assert torch.equal(w["kv_cache"], before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_slots_must_be_integers(backend, dtype):
    # Slots are never rounded: 2.5 once became slot 2.
    device = device_of(backend)
    w = world(device)
    before = w["kv_cache"].clone()
    slots = torch.tensor([7.0, 2.5, 33.0], dtype=dtype, device=device)
    with pytest.raises(TypeError, match="`slots`"):
        quantize_fp8_ds_mla(w["rows"][:3], w["kv_cache"], slots, P)
    with pytest.raises(TypeError, match="`slots`"):
        norm_rope_store(w["rows"][:3], torch.ones(512, device=device), 1e-6, torch.tensor([0, 9, 4], device=device),
                        w["kv_cache"], slots, P, RopeParams(10000).table(301, device))
    assert torch.equal(w["kv_cache"], before)


@kernel_op("test_scalar_kinds", mutates_args=("out",))
def _scalar_kinds(out: torch.Tensor, count: int, scale: float, flag: bool, limit: int | None) -> None:
    out.fill_(count)


@pytest.mark.no_backend("the op layer's scalar checks, on a test op that only fills its output")
@pytest.mark.parametrize("arg, value", [("count", 2.5), ("count", True), ("scale", True), ("scale", "0.5"),
                                        ("flag", 1), ("limit", 3.0)])
def test_an_op_refuses_a_scalar_of_the_wrong_kind_naming_it(arg, value):
    # A float where the entry takes an int reached tvm-ffi: "Mismatched type on argument #N".
    out = torch.zeros(3)
    args = {"out": out, "count": 4, "scale": 0.5, "flag": False, "limit": None}
    with pytest.raises(TypeError, match=f"argument `{arg}` must be"):
        _scalar_kinds(*dict(args, **{arg: value}).values())
    with pytest.raises(TypeError, match=f"argument `{arg}` must be"):
        _scalar_kinds(*dict(args, out=torch.zeros(3, device="meta"), **{arg: value}).values())
    assert bool((out == 0).all())
    _scalar_kinds(*dict(args, limit=7, scale=1).values())  # an int is a float; None or an int for int | None
    assert bool((out == 4).all())


@pytest.mark.no_backend("the checks' memo key in Python; no kernel runs")
def test_metadata_key_differs_in_everything_the_checks_read():
    t = torch.zeros(4, 6)
    key = metadata_key(t, 64, 0.5, "header", None)
    assert key == metadata_key(torch.zeros(4, 6).set_(t), 64, 0.5, "header", None)  # another view of the same
    others = [
        metadata_key(t[1:], 64, 0.5, "header", None),  # address and shape
        metadata_key(t.t(), 64, 0.5, "header", None),  # shape and strides
        metadata_key(t.view(6, 4), 64, 0.5, "header", None),  # shape
        metadata_key(t.view(torch.int32), 64, 0.5, "header", None),  # dtype
        metadata_key(torch.zeros(4, 6, device="meta"), 64, 0.5, "header", None),  # device
        metadata_key(t, 64.0, 0.5, "header", None),  # an int's type: 64 == 64.0
        metadata_key(t, True, 0.5, "header", None),  # True == 1: the type tells them apart
        metadata_key(t, 64, 0.5, "triton", None),
        metadata_key(t, 64, 0.5, "header", t),
    ]
    assert all(other != key for other in others)
    assert len(set(others)) == len(others)
    assert metadata_key(torch.nn.Parameter(t), 64) is None  # a subclass may mean anything: checked in full
    assert metadata_key(t, [64]) is None
    memo = CheckMemo(capacity=2)
    memo.put(None, "never stored")
    assert memo.get(None) is None
    for i in range(3):
        memo.put(metadata_key(t, i), i)
    assert memo.get(metadata_key(t, 2)) == 2 and memo.get(metadata_key(t, 0)) is None  # starts over when full


def _attention_case() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    cache = v4_cache(random_rows(16, g), 4)
    q = torch.randn(2, 8, 512, generator=g)
    indices = torch.randint(-1, 16, (2, 6), generator=g, dtype=torch.int32)
    return (q, cache, indices, torch.zeros(8), 4), {"out": torch.empty(2, 8, 512), "lse": torch.empty(2, 8)}


def test_a_call_whose_metadata_passed_before_is_still_refused_after_a_buffer_is_resized_in_place(backend):
    args, buffers = _attention_case()
    args = tuple(a.to(device_of(backend)) if isinstance(a, torch.Tensor) else a for a in args)
    out, lse = (b.to(device_of(backend)) for b in buffers.values())
    expected = sparse_decode_attention(*args, out=out, lse=lse, impl="header")[0].clone()
    sparse_decode_attention(*args, out=out, lse=lse, impl="header")  # the memo holds this metadata now
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    lse.resize_(2, 4)  # the same tensor object, a shape the contract refuses
    out.fill_(7)
    with pytest.raises(ValueError, match="argument `lse` must have size 8 in dim 1"):
        sparse_decode_attention(*args, out=out, lse=lse, impl="header")
    assert bool((out == 7).all())
    lse.resize_(2, 8)
    sparse_decode_attention(*args, out=out, lse=lse, impl="header")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.no_backend("the attention contract's value checks in Python; no kernel runs")
@pytest.mark.parametrize("table, bad, error", [
    ("indices", 16, "argument `indices`[1, 3] = 16 is neither -1 nor a slot of its cache [0, 16)"),
    ("topk_length", 7, "argument `topk_length` must be in [0, K=6]"),
], ids=["indices", "topk_length"])
def test_a_memoized_contract_still_reads_the_index_values_every_call(table, bad, error):
    (q, cache, indices, sink, page), buffers = _attention_case()
    tables = {"indices": indices, "topk_length": torch.tensor([6, 6], dtype=torch.int32)}

    def contract():
        return check_attention_arguments(q, cache, tables["indices"], sink, page, 512**-0.5, None, None, -1, 1,
                                         buffers["out"], buffers["lse"], None, tables["topk_length"],
                                         impl="triton", read_values=True)

    first = contract()
    assert contract()[1:] == first[1:] and contract()[0][1:4] == first[0][1:4]  # from the memo: same sizes
    if table == "indices":
        tables[table][1, 3] = bad
    else:
        tables[table][1] = bad
    with pytest.raises((IndexError, ValueError), match=re.escape(error)):
        contract()

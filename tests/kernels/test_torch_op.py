"""The kernel entries as ``sparsekv::`` custom ops: each traces under ``torch.compile(fullgraph=True)``
with no graph break and, compiled (``backend="eager"``), writes the same bytes as an eager call;
meta tensors give output shapes without running a kernel; a compiled call refuses bad input with the
eager call's exception, before anything is written; given its buffers a call allocates nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from sparsekv.jit_kernel.dsv4 import (
    dequantize_fp8_ds_mla,
    indexer_scores,
    indexer_topk,
    lightning_indexer,
    quantize_fp8_ds_mla,
    sparse_decode_attention,
)
from sparsekv.jit_kernel.dsv4_attention import workspace_floats
from sparsekv.jit_kernel.dsv4_indexer import INDEXER_HEAD_DIM, INDEXER_LAYOUTS
from sparsekv.jit_kernel.gather_rows import gather_rows
from sparsekv.testing.backends import device_of
from sparsekv.testing.strategies.dsv4_attention import random_rows, v4_cache
from sparsekv.testing.strategies.dsv4_indexer import write_indexer_keys

P = 16  # slots per page of the small caches below


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test compiles its own functions; no recompile limit carried over
    yield
    torch._dynamo.reset()


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, fullgraph=True, backend="eager")


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
    return {name: t.to(device) for name, t in tensors.items()}


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
        workspace = torch.empty(workspace_floats(batch, heads, 2, torch.bfloat16), device=device)
        sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, num_splits=2, out=out, lse=lse,
                                out_dtype=torch.bfloat16, workspace=workspace, extra_kv_cache=w["kv_cache"],
                                extra_indices=w["indices"].flip(1).contiguous(), extra_page_size=P)
        return out, lse

    def indexer(w):
        scores = indexer_scores(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"],
                                page_size=P)
        tokens, slots = indexer_topk(scores, w["positions"], 6, page_table=w["page_table"], page_size=P)
        return scores, tokens, slots

    def lightning(w):
        return lightning_indexer(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"], 4,
                                 page_size=P)

    return {"gather_rows": gather, "quantize_dequantize": quantize, "attention": attention,
            "attention_bf16_split": attention_bf16_split, "indexer": indexer, "lightning_indexer": lightning}


@pytest.mark.parametrize("case", sorted(op_cases(torch.device("cpu"))))
def test_compiled_op_writes_the_same_bytes_as_eager(backend, case):
    device = device_of(backend)
    fn = op_cases(device)[case]
    assert_same_bytes(compiled(fn)(world(device)), fn(world(device)))


@pytest.mark.no_backend("reads the registered schemas; nothing runs")
def test_every_entry_is_a_sparsekv_op_with_its_writes_declared():
    writes = {}
    for name in ("gather_rows", "quantize_fp8_ds_mla", "dequantize_fp8_ds_mla", "sparse_decode_attention",
                 "indexer_scores", "indexer_topk"):
        schema = getattr(torch.ops.sparsekv, name).default._schema
        writes[name] = sorted(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        assert not schema.returns, name  # out-variants: outputs are arguments
    assert writes == {"gather_rows": ["dst"], "quantize_fp8_ds_mla": ["cache"], "dequantize_fp8_ds_mla": ["out"],
                      "sparse_decode_attention": ["lse", "out", "workspace"], "indexer_scores": ["out"],
                      "indexer_topk": ["out", "out_slots"]}


@pytest.mark.no_backend("meta tensors: shapes only, no kernel runs")
def test_meta_tensors_give_output_shapes_without_running_a_kernel():
    w = world(torch.device("meta"))
    out, lse = sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out_dtype=torch.bfloat16)
    assert (out.shape, out.dtype, lse.shape) == ((2, 3, 512), torch.bfloat16, (2, 3))
    tokens, slots = lightning_indexer(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"], 7,
                                      page_size=P)
    assert tokens.shape == slots.shape == (2, 7) and tokens.device.type == "meta"
    assert dequantize_fp8_ds_mla(w["kv_cache"], torch.zeros(9, dtype=torch.int64, device="meta"), P).shape == (9, 512)


BAD = {
    "wrong dtype": (lambda w: w.update(q=w["q"].double()), TypeError, "`q`"),
    "wrong shape": (lambda w: w.update(q=w["q"][:, :, :256]), ValueError, "`q`"),
    "bf16 sink": (lambda w: w.update(sink=w["sink"].bfloat16()), TypeError, "`sink`"),
    "short out": (lambda w: w.update(out=torch.empty(2, 3, 100, device=w["q"].device)), ValueError, "`out`"),
}


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


def test_given_its_buffers_attention_allocates_nothing(backend):
    device = device_of(backend)
    w = world(device)
    batch, heads = w["q"].shape[:2]
    out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch, heads, device=device)
    workspace = torch.empty(workspace_floats(batch, heads, 3, torch.bfloat16), device=device)
    sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P, out=out, lse=lse, num_splits=3,
                            out_dtype=torch.bfloat16, workspace=workspace)  # warm: loads the module
    assert allocations(lambda: sparse_decode_attention(w["q"], w["kv_cache"], w["indices"], w["sink"], P,
                                                       num_splits=3, out_dtype=torch.bfloat16)), "the probe sees none"
    got = []
    assert allocations(lambda: got.extend(sparse_decode_attention(
        w["q"], w["kv_cache"], w["indices"], w["sink"], P, out=out, lse=lse, num_splits=3, out_dtype=torch.bfloat16,
        workspace=workspace))) == []
    assert got[0] is out and got[1] is lse


def allocations(call: Callable[[], object]) -> list[str]:
    """The ops that allocated memory (host or device) while ``call`` ran."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        call()
    return [e.name for e in prof.events() if e.cpu_memory_usage > 0 or e.device_memory_usage > 0]

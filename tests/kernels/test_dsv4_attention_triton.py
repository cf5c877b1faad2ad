"""The Triton twin of DSV4 sparse decode attention (``impl="triton"``) against the fp64 reference and
against the header implementation on identical inputs; on CPU tensors it runs under the Triton
interpreter (``tests/conftest.py`` turns it on for sessions without the cuda backend). The refusals
of bad input are compared in ``test_dsv4_attention.py`` (parametrized by ``impl``)."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention, workspace_floats
from sparsekv.jit_kernel.triton import dsv4_attention as triton_attention
from sparsekv.testing.backends import device_of, triton_examples
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.strategies.dsv4_attention import AttentionCase, attention_case, random_rows, v4_cache

# Documented tolerance (jit_kernel/triton/dsv4_attention.py): q enters the tensor cores in bf16 (a float32
# q is rounded to bf16 once) and the weights p are rounded to bf16 once, so against the fp64 reference
# of the bf16-rounded q: |out - ref| <= 1e-2 max(1, max|ref|), lse within 1e-2 relative.
BF16_REL = 1e-2

pytestmark = pytest.mark.usefixtures("triton_runs_here")

# The GPU sizes launch_shape() plans for: 132 SMs (the default) make the tests' small calls 16-head
# programs of 16-row tiles on 4 warps, as batch 1 runs on an H200; 1 SM makes every call programs of up
# to 64 heads and 32-row tiles on 8 warps, as batch 64 runs.
SHAPES = {"16-head programs": 132, "64-head programs": 1}


def planned_for(shape: str):
    """A context in which the twin plans its programs as for ``shape`` (a key of :data:`SHAPES`)."""
    return mock.patch.object(triton_attention, "_GPU_SMS", SHAPES[shape])


def run(case: AttentionCase, backend: str, impl: str, **kwargs):
    c = case.to(device_of(backend))
    out, lse = sparse_decode_attention(c.q, c.kv_cache, c.indices, c.sink, c.page_slots, **c.kwargs(), impl=impl,
                                       **kwargs)
    return out.cpu().double(), lse.cpu().double()


def as_the_twin_reads_it(case: AttentionCase) -> AttentionCase:
    """``case`` with ``q`` rounded to bf16, as the twin's tensor cores take it (float32 q stays float32)."""
    return dataclasses.replace(case, q=case.q.bfloat16().to(case.q.dtype))


def assert_within_tolerance(case: AttentionCase, got, expected, rounding: float = 0.0) -> None:
    """``got`` within the documented tolerance of ``expected``, plus ``rounding`` (relative) for bf16 outputs."""
    (out, lse), (ref_out, ref_lse) = got, expected
    ref_out, ref_lse = ref_out.double(), ref_lse.double()
    scale = max(1.0, float(ref_out.abs().max()))
    torch.testing.assert_close(out, ref_out, rtol=rounding, atol=BF16_REL * scale)
    torch.testing.assert_close(lse, ref_lse, rtol=BF16_REL, atol=BF16_REL)


@settings(max_examples=triton_examples())
@given(case=attention_case(max_heads=20), data=st.data())
def test_triton_matches_the_fp64_reference_and_the_header(backend, case, data):
    total = case.indices.shape[1] + (0 if case.extra_indices is None else case.extra_indices.shape[1])
    splits = data.draw(st.integers(1, min(4, max(1, total))), label="num_splits")
    out_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="out_dtype")
    shape = data.draw(st.sampled_from(sorted(SHAPES)), label="shape")
    with planned_for(shape):
        got = run(case, backend, "triton", num_splits=splits, out_dtype=out_dtype)
        case = as_the_twin_reads_it(case)
        assert torch.equal(run(case, backend, "triton", num_splits=splits, out_dtype=out_dtype)[0], got[0])
    expected = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_slots,
                                                 **case.kwargs())
    # A bf16 output is the float32 result rounded to nearest: half a bf16 step (2^-8 relative) from the
    # exact value, one step (2^-7) from the header's bf16 output, which may round the other way.
    bf16 = out_dtype == torch.bfloat16
    assert_within_tolerance(case, got, expected, 2.0**-8 if bf16 else 0.0)
    assert_within_tolerance(case, got, run(case, backend, "header", num_splits=splits, out_dtype=out_dtype),
                            2.0**-7 if bf16 else 0.0)


# 128 heads are 8 programs of 16 heads or 2 of 64 per split, and reach every path 64 heads (4 programs or
# one) do: 64 runs under --slow. Batch 1 with 2 splits of 12 entries, one tile each: under the interpreter
# a 64-head program costs about 1 s.
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("heads", [pytest.param(64, marks=pytest.mark.slow), 128])
def test_dsv4_head_counts_in_programs_of_16_and_64_heads(backend, heads, shape):
    # bf16 q as the model runs it; the sink, and -1 padding among the entries.
    g = torch.Generator().manual_seed(heads)
    cache = v4_cache(random_rows(40, g), 64)
    indices = torch.randint(-1, 40, (1, 24), generator=g, dtype=torch.int32)
    case = AttentionCase((torch.randn(1, heads, 512, generator=g) * 2).bfloat16(), cache, indices,
                         torch.randn(heads, generator=g), 64)
    expected = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_slots)
    with planned_for(shape):
        assert triton_attention.launch_shape(1, heads, 2)[0] == int(shape.split("-")[0])
        assert_within_tolerance(case, run(case, backend, "triton", num_splits=2), expected)


@pytest.mark.no_backend("plans a CUDA launch on the host: no kernel runs")
def test_the_gpu_plan_fills_132_sms_at_batch_1_and_keeps_batch_64_in_64_head_programs():
    # No kernel runs: default_splits and launch_shape for a CUDA device, at the benchmark's shapes
    # (64 heads, top-k 512 + a 128-entry window, and without it), then invariants over many calls.
    gpu = torch.device("cuda")

    def plan(batch, heads, entries):
        splits = triton_attention.default_splits(gpu, batch, heads, entries)
        block_h, block_n, warps = triton_attention.launch_shape(batch, heads, splits)
        return splits, block_h, block_n, warps, batch * splits * -(-heads // block_h)

    assert plan(1, 64, 640) == (40, 16, 16, 4, 160)  # was 20 programs of 64 heads
    assert plan(1, 64, 512) == (32, 16, 16, 4, 128)  # as the header's CTAs
    assert plan(1, 128, 640) == (20, 16, 16, 4, 160)
    assert plan(64, 64, 640) == (2, 64, 32, 8, 128)  # the 2x design case, as before
    assert plan(64, 64, 512) == (2, 64, 32, 8, 128)
    assert plan(1, 64, 2048 + 128) == (68, 64, 32, 8, 68)  # one 32-row tile each already
    assert triton_attention.default_splits(torch.device("cpu"), 1, 64, 640) == 1
    for batch in (1, 2, 3, 4, 5, 8, 16, 33, 64, 65, 66, 128):
        for heads in (1, 16, 20, 64, 128):
            for entries in (1, 15, 16, 17, 100, 512, 640, 2176):
                splits, block_h, block_n, warps, programs = plan(batch, heads, entries)
                split_len = -(-entries // splits)
                assert 1 <= splits <= entries and (splits - 1) * split_len < entries  # no split is empty
                if block_n == 16:  # 16-head programs: all in one wave, no more tiles than an even spread
                    assert (block_h, warps) == (16, 4) and programs <= 2 * 132, (batch, heads, entries)
                    tiles = math.ceil(entries / 16)
                    assert math.ceil(split_len / 16) <= math.ceil(tiles / splits), (batch, heads, entries)
                else:
                    assert (block_n, warps) == (32, 8) and block_h == min(64, max(16, 1 << (heads - 1).bit_length()))
                    assert 2 * batch * -(-heads // 64) * splits >= 132 or programs > 2 * 132


def test_a_bf16_output_over_splits_combines_bf16_partials(backend):
    # With a bf16 out the splits' normalized outputs go through the workspace as bf16 (``_partials``), each
    # rounded once: the lse (float32 partials either way) is bit-identical to a float32 out's, the output
    # within the documented tolerance of the reference and within two bf16 steps of the float32 out.
    g = torch.Generator().manual_seed(6)
    cache = v4_cache(random_rows(24, g), 8)
    indices = torch.randint(-1, 24, (2, 20), generator=g, dtype=torch.int32)
    case = AttentionCase((torch.randn(2, 3, 512, generator=g) * 2).bfloat16(), cache, indices,
                         torch.randn(3, generator=g), 8)
    expected = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_slots)
    bf16 = run(case, backend, "triton", num_splits=2, out_dtype=torch.bfloat16)
    fp32 = run(case, backend, "triton", num_splits=2, out_dtype=torch.float32)
    assert torch.equal(bf16[1], fp32[1])
    assert_within_tolerance(case, bf16, expected, 2.0**-8)
    torch.testing.assert_close(bf16[0], fp32[0], rtol=2.0**-8, atol=2.0**-7 * float(fp32[0].abs().max()))


def test_split_calls_combine_in_their_last_program_and_leave_the_arrival_counters_zero(backend):
    # Split, the last program of a (row, head group) to arrive combines the splits and zeroes its counter
    # in the workspace's prefix: calls of both program shapes and of different batch and heads share one
    # zeroed workspace, each within tolerance of the reference; a nonzero counter is refused, nothing written.
    g = torch.Generator().manual_seed(12)
    cache = v4_cache(random_rows(40, g), 8)
    big, small = (AttentionCase(torch.randn(batch, heads, 512, generator=g), cache,
                                torch.randint(-1, 40, (batch, k), generator=g, dtype=torch.int32),
                                torch.randn(heads, generator=g), 8) for batch, heads, k in ((2, 20, 30), (1, 3, 12)))
    workspace = torch.zeros(workspace_floats(2, 20, 3, torch.bfloat16), device=device_of(backend))
    counters = workspace[:2 * 2 * 2].view(torch.int32)  # the big case's [B, ceil(H / 16), 2]
    for case, splits, out_dtype, shape in ((big, 3, torch.float32, "16-head programs"),
                                           (small, 2, torch.bfloat16, "64-head programs")):
        with planned_for(shape):
            got = run(case, backend, "triton", num_splits=splits, out_dtype=out_dtype, workspace=workspace)
        twin = as_the_twin_reads_it(case)
        expected = sparse_decode_attention_reference(twin.q, twin.kv_cache, twin.indices, twin.sink, twin.page_slots)
        assert_within_tolerance(twin, got, expected, 2.0**-8 if out_dtype == torch.bfloat16 else 0.0)
        assert not bool(counters.any())
    counters[6] = 1  # b = 1, heads 16-19: the ticket
    out = torch.full((2, 20, 512), 7.0, device=device_of(backend))
    with pytest.raises(ValueError, match="argument `part_arrivals` must be all zero"):
        sparse_decode_attention(*(t.to(device_of(backend)) for t in (big.q, big.kv_cache, big.indices, big.sink)), 8,
                                num_splits=2, workspace=workspace, out=out, impl="triton")
    assert bool((out == 7.0).all())


def test_a_row_without_valid_entries_gives_zero_and_plus_inf(backend):
    g = torch.Generator().manual_seed(0)
    cache = v4_cache(random_rows(8, g), 4)
    case = AttentionCase(torch.randn(2, 3, 512, generator=g), cache,
                         torch.tensor([[-1, -1, -1], [2, -1, 5]], dtype=torch.int32), torch.zeros(3), 4)
    for splits in (1, 3):
        out, lse = run(case, backend, "triton", num_splits=splits)
        assert torch.equal(out[0], torch.zeros(3, 512, dtype=torch.float64))
        assert torch.equal(lse[0], torch.full((3,), float("inf"), dtype=torch.float64))
        assert bool(torch.isfinite(lse[1]).all()) and bool((out[1] != 0).any())


# The interpreter computes tl.max with numpy, which warns on the all-NaN row this test makes on purpose.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_a_nan_in_q_makes_that_head_nan_and_leaves_the_others(backend):
    # As the header: a NaN logit is carried to out and lse (the GPU's max.f32 would drop it, and a
    # head with a NaN query read as attending to nothing).
    g = torch.Generator().manual_seed(1)
    cache = v4_cache(random_rows(8, g), 4)
    q = torch.randn(2, 3, 512, generator=g)
    q[1, 0, 7] = float("nan")
    case = AttentionCase(q, cache, torch.tensor([[0, 7, -1], [3, 5, 1]], dtype=torch.int32), torch.zeros(3), 4)
    clean = AttentionCase(torch.nan_to_num(q), cache, case.indices, case.sink, 4)
    for splits in (1, 2):
        (out, lse), (clean_out, clean_lse) = run(case, backend, "triton", num_splits=splits), run(
            clean, backend, "triton", num_splits=splits)
        assert bool(out[1, 0].isnan().all()) and bool(lse[1, 0].isnan())
        keep = torch.ones(2, 3, dtype=torch.bool)
        keep[1, 0] = False
        assert torch.equal(out[keep], clean_out[keep]) and torch.equal(lse[keep], clean_lse[keep])


# The interpreter computes tl.max with numpy, which warns on the all-NaN rows this test makes on purpose.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_a_nan_in_a_cache_row_makes_every_head_of_a_query_row_selecting_it_nan(backend):
    # As the header: a NaN in a row's e4m3 part (it quantizes to an e4m3 NaN) or in its bf16 rope part
    # reaches every head of the query rows that select it, through the main or the extra cache, and
    # nothing else.
    g = torch.Generator().manual_seed(7)
    rows = random_rows(12, g)
    rows[7, 3] = float("nan")  # slot 7: a NaN in the e4m3 part
    rows[9, 460] = float("nan")  # slot 9: a NaN in the rope part
    cache = v4_cache(rows, 4)
    indices = torch.tensor([[1, 2, 3, -1], [7, 2, 3, 4], [5, 6, -1, 8], [0, 9, 1, 2]], dtype=torch.int32)
    extra = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 10]], dtype=torch.int32)
    extra[2, 1] = 7  # row 2 reaches slot 7 through the extra cache
    case = AttentionCase(torch.randn(4, 3, 512, generator=g), cache, indices, torch.randn(3, generator=g), 4,
                         cache, extra, 4)
    nan = torch.tensor([False, True, True, True])[:, None].expand(4, 3)
    for splits in (1, 2):
        out, lse = run(case, backend, "triton", num_splits=splits)
        assert torch.equal(lse.isnan(), nan) and torch.equal(out.isnan().all(dim=2), nan)
        assert not bool(out[~nan].isnan().any())


def test_a_decode_step_with_triton_attention_traces_under_torch_compile(backend):
    # Indexer (scores, top-k through the page table) then attention with impl="triton": one graph with
    # no break, and the compiled step writes the same bytes as the eager one.
    from sparsekv.jit_kernel.dsv4 import lightning_indexer
    from sparsekv.testing.strategies.dsv4_indexer import write_indexer_keys

    device = device_of(backend)
    g = torch.Generator().manual_seed(3)
    pages, page = 4, 16
    index_cache = torch.zeros(pages, 132 * page, dtype=torch.uint8)
    write_indexer_keys(torch.randn(pages * page, 128, generator=g), index_cache, torch.arange(pages * page), page,
                       "fp8")
    world = {"index_cache": index_cache, "kv_cache": v4_cache(random_rows(pages * page, g), page),
             "page_table": torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), "positions": torch.tensor([73, 127]),
             "q_index": torch.randn(2, 4, 128, generator=g), "weights": torch.rand(2, 4, generator=g),
             "q": torch.randn(2, 16, 512, generator=g).bfloat16(), "sink": torch.randn(16, generator=g)}
    world = {k: v.to(device) for k, v in world.items()}

    def step(w):
        _, slots = lightning_indexer(w["q_index"], w["weights"], w["index_cache"], w["page_table"], w["positions"],
                                     12, page_slots=page)
        return sparse_decode_attention(w["q"], w["kv_cache"], slots, w["sink"], page, num_splits=2,
                                       out_dtype=torch.bfloat16, impl="triton")

    torch._dynamo.reset()
    try:
        compiled = torch.compile(step, fullgraph=True, backend="eager")(world)
    finally:
        torch._dynamo.reset()
    eager = step(world)
    for a, b in zip(compiled, eager):
        assert a.dtype == b.dtype and torch.equal(a.cpu().float(), b.cpu().float())
    assert bool(torch.isfinite(eager[1]).all())


def test_topk_length_equals_padding_the_rest_with_minus_one(backend):
    # The twin bounds each row by topk_length in the kernel: bit-identical to -1 past the length.
    g = torch.Generator().manual_seed(4)
    cache = v4_cache(random_rows(30, g), 4)
    indices = torch.randint(0, 30, (3, 20), generator=g, dtype=torch.int32)
    lengths = torch.tensor([0, 7, 20], dtype=torch.int32)
    padded = indices.masked_fill(torch.arange(20)[None, :] >= lengths[:, None], -1)
    case = AttentionCase(torch.randn(3, 4, 512, generator=g), cache, indices, torch.randn(4, generator=g), 4,
                         cache, indices.flip(1).contiguous(), 4)
    got = run(case, backend, "triton", num_splits=3, topk_length=lengths.to(device_of(backend)))
    case.indices = padded
    expected = run(case, backend, "triton", num_splits=3)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _aliased_attention_calls(device):
    g = torch.Generator().manual_seed(5)
    cache = v4_cache(random_rows(8, g), 4).to(device)
    q = torch.randn(2, 3, 512, generator=g).to(device)
    base = dict(q=q, kv_cache=cache, indices=torch.tensor([[0, 7, -1], [3, 3, 1]], dtype=torch.int32, device=device),
                sink=torch.zeros(3, device=device), page_slots=4)
    return [dict(base, out=q),  # out over q
            dict(base, lse=q[:, :, 0]),  # lse inside q
            dict(base, out=torch.zeros(1, 1, 512, device=device).expand(2, 3, 512))]  # out over itself


def test_memory_sharing_is_refused_with_the_headers_message_and_nothing_written(backend):
    for impl_args in _aliased_attention_calls(device_of(backend)):
        messages = []
        for impl in ("header", "triton"):
            before = {k: v.clone() for k, v in impl_args.items() if isinstance(v, torch.Tensor)}
            with pytest.raises(ValueError, match="share memory|overlap each other") as error:
                sparse_decode_attention(**impl_args, impl=impl)
            messages.append(str(error.value))
            assert all(torch.equal(impl_args[k], v) for k, v in before.items())
        assert messages[0] == messages[1]

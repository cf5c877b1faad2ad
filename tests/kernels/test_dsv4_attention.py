"""DSV4 sparse decode attention: the kernel (every test backend) against the fp64 reference, its
properties (permutations, -1 entries, the sink, split-KV, empty rows, the extra cache), and the
bad-input contract."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4_attention import (
    ATTENTION,
    attention_template_args,
    check_attention_arguments,
    reads_values,
    sparse_decode_attention,
    workspace_floats,
)
from sparsekv.testing.backends import core_backends, device_of, kernel_backends, skip_unless_triton_runs, to_backend
from sparsekv.testing.components import skip_for_gpu
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.reference.dsv4_quant import dequantize_fp8_ds_mla
from sparsekv.testing.strategies.dsv4_attention import AttentionCase, attention_case, random_rows, v4_cache

BACKENDS = kernel_backends()
# Documented tolerance (jit_kernel/dsv4_attention.py): float32 kernel vs fp64 reference on the same values.
TOL = {"rtol": 2e-4, "atol": 2e-4}
# Two runs of the kernel that differ only in summation order.
ORDER_TOL = {"rtol": 1e-5, "atol": 1e-5}


def run(case: AttentionCase, backend: str, **kwargs):
    c = case.to(device_of(backend))
    out, lse = sparse_decode_attention(c.q, c.kv_cache, c.indices, c.sink, c.page_slots, **c.kwargs(), **kwargs)
    return out.cpu(), lse.cpu()


def assert_same(a, b, tol):
    (out_a, lse_a), (out_b, lse_b) = a, b
    torch.testing.assert_close(out_a.to(torch.float64), out_b.to(torch.float64), **tol)
    torch.testing.assert_close(lse_a.to(torch.float64), lse_b.to(torch.float64), **tol)


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@given(case=attention_case())
def test_matches_the_fp64_reference(backend, case):
    expected = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_slots,
                                                 **case.kwargs())
    assert_same(run(case, backend), expected, TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_case(), seed=st.integers(0, 2**16))
def test_permuting_indices_within_a_row_changes_nothing(backend, case, seed):
    g = torch.Generator().manual_seed(seed)
    before = run(case, backend)
    for name in ("indices", "extra_indices"):
        table = getattr(case, name)
        if table is not None:
            setattr(case, name, torch.stack([row[torch.randperm(row.numel(), generator=g)] for row in table]))
    assert_same(run(case, backend), before, ORDER_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_case(extra=False), holes=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_minus_one_entries_are_ignored(backend, case, holes, seed):
    before = run(case, backend)
    g = torch.Generator().manual_seed(seed)
    wider = torch.cat([case.indices, torch.full((case.indices.shape[0], holes), -1, dtype=torch.int32)], dim=1)
    case.indices = torch.stack([row[torch.randperm(row.numel(), generator=g)] for row in wider])
    assert_same(run(case, backend), before, ORDER_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_case(), data=st.data())
def test_topk_length_equals_padding_the_rest_with_minus_one(backend, case, data):
    batch, k = case.indices.shape
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch)), dtype=torch.int32)
    got = run(case, backend, topk_length=lengths.to(device_of(backend)))
    padded = case.indices.masked_fill(torch.arange(k)[None, :] >= lengths[:, None].long(), -1)
    expected = run(dataclasses.replace(case, indices=padded), backend)
    # The same valid entries in the same order: the same float32 operations, bit for bit.
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    reference = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_slots,
                                                  **case.kwargs(), topk_length=lengths)
    assert_same(got, reference, TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_case())
def test_sink_minus_inf_is_plain_softmax_and_a_sink_scales_by_sigmoid(backend, case):
    with_sink = run(case, backend)
    original_sink = case.sink
    case.sink = torch.full_like(case.sink, float("-inf"))
    out, lse = run(case, backend)
    for b in range(case.q.shape[0]):
        kv = dequantize_fp8_ds_mla(case.kv_cache, case.indices[b][case.indices[b] >= 0].long(), case.page_slots)
        if case.extra_kv_cache is not None:
            extra = case.extra_indices[b][case.extra_indices[b] >= 0].long()
            kv = torch.cat([kv, dequantize_fp8_ds_mla(case.extra_kv_cache, extra, case.extra_page_slots)])
        if kv.shape[0] == 0:
            continue
        logits = 512**-0.5 * case.q[b].to(torch.float64) @ kv.T
        torch.testing.assert_close(out[b].double(), torch.softmax(logits, dim=1) @ kv, **TOL)
    # With a sink the output is the sink-free one times sigmoid(lse - sink); lse ignores the sink.
    scaled = out.double() * torch.sigmoid(lse.double() - original_sink.double())[..., None]
    nonempty = torch.isfinite(lse)
    torch.testing.assert_close(with_sink[0].double()[nonempty], scaled[nonempty], **TOL)
    assert torch.equal(with_sink[1], lse)


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_case(), data=st.data())
def test_split_kv_combine_equals_the_single_pass(backend, case, data):
    total = case.indices.shape[1] + (0 if case.extra_indices is None else case.extra_indices.shape[1])
    splits = data.draw(st.integers(1, max(1, total)))
    assert_same(run(case, backend, num_splits=splits), run(case, backend, num_splits=1), ORDER_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, num_splits", [(64, 1), (128, 2), (80, 3), (64, 20), (80, 20), (64, 70), (128, 40)])
def test_serving_head_counts_match_the_fp64_reference(backend, heads, num_splits):
    # The GPU kernel takes 64 heads per CTA, or 32 or 16 while its CTAs (2 rows x splits x head
    # groups) still fit in 132: groups of 16 for the first three cases, of 32 for 20 splits (80
    # heads: a last group of one m-tile), of 64 for 70 splits and for 128 heads over 40 (two groups).
    # 70 + 9 entries are three 32-row tiles (-1 holes, repeats, topk_length, an extra cache), bf16 q.
    g = torch.Generator().manual_seed(heads)
    cache = v4_cache(random_rows(96, g), 64)
    indices = torch.randint(0, 96, (2, 70), generator=g, dtype=torch.int32)
    indices[torch.rand(2, 70, generator=g) < 0.2] = -1
    extra_cache = v4_cache(random_rows(9, g), 4)
    case = AttentionCase((torch.randn(2, heads, 512, generator=g) * 4).bfloat16(), cache, indices,
                         torch.randn(heads, generator=g) * 4, 64, extra_cache,
                         torch.randint(-1, 9, (2, 9), generator=g, dtype=torch.int32), 4)
    lengths = torch.tensor([70, 41], dtype=torch.int32)
    got = run(case, backend, num_splits=num_splits, topk_length=lengths.to(device_of(backend)))
    expected = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_slots,
                                                 **case.kwargs(), topk_length=lengths)
    assert_same(got, expected, TOL)


def off_boundary(cache: torch.Tensor, offset: int) -> torch.Tensor:
    """``cache``'s bytes in a view that starts ``offset`` bytes past a 16-byte boundary."""
    buffer = torch.zeros(cache.numel() + 16, dtype=torch.uint8)
    shifted = buffer[offset:offset + cache.numel()].view(cache.shape)
    shifted.copy_(cache)
    return shifted


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset, extra_offset", [(8, 0), (0, 4), (1, 1)])
def test_a_cache_off_a_16_byte_boundary_gives_the_same_bits(backend, offset, extra_offset):
    # The GPU kernel gathers with 16-byte loads only when every record of both caches is 16-byte
    # aligned (partial_kernel); otherwise partial_unaligned_kernel reads 8-byte words. Same bytes,
    # same arithmetic: the same bits, and the fp64 reference's values.
    g = torch.Generator().manual_seed(offset + 2 * extra_offset)
    cache, extra_cache = v4_cache(random_rows(80, g), 64), v4_cache(random_rows(9, g), 4)
    indices = torch.randint(-1, 80, (2, 45), generator=g, dtype=torch.int32)
    extra_indices = torch.randint(-1, 9, (2, 7), generator=g, dtype=torch.int32)
    q, sink = (torch.randn(2, 24, 512, generator=g) * 4).bfloat16(), torch.randn(24, generator=g)
    aligned = AttentionCase(q, cache, indices, sink, 64, extra_cache, extra_indices, 4)
    shifted = dataclasses.replace(aligned, kv_cache=off_boundary(cache, offset),
                                  extra_kv_cache=off_boundary(extra_cache, extra_offset))
    for num_splits in (1, 2):
        got, expected = run(shifted, backend, num_splits=num_splits), run(aligned, backend, num_splits=num_splits)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert_same(expected, sparse_decode_attention_reference(q, cache, indices, sink, 64, **aligned.kwargs()), TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bf16_out_is_the_float32_out_rounded_to_nearest(backend):
    # One split finishes in a float32 staging the op rounds; split, the combine rounds and writes bf16
    # itself. Either way the bits of float32 -> bf16 round to nearest, ties to even.
    g = torch.Generator().manual_seed(3)
    indices = torch.randint(-1, 70, (3, 50), generator=g, dtype=torch.int32)
    indices[1] = -1  # an empty row: 0 in bf16 too
    case = AttentionCase(torch.randn(3, 20, 512, generator=g) * 3, v4_cache(random_rows(70, g), 64), indices,
                         torch.randn(20, generator=g), 64)
    for num_splits in (1, 2, 3):
        out, lse = run(case, backend, num_splits=num_splits, out_dtype=torch.bfloat16)
        expected_out, expected_lse = run(case, backend, num_splits=num_splits)
        assert out.dtype == torch.bfloat16 and torch.equal(out, expected_out.bfloat16())
        assert torch.equal(lse, expected_lse)
    # The entry writes bf16 only from the combine: one split is refused, naming `out`.
    c = case.to(device_of(backend))
    module = ATTENTION.module(q_dtype=torch.float32, backend=backend)
    out = torch.full((3, 20, 512), 7.0, dtype=torch.bfloat16, device=c.q.device)
    with pytest.raises(TypeError, match="argument `out` is bfloat16"):
        module.sparse_decode_attention(c.q, c.kv_cache, c.indices, c.sink, 64, 512**-0.5, None, None, -1, out,
                                       torch.empty(3, 20, device=c.q.device), None, None, None, 1, None)
    assert bool((out == 7.0).all())


def test_split_partials_are_cut_from_the_workspace_each_call_passes(backend):
    # The header's split partials are views of the caller's workspace, kept with the calls that passed
    # the workspace checks by the workspace object, its address, length and strides (both cost a
    # decode call more than the key does): the same workspace gives the same bits again; one at that
    # address of another dtype, or the same object changed in place (resize_, as_strided_, or .data
    # to fewer elements), is refused naming it before anything is written; a workspace elsewhere, or
    # the same object moved to other memory, gives the same bits with its partials written there,
    # not in the memory the memo saw.
    g = torch.Generator().manual_seed(4)
    c = AttentionCase(torch.randn(2, 4, 512, generator=g), v4_cache(random_rows(30, g), 64),
                      torch.randint(-1, 30, (2, 12), generator=g, dtype=torch.int32), torch.randn(4, generator=g),
                      64).to(device_of(backend))
    floats = workspace_floats(2, 4, 3)

    def call(workspace):
        out, lse = torch.full((2, 4, 512), 7.0, device=c.q.device), torch.full((2, 4), 7.0, device=c.q.device)
        sparse_decode_attention(c.q, c.kv_cache, c.indices, c.sink, 64, num_splits=3, out=out, lse=lse,
                                workspace=workspace, impl="header")
        return out, lse

    def reserved(workspace):  # its arrival counters' prefix
        return -(-workspace.numel() // 512)

    def filled(workspace):  # counters zero, 5.0 elsewhere: a call's partials overwrite some of it
        workspace.fill_(5.0)[:reserved(workspace)] = 0
        return workspace

    def writes_its_partials(workspace):  # the same bits, the partials written in `workspace`, its counters zero
        same = all(torch.equal(a, b) for a, b in zip(call(workspace), expected))
        return same and bool((workspace[:reserved(workspace)] == 0).all()) \
            and bool((workspace[reserved(workspace):] != 5.0).any())

    workspace = torch.zeros(floats, device=c.q.device)
    expected = call(workspace)
    assert not bool((expected[1] == 7.0).any())
    assert all(torch.equal(a, b) for a, b in zip(call(workspace), expected))
    out, lse = torch.full((2, 4, 512), 7.0, device=c.q.device), torch.full((2, 4), 7.0, device=c.q.device)
    shrunk, strided = torch.zeros(floats, device=c.q.device), torch.zeros(2 * floats, device=c.q.device)[:floats]
    call(shrunk), call(strided)
    shrunk.data = shrunk.data[:floats - 1]  # the same object, address and strides
    strided.as_strided_((floats,), (2,))  # the same object, address and length
    for refused in (lambda: workspace.view(torch.int32), lambda: shrunk, lambda: strided,
                    lambda: workspace.resize_(floats - 1)):  # made in turn: a resize_ counts for the view too
        with pytest.raises(ValueError, match="`workspace`"):
            sparse_decode_attention(c.q, c.kv_cache, c.indices, c.sink, 64, num_splits=3, out=out, lse=lse,
                                    workspace=refused(), impl="header")
        assert bool((out == 7.0).all()) and bool((lse == 7.0).all())
    elsewhere = filled(torch.zeros(floats + 64, device=c.q.device)[64:])
    assert writes_its_partials(elsewhere)
    seen, memory = elsewhere.data, filled(torch.zeros(floats, device=c.q.device))  # .data: a version of its own
    elsewhere.data = memory  # the same object and version, other memory
    seen.fill_(5.0)
    assert writes_its_partials(elsewhere) and bool((seen == 5.0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_nan_in_a_query_or_a_row_reaches_exactly_the_outputs_it_touches(backend, num_splits):
    g = torch.Generator().manual_seed(5)
    rows = random_rows(40, g)
    rows[7, 3] = float("nan")  # quantizes to an e4m3 NaN: slot 7 is a NaN row
    cache = v4_cache(rows, 64)
    indices = torch.tensor([[1, 2, 3, 4] * 10, [7, 2, 3, 4] * 10, [5, 6, -1, 8] * 10], dtype=torch.int32)
    q = torch.randn(3, 20, 512, generator=g)
    q[0, 17, 100] = float("nan")
    out, lse = run(AttentionCase(q, cache, indices, torch.randn(20, generator=g), 64), backend,
                   num_splits=num_splits)
    nan = torch.zeros(3, 20, dtype=torch.bool)
    nan[0, 17] = True  # the NaN query's head
    nan[1] = True  # every head of the row that selects the NaN row
    assert torch.equal(lse.isnan(), nan) and torch.equal(out.isnan().all(dim=2), nan)
    assert not bool(out[~nan].isnan().any())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_row_without_valid_entries_gives_zero_and_plus_inf(backend, num_splits):
    g = torch.Generator().manual_seed(0)
    cache = v4_cache(random_rows(8, g), 4)
    indices = torch.tensor([[-1, -1, -1], [2, -1, 5]], dtype=torch.int32)
    case = AttentionCase(torch.randn(2, 3, 512, generator=g), cache, indices, torch.zeros(3), 4)
    out, lse = run(case, backend, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros(3, 512)) and torch.equal(lse[0], torch.full((3,), float("inf")))
    assert bool(torch.isfinite(lse[1]).all()) and bool((out[1] != 0).any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_calls_of_any_shape_leave_the_arrival_counters_zero_and_nonzero_ones_are_refused(backend):
    # cuda and sim: the last split CTA of a row combines and resets its counter, which sits in the
    # workspace's prefix whatever the call's shape; so calls of different shapes (and a refused one)
    # share one zeroed workspace, each equal to its one-split result.
    g = torch.Generator().manual_seed(11)
    cache = v4_cache(random_rows(70, g), 64)
    big, small = (AttentionCase(torch.randn(batch, heads, 512, generator=g), cache,
                                torch.randint(-1, 70, (batch, k), generator=g, dtype=torch.int32),
                                torch.randn(heads, generator=g), 64) for batch, heads, k in ((3, 40, 50), (1, 20, 30)))
    workspace = torch.zeros(workspace_floats(3, 40, 3, torch.bfloat16), device=device_of(backend))
    counters = workspace[:3 * 3 * 2].view(torch.int32)  # the big case's [B, ceil(H / 16), 2]
    for case, num_splits, out_dtype in ((big, 3, torch.float32), (small, 2, torch.bfloat16), (big, 2, torch.float32),
                                        (small, 1, torch.bfloat16), (big, 3, torch.bfloat16)):
        got = run(case, backend, num_splits=num_splits, workspace=workspace, out_dtype=out_dtype)
        bf16 = {"rtol": 2**-8, "atol": 2**-8}  # one rounding to bf16 of values within ORDER_TOL
        assert_same(got, run(case, backend, num_splits=1), ORDER_TOL if out_dtype == torch.float32 else bf16)
        assert not bool(counters.any())
    with pytest.raises(ValueError, match="num_splits"):
        run(big, backend, num_splits=51, workspace=workspace)
    assert not bool(counters.any())
    if backend == "cuda":
        return  # a GPU workspace is not read: its counters are the caller's to zero once
    counters[5] = 1  # b = 0, heads 32-39: stores
    out = torch.full((3, 40, 512), 7.0)
    with pytest.raises(ValueError, match="argument `part_arrivals` must be all zero"):
        run(big, backend, num_splits=2, workspace=workspace, out=out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=attention_case(extra=False), data=st.data())
def test_an_extra_cache_is_the_same_as_one_longer_index_list(backend, case, data):
    # The extra cache is an independent source: splitting one list over (cache, cache) changes nothing.
    cut = data.draw(st.integers(0, case.indices.shape[1]))
    whole = run(case, backend)
    split = AttentionCase(case.q, case.kv_cache, case.indices[:, :cut].contiguous(), case.sink, case.page_slots,
                          case.kv_cache, case.indices[:, cut:].contiguous(), case.page_slots)
    assert_same(run(split, backend), whole, ORDER_TOL)


@pytest.mark.sanitizer_case
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_listed_twice_counts_twice(backend):
    g = torch.Generator().manual_seed(1)
    cache = v4_cache(random_rows(4, g), 2)
    q = torch.randn(1, 2, 512, generator=g)
    twice = run(AttentionCase(q, cache, torch.tensor([[1, 1, 3]], dtype=torch.int32), torch.zeros(2), 2), backend)
    expected = sparse_decode_attention_reference(q, cache, torch.tensor([[1, 1, 3]], dtype=torch.int32),
                                                 torch.zeros(2), 2)
    once = run(AttentionCase(q, cache, torch.tensor([[1, 3]], dtype=torch.int32), torch.zeros(2), 2), backend)
    assert_same(twice, expected, TOL)
    assert not torch.allclose(twice[0], once[0])


def _fresh():
    g = torch.Generator().manual_seed(2)
    cache = v4_cache(random_rows(8, g), 4)
    return dict(q=torch.randn(2, 3, 512, generator=g), kv_cache=cache,
                indices=torch.tensor([[0, 7, -1], [3, 3, 1]], dtype=torch.int32), sink=torch.zeros(3), page_slots=4)


BAD_INPUTS = [
    (lambda a: a.update(sink=a["sink"].bfloat16()), TypeError, "sink"),
    (lambda a: a.update(q=a["q"].half()), TypeError, "q"),
    (lambda a: a.update(q=a["q"][:, :, :256]), ValueError, "q"),
    (lambda a: a.update(q=a["q"][0]), ValueError, "q"),
    (lambda a: a.update(sink=torch.zeros(4)), ValueError, "sink"),
    (lambda a: a.update(indices=a["indices"].long()), TypeError, "indices"),
    (lambda a: a.update(indices=a["indices"][:1]), ValueError, "indices"),
    (lambda a: a.update(indices=torch.tensor([[0, 8, -1], [0, 0, 0]], dtype=torch.int32)), IndexError, "indices"),
    (lambda a: a.update(indices=torch.tensor([[0, -2, -1], [0, 0, 0]], dtype=torch.int32)), IndexError, "indices"),
    (lambda a: a.update(page_slots=3), ValueError, "page_slots"),
    (lambda a: a.update(page_slots=8), ValueError, "kv_cache"),
    (lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8)), TypeError, "kv_cache"),
    (lambda a: a.update(extra_kv_cache=a["kv_cache"], extra_indices=a["indices"]), ValueError, "extra_page_slots"),
    (lambda a: a.update(extra_page_slots=4), ValueError, "extra_page_slots"),
    (lambda a: a.update(extra_kv_cache=a["kv_cache"], extra_page_slots=4), ValueError, "extra_indices"),
    (lambda a: a.update(extra_kv_cache=a["kv_cache"], extra_indices=a["indices"] + 6, extra_page_slots=4), IndexError,
     "extra_indices"),
    (lambda a: a.update(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    (lambda a: a.update(num_splits=0), ValueError, "num_splits"),
    (lambda a: a.update(topk_length=torch.tensor([1, 4], dtype=torch.int32)), ValueError, "topk_length"),
    (lambda a: a.update(topk_length=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, "topk_length"),
    (lambda a: a.update(topk_length=torch.tensor([1, 2])), TypeError, "topk_length"),
    (lambda a: a.update(topk_length=torch.tensor([1], dtype=torch.int32)), ValueError, "topk_length"),
]


@pytest.mark.parametrize("impl", ["header", "triton"])
@pytest.mark.parametrize("mutate, exc, name", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(backend, index_checks, mutate, exc, name, impl):
    # Both implementations refuse the same inputs with the same exception naming the same argument.
    if impl == "triton":
        skip_unless_triton_runs(backend)
    args = _fresh()
    mutate(args)
    args = to_backend(backend, args)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc, match=f"`{name}`"):
        sparse_decode_attention(**args, impl=impl)
    for k, v in before.items():
        assert torch.equal(args[k], v), k


def _contract_call(backend, indices, topk_length):
    """The attention's input contract on valid arguments but ``indices`` and ``topk_length``."""
    args = to_backend(backend, _fresh())
    q = args["q"]
    out, lse = torch.empty(2, 3, 512, device=q.device), torch.empty(2, 3, device=q.device)
    indices, topk_length = indices.to(q.device), topk_length.to(q.device)
    return lambda read_values: check_attention_arguments(
        q, args["kv_cache"], indices, args["sink"], 4, 0.1, None, None, -1, 1, out, lse, None, topk_length,
        impl="header", read_values=read_values)


def test_the_contract_reads_the_tables_values_only_when_asked(backend):
    # 2 pages of 4 slots: slot 8 is outside; a length of 4 is above K = 3. Without reading values the
    # checks are O(1) (what a GPU call without SPARSEKV_CHECK_INDICES runs, and never syncs): shapes,
    # dtypes, page sizes and memory pass, and the kernels skip the slot and clamp the length.
    bad_slot = torch.tensor([[0, 8, -1], [0, 0, 0]], dtype=torch.int32)
    check = _contract_call(backend, bad_slot, torch.tensor([1, 4], dtype=torch.int32))
    main, extra, split_len = check(False)
    assert (main[2], main[3], main[5], main[6], extra, split_len) == (2, 8, 3, 3, None, 3)
    with pytest.raises(ValueError, match=re.escape("`topk_length` must be in [0, K=3], got [1, 4]")):
        check(True)
    check = _contract_call(backend, bad_slot, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(IndexError, match=re.escape("`indices`[0, 1] = 8 is neither -1 nor a slot of its cache [0, 8)")):
        check(True)


@pytest.mark.no_backend("the switch reads the tensor's device and the environment")
def test_host_tables_are_read_by_the_contract_or_the_entry_and_gpu_tables_only_with_the_flag(monkeypatch):
    for flag in ("0", "1"):
        monkeypatch.setenv("SPARSEKV_CHECK_INDICES", flag)
        # Host tables cost no sync: the contract reads them for the twin, the header's C++ entry for
        # itself (allocation-free, so a decode step given its buffers allocates nothing).
        assert reads_values(torch.zeros(1), "triton") and not reads_values(torch.zeros(1), "header")
        assert not reads_values(torch.zeros(1, device="meta"), "triton")  # nothing to read: shapes only


def test_a_gpu_call_reads_nothing_without_the_flag_and_refuses_with_it(backend, monkeypatch):
    if backend != "cuda":
        skip_for_gpu("the no-sync mode is the GPU's")
    args = to_backend(backend, _fresh())
    args["indices"] = torch.tensor([[0, 8, -1], [0, 0, 0]], dtype=torch.int32, device=args["q"].device)
    out, lse = torch.empty(2, 3, 512, device=args["q"].device), torch.empty(2, 3, device=args["q"].device)
    monkeypatch.delenv("SPARSEKV_CHECK_INDICES", raising=False)
    assert not reads_values(args["q"], "header")
    sparse_decode_attention(**args, num_splits=1, out=out, lse=lse, impl="header")  # warm: compiled, loaded
    torch.cuda.set_sync_debug_mode("error")  # any host read of the device raises
    try:
        sparse_decode_attention(**args, num_splits=1, out=out, lse=lse, impl="header")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")
    assert reads_values(args["q"], "header")
    with pytest.raises(IndexError, match=re.escape("`indices`[0, 1] = 8")):
        sparse_decode_attention(**args, num_splits=1, out=out, lse=lse, impl="header")


@pytest.mark.no_backend("template arguments are computed in Python")
def test_template_args_name_the_query_dtype_and_every_instance_is_registered():
    registered = {ATTENTION.template_args(v) for v in ATTENTION.instances}
    assert {attention_template_args(d) for d in (torch.float32, torch.bfloat16)} == registered
    with pytest.raises(TypeError, match="`q`"):
        attention_template_args(torch.float16)

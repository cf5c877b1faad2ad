"""DSV4 sparse decode attention: the kernel (every test backend) against the fp64 reference, its
properties (permutations, -1 entries, the sink, split-KV, empty rows, the extra cache), and the
bad-input contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4_attention import ATTENTION, attention_template_args, sparse_decode_attention
from sparsekv.testing.backends import core_backends, device_of, kernel_backends, skip_unless_triton_runs, to_backend
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
    out, lse = sparse_decode_attention(c.q, c.kv_cache, c.indices, c.sink, c.page_size, **c.kwargs(), **kwargs)
    return out.cpu(), lse.cpu()


def assert_same(a, b, tol):
    (out_a, lse_a), (out_b, lse_b) = a, b
    torch.testing.assert_close(out_a.to(torch.float64), out_b.to(torch.float64), **tol)
    torch.testing.assert_close(lse_a.to(torch.float64), lse_b.to(torch.float64), **tol)


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@given(case=attention_case())
def test_matches_the_fp64_reference(backend, case):
    expected = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_size,
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
    reference = sparse_decode_attention_reference(case.q, case.kv_cache, case.indices, case.sink, case.page_size,
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
        kv = dequantize_fp8_ds_mla(case.kv_cache, case.indices[b][case.indices[b] >= 0].long(), case.page_size)
        if case.extra_kv_cache is not None:
            extra = case.extra_indices[b][case.extra_indices[b] >= 0].long()
            kv = torch.cat([kv, dequantize_fp8_ds_mla(case.extra_kv_cache, extra, case.extra_page_size)])
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
@given(case=attention_case(extra=False), data=st.data())
def test_an_extra_cache_is_the_same_as_one_longer_index_list(backend, case, data):
    # The extra cache is an independent source: splitting one list over (cache, cache) changes nothing.
    cut = data.draw(st.integers(0, case.indices.shape[1]))
    whole = run(case, backend)
    split = AttentionCase(case.q, case.kv_cache, case.indices[:, :cut].contiguous(), case.sink, case.page_size,
                          case.kv_cache, case.indices[:, cut:].contiguous(), case.page_size)
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
                indices=torch.tensor([[0, 7, -1], [3, 3, 1]], dtype=torch.int32), sink=torch.zeros(3), page_size=4)


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
    (lambda a: a.update(page_size=3), ValueError, "page_size"),
    (lambda a: a.update(page_size=8), ValueError, "kv_cache"),
    (lambda a: a.update(kv_cache=a["kv_cache"].view(torch.int8)), TypeError, "kv_cache"),
    (lambda a: a.update(extra_kv_cache=a["kv_cache"], extra_indices=a["indices"]), ValueError, "extra_page_size"),
    (lambda a: a.update(extra_page_size=4), ValueError, "extra_page_size"),
    (lambda a: a.update(extra_kv_cache=a["kv_cache"], extra_page_size=4), ValueError, "extra_indices"),
    (lambda a: a.update(extra_kv_cache=a["kv_cache"], extra_indices=a["indices"] + 6, extra_page_size=4), IndexError,
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


@pytest.mark.no_backend("template arguments are computed in Python")
def test_template_args_name_the_query_dtype_and_every_instance_is_registered():
    registered = {ATTENTION.template_args(v) for v in ATTENTION.instances}
    assert {attention_template_args(d) for d in (torch.float32, torch.bfloat16)} == registered
    with pytest.raises(TypeError, match="`q`"):
        attention_template_args(torch.float16)

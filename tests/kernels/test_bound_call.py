"""Bound calls (``sparsekv.jit_kernel.bound_call``): a call bound once and made again equals the public call
on the same values, bind itself writes nothing and refuses what the call refuses, and the C++ entries
still check the bound arguments at every call."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.bound_call import bind
from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention, workspace_floats
from sparsekv.jit_kernel.dsv4_quant import quantize_fp8_ds_mla
from sparsekv.jit_kernel.gather_rows import gather_rows
from sparsekv.kv_layout import V4
from sparsekv.testing.backends import device_of
from sparsekv.testing.strategies.dsv4_attention import AttentionCase, attention_case, random_rows, v4_cache
from sparsekv.testing.strategies.gather_rows import gather_case


@given(data=st.data(), steps=st.integers(1, 3))
def test_a_bound_gather_equals_the_call_at_every_step_and_bind_writes_nothing(backend, data, steps):
    device = device_of(backend)
    dst, dst_idx, src, src_idx = (t.to(device) for t in data.draw(gather_case(torch.int64)))
    before = dst.clone()
    step = bind(gather_rows, dst, dst_idx, src, src_idx)
    assert step.planned and step.module_calls == 1
    assert torch.equal(dst, before)  # bind records the module call; no kernel runs
    expected = dst.clone()
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    for _ in range(steps):  # new values in the same tensors, as a decode loop writes them
        src.copy_(torch.randint(0, 256, src.shape, generator=g, dtype=torch.uint8))
        src_idx.copy_(torch.randint(0, src.shape[0], src_idx.shape, generator=g))
        gather_rows(expected, dst_idx, src, src_idx)
        assert step() is None
        assert torch.equal(dst, expected)


@given(case=attention_case(max_batch=2, max_heads=4, max_k=12), out_dtype=st.sampled_from([torch.float32,
                                                                                            torch.bfloat16]))
def test_a_bound_attention_equals_the_call_on_new_queries(backend, case, out_dtype):
    device = device_of(backend)
    case = case.to(device)
    batch, heads = case.q.shape[:2]
    out = torch.empty(batch, heads, 512, dtype=out_dtype, device=device)
    lse = torch.empty(batch, heads, device=device)
    step = bind(sparse_decode_attention, case.q, case.kv_cache, case.indices, case.sink, case.page_slots, out=out,
                lse=lse, out_dtype=out_dtype, num_splits=1, **case.kwargs())
    # One split into a bf16 output is copied from its float32 staging by torch: made whole every time.
    assert step.planned == (out_dtype == torch.float32)
    for scale in (1.0, -0.5):
        case.q.mul_(scale)
        want_out, want_lse = sparse_decode_attention(case.q, case.kv_cache, case.indices, case.sink, case.page_slots,
                                                     out_dtype=out_dtype, num_splits=1, **case.kwargs())
        got_out, got_lse = step()
        assert got_out is out and got_lse is lse
        assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)


def test_a_split_attention_binds_its_workspace_views_on_the_first_bind(backend):
    # The split partials are views of the workspace the call cuts (kept by its address): a view is
    # fixed at bind like any argument, so the first bind of a split call is its module call alone.
    g = torch.Generator().manual_seed(6)
    case = AttentionCase(torch.randn(2, 4, 512, generator=g), v4_cache(random_rows(20, g), 4),
                         torch.randint(-1, 20, (2, 9), generator=g, dtype=torch.int32), torch.randn(4, generator=g),
                         4).to(device_of(backend))
    out, lse = torch.empty(2, 4, 512, device=case.q.device), torch.empty(2, 4, device=case.q.device)
    workspace = torch.zeros(workspace_floats(2, 4, 3), device=case.q.device)
    step = bind(sparse_decode_attention, case.q, case.kv_cache, case.indices, case.sink, case.page_slots, out=out,
                lse=lse, num_splits=3, workspace=workspace)
    assert step.planned and step.module_calls == 1
    want_out, want_lse = sparse_decode_attention(case.q, case.kv_cache, case.indices, case.sink, case.page_slots,
                                                 num_splits=3, workspace=torch.zeros_like(workspace))
    out.fill_(7.0)
    step()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_bind_refuses_what_the_call_refuses_with_the_same_exception(backend):
    device = device_of(backend)
    dst, src = (torch.zeros(4, 8, dtype=torch.uint8, device=device) for _ in range(2))
    bad = torch.arange(4, dtype=torch.int16, device=device)
    with pytest.raises(TypeError) as called:
        gather_rows(dst, bad, src, bad)
    with pytest.raises(TypeError, match=re.escape(str(called.value))):
        bind(gather_rows, dst, bad, src, bad)


def test_bind_records_header_module_calls_only(backend):
    device = device_of(backend)
    x, slots = torch.zeros(2, 512, device=device), torch.arange(2, device=device)
    cache = torch.zeros(1, V4.page_bytes(4), dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="argument `impl` must be 'auto' or 'header'"):
        bind(quantize_fp8_ds_mla, x, cache, slots, 4, impl="triton")
    assert bind(quantize_fp8_ds_mla, x, cache, slots, 4).planned


def test_the_entry_still_checks_a_bound_argument_changed_in_place(backend):
    device = device_of(backend)
    dst, src = (torch.zeros(4, 8, dtype=torch.uint8, device=device) for _ in range(2))
    dst_idx, src_idx = torch.arange(4, device=device), torch.arange(4, device=device)
    step = bind(gather_rows, dst, dst_idx, src, src_idx)
    src_idx.resize_(3)  # the tensor the bound call holds, now shorter than dst_indices
    with pytest.raises(ValueError, match="src_indices"):
        step()


def test_only_the_binding_thread_is_recorded(backend):
    device = device_of(backend)
    src = torch.arange(32, dtype=torch.uint8, device=device).reshape(4, 8)
    dst, elsewhere = torch.zeros_like(src), torch.zeros_like(src)
    rows = torch.arange(4, device=device)

    def gather_while_another_thread_gathers(*args):
        worker = threading.Thread(target=gather_rows, args=(elsewhere, rows, src, rows))
        worker.start()
        worker.join()  # a real call, made while this thread records
        gather_rows(*args)

    step = bind(gather_while_another_thread_gathers, dst, rows, src, rows)
    assert torch.equal(elsewhere, src) and not dst.any()
    assert step.planned and step.module_calls == 1
    step()
    assert torch.equal(dst, src)

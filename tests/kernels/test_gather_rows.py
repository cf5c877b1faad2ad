"""gather_rows: the kernel (every test backend) against torch indexing, and its input contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from sparsekv.jit_kernel.gather_rows import GATHER_ROWS, gather_rows
from sparsekv.testing.backends import core_backends, device_of, host_readable, to_backend
from sparsekv.testing.components import skip_for_gpu
from sparsekv.testing.reference.gather_rows import gather_rows_reference
from sparsekv.testing.strategies.gather_rows import gather_case

INDEX_DTYPES = [values["index_dtype"] for values in GATHER_ROWS.instances]


@pytest.mark.sanitizer_case
@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=str)
@given(data=st.data())
def test_gather_matches_torch_indexing(backend, index_dtype, data):
    dst, dst_idx, src, src_idx = data.draw(gather_case(index_dtype))
    device = device_of(backend)
    expected = gather_rows_reference(dst, dst_idx, src, src_idx)
    dst, dst_idx, src, src_idx = (t.to(device) for t in (dst, dst_idx, src, src_idx))
    gather_rows(dst, dst_idx, src, src_idx)
    assert torch.equal(dst.cpu(), expected)


@given(rows=st.integers(1, 8), pad=st.integers(1, 16))
@example(rows=1, pad=1)
def test_writes_only_the_named_columns_of_a_strided_view(backend, rows, pad):
    # A column slice of a wider buffer: the bytes around the slice must stay as they were.
    device = device_of(backend)
    wide = torch.full((rows, 8 + 2 * pad), 7, dtype=torch.uint8, device=device)
    view = wide[:, pad : pad + 8]
    src = torch.arange(rows * 8, dtype=torch.uint8, device=device).reshape(rows, 8)
    idx = torch.arange(rows, device=device)
    gather_rows(view, idx, src, idx.flip(0))
    assert torch.equal(view, src.flip(0))
    assert bool((wide[:, :pad] == 7).all()) and bool((wide[:, pad + 8 :] == 7).all())


@pytest.mark.parametrize("offset", [0, 8], ids=["aligned", "8-off"])
def test_584_byte_rows_move_whole_in_every_alignment(backend, offset):
    # Dense 584-byte rows start alternately on and 8 bytes off a 16-byte boundary: each pair of
    # source and destination rows below takes one of the GPU path's copies (16 bytes with an 8-byte
    # head and tail when both sit equally off, 8 bytes when they differ), and nothing around a row moves.
    device = device_of(backend)
    gen = torch.Generator().manual_seed(offset)
    src = torch.randint(0, 256, (6, 584), dtype=torch.uint8, generator=gen)
    wide = torch.full((6, 584 + 16), 7, dtype=torch.uint8)
    dst_idx, src_idx = torch.tensor([0, 1, 2, 3, 5]), torch.tensor([0, 1, 3, 2, 5])
    expected = gather_rows_reference(wide[:, offset : offset + 584].clone(), dst_idx, src, src_idx)
    wide = wide.to(device)
    dst = wide[:, offset : offset + 584]
    gather_rows(dst, dst_idx.to(device), src.to(device), src_idx.to(device))
    assert torch.equal(dst.cpu(), expected)
    assert bool((wide[:, :offset] == 7).all()) and bool((wide[:, offset + 584 :] == 7).all())


@given(row_bytes=st.one_of(st.integers(1, 72), st.sampled_from([584, 585, 591])),
       dst_offset=st.integers(0, 15), src_offset=st.integers(0, 15),
       dst_stride_pad=st.integers(0, 17), src_stride_pad=st.integers(0, 17), seed=st.integers(0, 2**16))
@example(row_bytes=584, dst_offset=8, src_offset=0, dst_stride_pad=0, src_stride_pad=0, seed=0)
@example(row_bytes=13, dst_offset=1, src_offset=3, dst_stride_pad=3, src_stride_pad=1, seed=1)
def test_rows_of_every_width_and_alignment_move_byte_exact(backend, row_bytes, dst_offset, src_offset,
                                                           dst_stride_pad, src_stride_pad, seed):
    # Column slices at every offset and row stride put source and destination rows at every
    # alignment, equal or not (the GPU path picks 16-, 8-, 4-byte words or shifted 8-byte words
    # and a head and tail in pieces by that): the rows move byte for byte and nothing around them.
    device = device_of(backend)
    gen = torch.Generator().manual_seed(seed)
    rows = 5
    src_wide = torch.randint(0, 256, (rows, src_offset + row_bytes + src_stride_pad), dtype=torch.uint8, generator=gen)
    dst_wide = torch.full((rows, dst_offset + row_bytes + dst_stride_pad), 7, dtype=torch.uint8)
    dst_idx, src_idx = torch.tensor([4, 0, 2, 1]), torch.tensor([1, 3, 0, 4])
    expected = dst_wide.clone()
    expected[dst_idx, dst_offset : dst_offset + row_bytes] = src_wide[src_idx, src_offset : src_offset + row_bytes]
    src_wide, dst_wide = src_wide.to(device), dst_wide.to(device)
    gather_rows(dst_wide[:, dst_offset : dst_offset + row_bytes], dst_idx.to(device),
                src_wide[:, src_offset : src_offset + row_bytes], src_idx.to(device))
    assert torch.equal(dst_wide.cpu(), expected)


def _fresh(backend="cpu"):
    device = device_of(backend)
    src = torch.arange(60, dtype=torch.uint8, device=device).reshape(6, 10)
    dst = torch.full((4, 10), 255, dtype=torch.uint8, device=device)
    return dst, src


BAD_INPUTS = [
    # (mutator of (dst, dst_idx, src, src_idx), exception, name in message)
    (lambda d, di, s, si: (d, torch.tensor([0, 4]), s, si), IndexError, "dst_indices"),
    (lambda d, di, s, si: (d, torch.tensor([0, -1]), s, si), IndexError, "dst_indices"),
    (lambda d, di, s, si: (d, di, s, torch.tensor([0, 6])), IndexError, "src_indices"),
    (lambda d, di, s, si: (d, di, s, si.to(torch.int32)), TypeError, "src_indices"),
    (lambda d, di, s, si: (d.to(torch.int16), di, s, si), TypeError, "dst"),
    (lambda d, di, s, si: (d, di, s.to(torch.float32), si), TypeError, "src"),
    (lambda d, di, s, si: (d, di, s, si[:1]), ValueError, "src_indices"),
    (lambda d, di, s, si: (d, di, s[:, :5], si), ValueError, "src"),
    (lambda d, di, s, si: (d[:, ::2], di, s[:, ::2], si), ValueError, "dst"),
    (lambda d, di, s, si: (d, torch.tensor([[0, 1]]), s, si), ValueError, "dst_indices"),
    (lambda d, di, s, si: (d, torch.tensor([0, 1, 2, 3])[::2], s, si), ValueError, "dst_indices"),
    (lambda d, di, s, si: (d.flatten(), di, s, si), ValueError, "dst"),
]


@pytest.mark.parametrize("mutate, exc, name", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(backend, mutate, exc, name):
    if exc is IndexError and not host_readable(backend):
        skip_for_gpu("device-resident indices are not read by the host entry; the kernel skips bad rows")
    dst, src = _fresh(backend)
    before = dst.clone()
    args = to_backend(backend, mutate(dst, torch.tensor([0, 1]), src, torch.tensor([2, 3])))
    with pytest.raises(exc, match=f"`{name}`"):
        gather_rows(*args)
    assert torch.equal(dst, before)


def test_index_dtype_outside_the_table_is_rejected(backend):
    dst, src = _fresh(backend)
    idx = torch.tensor([0], dtype=torch.int16, device=device_of(backend))
    with pytest.raises(TypeError, match="dst_indices"):
        gather_rows(dst, idx, src, idx)


# Aliasing: dst is written while src and the indices are read.
ALIASED = {
    "src is dst": (lambda buf, i: (buf[:4], i(0, 1), buf[:4], i(2, 3)), "dst", "src"),
    "overlapping views": (lambda buf, i: (buf[2:6], i(0, 1), buf[:4], i(2, 3)), "dst", "src"),
    "interleaved views": (lambda buf, i: (buf[:, :5], i(0, 1), buf[:, 5:], i(2, 3)), "dst", "src"),
    "indices inside dst": (lambda buf, i: (buf[:5], buf.view(-1)[40:48].view(torch.int64), buf[6:], i(0)),
                           "dst", "dst_indices"),
}


@pytest.mark.parametrize("case", ALIASED.values(), ids=ALIASED.keys())
def test_arguments_sharing_memory_with_dst_are_rejected(backend, case):
    make, first, second = case
    device = device_of(backend)
    buf = torch.arange(100, dtype=torch.uint8, device=device).reshape(10, 10)
    before = buf.clone()
    dst, dst_idx, src, src_idx = make(buf, lambda *v: torch.tensor(v, device=device))
    with pytest.raises(ValueError, match=f"`{first}` and `{second}` must not share memory"):
        gather_rows(dst, dst_idx, src, src_idx)
    assert torch.equal(buf, before)


def test_adjacent_rows_of_one_buffer_are_not_sharing(backend):
    device = device_of(backend)
    buf = torch.arange(100, dtype=torch.uint8, device=device).reshape(10, 10)
    expected = buf.clone()
    expected[0] = expected[7]
    gather_rows(buf[:5], torch.tensor([0], device=device), buf[5:], torch.tensor([2], device=device))
    assert torch.equal(buf, expected)


def test_a_destination_named_twice_with_different_sources_is_rejected(backend):
    dst, src = _fresh(backend)
    before = dst.clone()
    device = device_of(backend)
    if host_readable(backend):  # host-readable indices; on the device distinct destinations are the caller's duty
        with pytest.raises(ValueError, match="`dst_indices` names destination 1 twice"):
            gather_rows(dst, torch.tensor([1, 0, 1]), src, torch.tensor([2, 3, 4]))
        assert torch.equal(dst, before)
    # The same destination with the same source is harmless.
    gather_rows(dst, torch.tensor([1, 0, 1], device=device), src, torch.tensor([2, 3, 2], device=device))
    assert torch.equal(dst[1], src[2]) and torch.equal(dst[0], src[3])


def test_an_invalid_instance_is_rejected_before_compiling(backend):
    with pytest.raises(ValueError, match="`index_dtype` must be one of"):
        GATHER_ROWS.module(index_dtype=torch.int8, backend=backend)
    with pytest.raises(ValueError, match="no parameter 'index_type'"):
        GATHER_ROWS.module(index_type="int8_t", backend=backend)

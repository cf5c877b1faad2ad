"""DeepSeekV4PagedHostPool and its page allocator: byte-exact round trips device -> host -> device on
both paths and both host layouts, typed id namespaces, lazy page freeing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.kv_layout import V4
from sparsekv.srt.mem_cache.dsv4_paged_host_pool import DeepSeekV4PagedHostPool
from sparsekv.srt.mem_cache.hisparse_host_pool import HostPoolExhaustedError
from sparsekv.srt.mem_cache.ids import DevicePages, DeviceSlots, HostPages, HostSlots
from sparsekv.testing.reference.hisparse_copy import read_token, token_pattern, write_token
from sparsekv.testing.strategies.hisparse_copy import random_bytes

P = 64
PAGE = V4.page_bytes(P)
LAYOUTS = ("layer_first", "page_first")


def _device_layers(num_layers=3, num_pages=6, seed=0):
    return list(random_bytes((num_layers, num_pages, PAGE), seed).unbind(0))


def _tokens(layers, slots):
    """[L, N, 584] token bytes of ``slots`` in each layer, read through the reference views."""
    return torch.stack([torch.stack([read_token(layer, s) for s in slots]) for layer in layers])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_path_round_trip_is_byte_exact(layout):
    device = _device_layers()
    original = [t.clone() for t in device]
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=4, layout=layout)
    host = pool.alloc_page(2).slots(P)
    dev = DeviceSlots(torch.arange(P, 3 * P))  # device pages 1 and 2

    pool.backup_from_device_all_layer(host, dev)
    for t in device:
        t.zero_()
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(host, dev, layer)

    for layer, (after, before) in enumerate(zip(device, original)):
        # Whole page rows, padding included (the page path moved opaque rows) ...
        assert torch.equal(after[1:3], before[1:3])
        # ... and nothing else.
        assert not after[0].any() and not after[3:].any()
        host_pages = host.whole_pages(P).tensor
        assert torch.equal(pool.kv_buffer[layer][host_pages], before[1:3])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_path_round_trip_is_byte_exact(layout):
    device = _device_layers(seed=1)
    original = [t.clone() for t in device]
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=4, layout=layout)
    table = torch.full((2, 4 * P), -1, dtype=torch.int64)
    allocated = torch.zeros(2, dtype=torch.int64)
    dev_slots = [0, 63, 64, 70, 127, 128, 300, 383]  # page edges and a page boundary
    host = pool.alloc_paged_token_slots(table, allocated, 1, 0, len(dev_slots))
    dev = DeviceSlots(torch.tensor(dev_slots))

    pool.backup_from_device_all_layer(host, dev)
    assert torch.equal(_tokens(pool.kv_buffer, host.tensor.tolist()), _tokens(original, dev_slots))
    for t in device:
        t.zero_()
    for layer in range(pool.layer_num):
        pool.load_to_device_per_layer(host, dev, layer)

    expected = [torch.zeros_like(t) for t in original]
    for layer in range(pool.layer_num):
        for s in dev_slots:
            write_token(expected[layer], s, read_token(original[layer], s))
    for after, want in zip(device, expected):
        assert torch.equal(after, want)  # the token bytes, and not one byte of padding or neighbours


def test_page_multiple_but_unaligned_request_moves_tokens_not_rows():
    """128 slots that are not two aligned pages must not be taken for pages (page padding stays 0)."""
    device = _device_layers(num_layers=1, seed=2)
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=3)
    host = HostSlots(torch.arange(P, 3 * P))
    dev = DeviceSlots(torch.arange(1, 2 * P + 1))  # shifted by one slot
    pool.backup_from_device_all_layer(host, dev)
    assert torch.equal(_tokens(pool.kv_buffer, host.tensor.tolist()), _tokens(device, dev.tensor.tolist()))
    assert not pool.kv_buffer[0][:, V4.padding_offset(P):].any()


def test_unaligned_then_aligned_backup_of_the_same_tokens_agree():
    device = _device_layers(num_layers=2, seed=3)
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=4)
    dev = torch.arange(2 * P, 4 * P)
    by_tokens, by_pages = pool.alloc_page(2).slots(P), pool.alloc_page(2).slots(P)
    # Token path: two calls of 100 and 28 tokens (neither a page multiple).
    pool.backup_from_device_all_layer(HostSlots(by_tokens.tensor[:100]), DeviceSlots(dev[:100]))
    pool.backup_from_device_all_layer(HostSlots(by_tokens.tensor[100:]), DeviceSlots(dev[100:]))
    pool.backup_from_device_all_layer(by_pages, DeviceSlots(dev))
    tokens = _tokens(pool.kv_buffer, by_tokens.tensor.tolist())
    assert torch.equal(tokens, _tokens(pool.kv_buffer, by_pages.tensor.tolist()))
    assert torch.equal(tokens, _tokens(device, dev.tolist()))


def test_dsv4_swap_in_reads_paged_host_layout():
    """Our take on sglang's test of the same name, at the pool level: the host token at slot 65
    (page 1, offset 1) reaches device slot 76 (page 1, offset 12) read with paged addressing on the
    host side; a linear 584-byte host stride would read other bytes."""
    device = [torch.zeros(2, PAGE, dtype=torch.uint8)]
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=2)
    write_token(pool.kv_buffer[0], 65, token_pattern(41))
    pool.load_to_device_per_layer(HostSlots(torch.tensor([65])), DeviceSlots(torch.tensor([76])), 0)
    assert torch.equal(read_token(device[0], 76), token_pattern(41))
    expected = torch.zeros_like(device[0])
    write_token(expected, 76, token_pattern(41))
    assert torch.equal(device[0], expected)


def test_page_aligned_only_rejects_the_token_path_before_writing():
    device = _device_layers(num_layers=1, seed=4)
    pool = DeepSeekV4PagedHostPool("idx", device, num_host_pages=2, page_aligned_only=True)
    with pytest.raises(ValueError, match="page_aligned_only"):
        pool.backup_from_device_all_layer(HostSlots(torch.tensor([0, 1])), DeviceSlots(torch.tensor([5, 6])))
    assert not pool.buffer.any()
    pool.backup_from_device_all_layer(HostSlots(torch.arange(P)), DeviceSlots(torch.arange(P)))  # pages: fine
    assert torch.equal(pool.kv_buffer[0][0], device[0][0])


def test_has_transfer_indices():
    has = DeepSeekV4PagedHostPool._has_transfer_indices
    empty = torch.empty(0, dtype=torch.int64)
    assert not has(None, DeviceSlots(torch.tensor([1])))
    assert not has(HostSlots(torch.tensor([1])), None)
    assert not has(HostSlots(empty), DeviceSlots(empty))
    assert has(HostSlots(torch.tensor([1])), DeviceSlots(torch.tensor([2])))
    with pytest.raises(ValueError, match="same length"):
        has(HostSlots(torch.tensor([1, 2])), DeviceSlots(torch.tensor([2])))


def test_host_and_device_ids_cannot_be_swapped_or_bare():
    device = _device_layers(num_layers=1, seed=5)
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=2)
    ids = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="`host_indices` must be HostSlots"):
        pool.backup_from_device_all_layer(DeviceSlots(ids), DeviceSlots(ids))
    with pytest.raises(TypeError, match="`device_indices` must be DeviceSlots"):
        pool.load_to_device_per_layer(HostSlots(ids), ids, 0)
    with pytest.raises(TypeError, match="`host_indices` must be HostSlots"):
        pool.backup_from_device_all_layer(HostPages(ids), DeviceSlots(ids))
    with pytest.raises(TypeError, match="different id spaces"):
        HostSlots(DeviceSlots(ids))
    assert not pool.buffer.any()


def test_transfer_errors_leave_host_unchanged():
    device = _device_layers(num_layers=2, seed=6)
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=2)
    with pytest.raises(IndexError, match="`dst_indices`"):  # host slot 128 is beyond 2 pages
        pool.backup_from_device_all_layer(HostSlots(torch.tensor([0, 128])), DeviceSlots(torch.tensor([0, 1])))
    with pytest.raises(IndexError, match="`src_indices`"):  # device slot 6 * 64 is beyond 6 pages
        pool.backup_from_device_all_layer(HostSlots(torch.tensor([0, 1])), DeviceSlots(torch.tensor([0, 384])))
    with pytest.raises(IndexError, match="`layer_id`"):
        pool.load_to_device_per_layer(HostSlots(torch.tensor([0])), DeviceSlots(torch.tensor([0])), 2)
    assert not pool.buffer.any()


def test_contiguous_buf_infos_describe_each_layer():
    device = _device_layers(num_layers=3, seed=7)
    pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=5)
    infos = pool.get_contiguous_buf_infos()
    base = pool.buffer.data_ptr()
    assert infos.data_ptrs == [base + layer * 5 * PAGE for layer in range(3)]
    assert infos.data_lens == [5 * PAGE] * 3 and infos.item_lens == [PAGE] * 3
    assert pool.data_ptrs.tolist() == infos.data_ptrs
    with pytest.raises(ValueError, match="page_first"):
        DeepSeekV4PagedHostPool("c4", device, num_host_pages=5, layout="page_first").get_contiguous_buf_infos()


def test_host_memory_is_pinned_exactly_with_cuda():
    pool = DeepSeekV4PagedHostPool("c4", _device_layers(num_layers=1), num_host_pages=1)
    assert pool.buffer.is_pinned() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="`pin_memory`"):
            DeepSeekV4PagedHostPool("c4", _device_layers(num_layers=1), num_host_pages=1, pin_memory=True)


def test_pageable_host_memory_is_refused_for_cuda_device_buffers():
    class CudaLooking(torch.Tensor):
        # Only the device is looked at before the refusal, so a host tensor reporting a CUDA
        # device shows it without a GPU.
        @property
        def device(self):
            return torch.device("cuda", 0)

    layers = [t.as_subclass(CudaLooking) for t in _device_layers(num_layers=2)]
    with pytest.raises(ValueError, match="`pin_memory` is False, but the device buffers are on cuda:0"):
        DeepSeekV4PagedHostPool("c4", layers, num_host_pages=1, pin_memory=False)


@pytest.mark.parametrize("bad, error, match", [
    ([], ValueError, "at least one layer"),
    ([torch.zeros(2, PAGE, dtype=torch.int8)], TypeError, r"`device_buffers`\[0\]"),
    ([torch.zeros(2, PAGE - 1, dtype=torch.uint8)], ValueError, r"`device_buffers`\[0\]"),
    ([torch.zeros(2, PAGE, dtype=torch.uint8), torch.zeros(3, PAGE, dtype=torch.uint8)], ValueError,
     r"`device_buffers`\[1\]"),
])
def test_bad_device_buffers(bad, error, match):
    with pytest.raises(error, match=match):
        DeepSeekV4PagedHostPool("c4", bad, num_host_pages=1)


def test_typed_id_conversions():
    assert HostPages(torch.tensor([2, 0])).slots(4).tensor.tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert DeviceSlots(torch.arange(8, 16)).whole_pages(4).tensor.tolist() == [2, 3]
    assert isinstance(DeviceSlots(torch.arange(8, 16)).whole_pages(4), DevicePages)
    assert DeviceSlots(torch.arange(9, 17)).whole_pages(4) is None  # unaligned
    assert HostSlots(torch.tensor([0, 1, 3, 2])).whole_pages(4) is None  # out of order
    assert HostSlots(torch.arange(3)).whole_pages(4) is None  # not a page multiple


# --- the page allocator --------------------------------------------------------------------------


def _pool(num_pages):
    return DeepSeekV4PagedHostPool("c4", [torch.zeros(1, V4.page_bytes(32), dtype=torch.uint8)],
                                   num_host_pages=num_pages, page_slots=32)


@given(ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 70)), max_size=25))
def test_paged_token_slots_invariants(ops):
    """Random appends to 3 requests: whole pages per request, no slot shared, accounting agrees."""
    pool = _pool(8)
    table = torch.full((3, 8 * 32), -1, dtype=torch.int64)
    allocated = torch.zeros(3, dtype=torch.int64)
    length = [0, 0, 0]
    for req, n in ops:
        need = pool.host_pages_needed(length[req], n, int(allocated[req]))
        before = pool.available_pages
        try:
            slots = pool.alloc_paged_token_slots(table, allocated, req, length[req], n)
        except (HostPoolExhaustedError, ValueError):
            assert pool.available_pages == before  # nothing allocated by a failed call
            continue
        assert pool.available_pages == before - need
        assert torch.equal(slots.tensor, table[req, length[req] : length[req] + n])
        length[req] += n
    used = table[table >= 0]
    assert used.unique().numel() == used.numel()
    assert pool.available_pages * 32 + used.numel() == pool.size
    for req in range(3):
        assert int(allocated[req]) % 32 == 0 and int(allocated[req]) >= length[req]
        row = pool.allocated_host_indices(table, req, int(allocated[req]))
        assert len(row) == int(allocated[req]) and (len(row) == 0 or row.whole_pages(32) is not None)


def test_freed_pages_are_reused_lazily_and_double_free_is_caught():
    pool = _pool(3)
    a, b = pool.alloc_page(1), pool.alloc_page(1)
    pool.free_pages(a)
    assert pool.available_pages == 2
    assert pool.alloc_page(1).tensor.tolist() == [2]  # the never-used page first: `a` waits
    assert pool.alloc_page(1).tensor.tolist() == a.tensor.tolist()  # released pages join when needed
    with pytest.raises(HostPoolExhaustedError):
        pool.alloc_page(1)
    pool.free(b.slots(32))
    with pytest.raises(ValueError, match="not allocated"):
        pool.free_pages(b)
    with pytest.raises(ValueError, match="whole aligned"):
        pool.free(HostSlots(torch.tensor([5])))


def test_docstring_examples_run():
    import doctest

    import sparsekv.srt.mem_cache.dsv4_paged_host_pool as pool_module
    import sparsekv.srt.mem_cache.ids as ids_module

    for module in (ids_module, pool_module):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_an_exhausted_alloc_page_leaves_the_free_and_released_lists_as_they_were():
    pool = _pool(3)
    a, _ = pool.alloc_page(1), pool.alloc_page(1)
    pool.free_pages(a)
    alloc = pool.page_alloc
    free, released = alloc._free.clone(), [t.clone() for t in alloc._released]
    with pytest.raises(HostPoolExhaustedError):
        pool.alloc_page(3)
    assert torch.equal(alloc._free, free)
    assert len(alloc._released) == len(released) and all(torch.equal(x, y) for x, y in zip(alloc._released, released))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_host_pages": True}, TypeError, "num_host_pages"),
    ({"num_host_pages": 2.0}, TypeError, "num_host_pages"),
    ({"num_host_pages": 0}, ValueError, "num_host_pages"),
    ({"page_slots": 32.0}, TypeError, "page_slots"),
    ({"page_slots": 48}, ValueError, "page_slots"),
])
def test_pool_sizes_must_be_ints(kwargs, error, match):
    args = {"num_host_pages": 2, "page_slots": 32, **kwargs}
    with pytest.raises(error, match=match):
        DeepSeekV4PagedHostPool("c4", [torch.zeros(1, V4.page_bytes(32), dtype=torch.uint8)], **args)


def test_host_table_rows_are_checked_before_allocation():
    pool = _pool(4)
    table = torch.full((2, 4 * 32), -1, dtype=torch.int64)
    allocated = torch.zeros(2, dtype=torch.int64)
    for args, error, match in [((2, 0, 4), IndexError, "req_pool_idx"), ((-1, 0, 4), IndexError, "req_pool_idx"),
                               ((True, 0, 4), TypeError, "req_pool_idx"), ((0, 0, -5), ValueError, "num_tokens"),
                               ((0, 0, 4.0), TypeError, "num_tokens")]:
        with pytest.raises(error, match=match):
            pool.alloc_paged_token_slots(table, allocated, *args)
    with pytest.raises(TypeError, match="req_to_host_pool"):
        pool.alloc_paged_token_slots(table.float(), allocated, 0, 0, 4)
    allocated[1] = 5  # not whole pages: the table is corrupt
    with pytest.raises(ValueError, match="allocated_len"):
        pool.alloc_paged_token_slots(table, allocated, 1, 0, 4)
    assert pool.available_pages == 4 and bool((table == -1).all())


def test_page_slots_of_id_conversions_must_be_positive_ints():
    with pytest.raises(ValueError, match="page_slots"):
        HostSlots(torch.arange(4)).whole_pages(0)
    with pytest.raises(TypeError, match="page_slots"):
        HostPages(torch.tensor([1])).slots(64.0)

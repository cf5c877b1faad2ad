"""transfer_cache_dsv4_mla and transfer_pages_dsv4_mla (every test backend) against the torch references:
bytes equal, nothing outside the destination records written, bad input (null base addresses and
chained ids in one buffer included) rejected before any byte moves (on a GPU, where the refusals read
device values, under full index validation: the ``index_checks`` fixture)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.hisparse_copy import (
    PAGE_SLOTS,
    check_copy_on_device,
    pointer_table,
    table_layers,
    transfer_cache_dsv4_mla,
    transfer_pages_dsv4_mla,
)
from sparsekv.kv_layout import V4
from sparsekv.testing.backends import core_backends, device_of, host_readable, to_device
from sparsekv.testing.reference.hisparse_copy import (
    read_token,
    token_pattern,
    transfer_pages_,
    transfer_tokens_,
    write_token,
)
from sparsekv.testing.strategies.hisparse_copy import page_copy_case, paged_side, token_copy_case

PAGE = V4.page_bytes(64)


def run(backend, fn, src, dst, src_ids, dst_ids, **kw):
    """``fn`` on ``backend``: both sides and the ids moved there (pointer tables of the moved layers),
    ``dst.owner`` updated from the backend's copy afterwards, also when ``fn`` raises."""
    device = device_of(backend)
    s, d = (src, dst) if host_readable(backend) else (src.to(device), dst.to(device))
    if dst is src:  # one buffer as source and destination stays one buffer on the device
        d = s
    try:
        fn(pointer_table(s.layers), pointer_table(d.layers), src_ids.to(device), dst_ids.to(device), **kw)
    finally:
        if d is not dst:
            dst.owner.copy_(d.owner.cpu())


def _destination_mask(side, dst_ids, page_slots):
    """1 on the value and scale bytes of the destination slots in every layer, 0 elsewhere."""
    mask = torch.zeros_like(side.owner)
    page, off = dst_ids // page_slots, dst_ids % page_slots
    for layer in side.layers_of(mask):
        V4.value_view(layer, page_slots)[page, off] = 1
        V4.scale_view(layer, page_slots)[page, off] = 1
    return mask.bool()


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@given(data=st.data(), page_slots=st.sampled_from(PAGE_SLOTS))
def test_token_copy_matches_reference(backend, data, page_slots):
    src, dst, src_ids, dst_ids = data.draw(token_copy_case(page_slots))
    src_before, dst_before = src.owner.clone(), dst.owner.clone()
    expected = dst.owner.clone()
    transfer_tokens_(dst.layers_of(expected), src.layers, src_ids, dst_ids, page_slots=page_slots)

    run(backend, transfer_cache_dsv4_mla, src, dst, src_ids, dst_ids, src_num_slots=src.num_pages * page_slots,
        dst_num_slots=dst.num_pages * page_slots, page_slots=page_slots, src_page_stride=src.page_stride,
        dst_page_stride=dst.page_stride)

    assert torch.equal(dst.owner, expected)
    assert torch.equal(src.owner, src_before)
    for layer_src, layer_dst in zip(src.layers, dst.layers):
        for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
            assert torch.equal(read_token(layer_dst, d, page_slots=page_slots),
                               read_token(layer_src, s, page_slots=page_slots))
    # Every byte outside the destination records, page padding included, is unchanged.
    outside = ~_destination_mask(dst, dst_ids, page_slots)
    assert torch.equal(dst.owner[outside], dst_before[outside])


@given(data=st.data(), page_slots=st.sampled_from(PAGE_SLOTS))
def test_page_copy_matches_reference(backend, data, page_slots):
    src, dst, src_pages, dst_pages = data.draw(page_copy_case(page_slots))
    src_before, dst_before = src.owner.clone(), dst.owner.clone()
    expected = dst.owner.clone()
    transfer_pages_(dst.layers_of(expected), src.layers, src_pages, dst_pages)

    run(backend, transfer_pages_dsv4_mla, src, dst, src_pages, dst_pages, src_num_pages=src.num_pages,
        dst_num_pages=dst.num_pages, page_slots=page_slots, src_page_stride=src.page_stride,
        dst_page_stride=dst.page_stride)

    assert torch.equal(dst.owner, expected)
    assert torch.equal(src.owner, src_before)
    untouched = sorted(set(range(dst.num_pages)) - set(dst_pages.tolist()))
    for before, after in zip(dst.layers_of(dst_before), dst.layers):
        assert torch.equal(after[untouched], before[untouched])


@pytest.fixture
def two_threads():
    """The cpu backend runs on torch's thread count; large copies below use two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_large_copies_stream_on_two_threads(backend, two_threads):
    """Past 1 MiB the host path streams its stores, past 2 x 4 MiB it splits over threads: the
    bytes must be the same as for the small in-cache path the property tests cover."""
    slots = 300 * 64  # 11 MB per side and layer: streaming, two chunks
    src = paged_side(1, 300, 64, page_first=False, seed=11)
    dst = paged_side(1, 300, 64, page_first=False, seed=12)
    gen = torch.Generator().manual_seed(13)
    src_ids, dst_ids = torch.randperm(slots, generator=gen), torch.randperm(slots, generator=gen)
    expected = dst.owner.clone()
    transfer_tokens_(dst.layers_of(expected), src.layers, src_ids, dst_ids)
    run(backend, transfer_cache_dsv4_mla, src, dst, src_ids, dst_ids, src_num_slots=slots, dst_num_slots=slots)
    assert torch.equal(dst.owner, expected)

    src_pages, dst_pages = torch.randperm(300, generator=gen), torch.randperm(300, generator=gen)
    expected = dst.owner.clone()
    transfer_pages_(dst.layers_of(expected), src.layers, src_pages, dst_pages)
    run(backend, transfer_pages_dsv4_mla, src, dst, src_pages, dst_pages, src_num_pages=300, dst_num_pages=300)
    assert torch.equal(dst.owner, expected)


@pytest.mark.sanitizer_case
def test_transfer_cache_dsv4_mla_copies_paged_token(backend):
    """A token at slot 70 (page 1, offset 6) lands in slot 65 (page 1, offset 1), all 584 bytes,
    and nothing else of the destination changes."""
    device = device_of(backend)
    src = torch.zeros(2, PAGE, dtype=torch.uint8)
    write_token(src, 70, token_pattern(41))
    src = src.to(device)
    dst = torch.zeros(2, PAGE, dtype=torch.uint8, device=device)

    transfer_cache_dsv4_mla(pointer_table([src]), pointer_table([dst]), torch.tensor([70], device=device),
                            torch.tensor([65], device=device), src_num_slots=128, dst_num_slots=128)
    src, dst = src.cpu(), dst.cpu()

    assert torch.equal(read_token(dst, 65), token_pattern(41))
    assert torch.equal(read_token(dst, 65), read_token(src, 70))
    expected = torch.zeros_like(dst)
    write_token(expected, 65, token_pattern(41))
    assert torch.equal(dst, expected)


def test_repeated_destination_with_same_source_is_allowed(backend):
    src = paged_side(2, 2, 64, page_first=False, seed=1)
    dst = paged_side(2, 2, 64, page_first=True, seed=2)
    src_ids, dst_ids = torch.tensor([3, 70, 3, 3]), torch.tensor([127, 0, 127, 64])
    expected = dst.owner.clone()
    transfer_tokens_(dst.layers_of(expected), src.layers, src_ids, dst_ids)
    run(backend, transfer_cache_dsv4_mla, src, dst, src_ids, dst_ids, src_num_slots=128, dst_num_slots=128,
        dst_page_stride=dst.page_stride)
    assert torch.equal(dst.owner, expected)


def test_empty_copy_is_a_no_op(backend):
    src = paged_side(3, 1, 64, page_first=False, seed=3)
    dst = paged_side(3, 1, 64, page_first=False, seed=4)
    before = dst.owner.clone()
    empty = torch.empty(0, dtype=torch.int64)
    run(backend, transfer_cache_dsv4_mla, src, dst, empty, empty)
    run(backend, transfer_pages_dsv4_mla, src, dst, empty, empty)
    assert torch.equal(dst.owner, before)


@pytest.mark.parametrize("dst_ids", [(3, 9, 3), (200, 2, 200)], ids=["dense ids", "sparse ids"])
def test_repeated_destination_conflicts_are_found_dense_or_sparse(backend, index_checks, dst_ids):
    """Dense destination ids take the bitmap pass, sparse ones (max id >= 64 N) go straight to sorting."""
    src = paged_side(1, 3, 64, page_first=False, seed=9)
    dst = paged_side(1, 4, 64, page_first=False, seed=10)
    before = dst.owner.clone()
    with pytest.raises(ValueError, match="`dst_indices` names destination"):
        run(backend, transfer_cache_dsv4_mla, src, dst, torch.tensor([0, 1, 2]), torch.tensor(dst_ids))
    assert torch.equal(dst.owner, before)
    run(backend, transfer_cache_dsv4_mla, src, dst, torch.tensor([0, 1, 0]), torch.tensor(dst_ids))
    assert torch.equal(read_token(dst.layers[0], dst_ids[0]), read_token(src.layers[0], 0))


# --- bad input: one clear exception naming the argument, and the destination unchanged --------------

# Every bad id sits after valid pairs, so an implementation that checks while copying would already
# have written the first tokens.
def _token_call(src_ids=(0, 5, 64), dst_ids=(1, 63, 127), **kw):
    return dict(src_ids=torch.tensor(src_ids), dst_ids=torch.tensor(dst_ids), kw=kw)


TOKEN_BAD = {
    "negative src": (_token_call(src_ids=(0, 5, -1)), IndexError, "src_indices"),
    "negative dst, no counts": (_token_call(dst_ids=(1, 63, -2), src_num_slots=None, dst_num_slots=None),
                                IndexError, "dst_indices"),
    "src beyond src_num_slots": (_token_call(src_ids=(0, 5, 128)), IndexError, "src_indices"),
    "dst beyond dst_num_slots": (_token_call(dst_ids=(1, 63, 128)), IndexError, "dst_indices"),
    "dst repeated, other source": (_token_call(dst_ids=(1, 63, 1)), ValueError, "dst_indices"),
    "int32 ids": (_token_call() | {"src_ids": torch.tensor([0, 5, 64], dtype=torch.int32)}, TypeError,
                  "src_indices"),
    "non-contiguous ids": (_token_call() | {"dst_ids": torch.tensor([1, 0, 63, 0, 127, 0])[::2]}, ValueError,
                           "dst_indices"),
    "lengths differ": (_token_call(dst_ids=(1, 63)), ValueError, "dst_indices"),
    "2-D ids": (_token_call() | {"src_ids": torch.tensor([[0, 5, 64]])}, ValueError, "src_indices"),
    "pointer tables differ": (_token_call(extra_dst_layer=True), ValueError, "dst_ptrs"),
    "int64 pointer table": (_token_call(int64_ptrs=True), TypeError, "src_ptrs"),
    "page_slots 48": (_token_call(page_slots=48), ValueError, "page_slots"),
    "src_page_stride below a page": (_token_call(src_page_stride=PAGE - 16), ValueError, "src_page_stride"),
    "negative dst_num_slots": (_token_call(dst_num_slots=-3), ValueError, "dst_num_slots"),
}


@pytest.mark.parametrize("case", TOKEN_BAD.values(), ids=TOKEN_BAD.keys())
def test_token_copy_rejects_bad_input(backend, index_checks, case):
    call, error, name = case
    kw = {"src_num_slots": 128, "dst_num_slots": 128, **call["kw"]}
    device = device_of(backend)
    src = paged_side(2, 2, 64, page_first=False, seed=5).to(device)
    dst = paged_side(2, 2, 64, page_first=False, seed=6).to(device)
    dst_layers = dst.layers + ([dst.layers[0]] if kw.pop("extra_dst_layer", False) else [])
    src_ptrs = pointer_table(src.layers)
    if kw.pop("int64_ptrs", False):
        src_ptrs = src_ptrs.to(torch.int64)
    src_ids, dst_ids = to_device(device, [call["src_ids"], call["dst_ids"]])  # a strided view stays strided
    before = dst.owner.clone()
    with pytest.raises(error, match=f"`{name}`"):
        transfer_cache_dsv4_mla(src_ptrs, pointer_table(dst_layers), src_ids, dst_ids, **kw)
    assert torch.equal(dst.owner, before)


PAGE_BAD = {
    "negative src page": ((0, -1), (0, 1), {}, IndexError, "src_pages"),
    "dst page beyond dst_num_pages": ((0, 1), (1, 2), {}, IndexError, "dst_pages"),
    "dst page repeated, other source": ((0, 1), (1, 1), {}, ValueError, "dst_pages"),
    "negative src_num_pages": ((0, 1), (0, 1), {"src_num_pages": -5}, ValueError, "src_num_pages"),
}


@pytest.mark.parametrize("case", PAGE_BAD.values(), ids=PAGE_BAD.keys())
def test_page_copy_rejects_bad_input(backend, index_checks, case):
    src_pages, dst_pages, extra, error, name = case
    src = paged_side(2, 2, 64, page_first=False, seed=7)
    dst = paged_side(2, 2, 64, page_first=True, seed=8)
    before = dst.owner.clone()
    with pytest.raises(error, match=f"`{name}`"):
        run(backend, transfer_pages_dsv4_mla, src, dst, torch.tensor(src_pages), torch.tensor(dst_pages),
            **({"src_num_pages": 2, "dst_num_pages": 2} | extra), dst_page_stride=dst.page_stride)
    assert torch.equal(dst.owner, before)


@pytest.mark.parametrize("table", ["src_ptrs", "dst_ptrs"])
def test_a_null_base_address_is_rejected_before_any_byte_moves(backend, index_checks, table):
    # A 0 in a pointer table used to crash the process (SIGSEGV).
    device = device_of(backend)
    src = paged_side(2, 2, 64, page_first=False, seed=21).to(device)
    dst = paged_side(2, 2, 64, page_first=False, seed=22).to(device)
    ptrs = {"src_ptrs": pointer_table(src.layers), "dst_ptrs": pointer_table(dst.layers)}
    ptrs[table][1] = 0
    before = dst.owner.clone()
    ids = torch.tensor([0, 5], device=device), torch.tensor([1, 6], device=device)
    with pytest.raises(ValueError, match=rf"`{table}`\[1\] is a null base address"):
        transfer_cache_dsv4_mla(ptrs["src_ptrs"], ptrs["dst_ptrs"], *ids, src_num_slots=128, dst_num_slots=128)
    with pytest.raises(ValueError, match=rf"`{table}`\[1\] is a null base address"):
        transfer_pages_dsv4_mla(ptrs["src_ptrs"], ptrs["dst_ptrs"], torch.tensor([0], device=device),
                                torch.tensor([1], device=device), src_num_pages=2, dst_num_pages=2)
    assert torch.equal(dst.owner, before)


@pytest.mark.parametrize("fn, src_ids, dst_ids, name", [
    (transfer_cache_dsv4_mla, [1, 2], [2, 3], "dst_indices"),
    (transfer_cache_dsv4_mla, [5, 9, 1], [7, 5, 8], "dst_indices"),
    (transfer_pages_dsv4_mla, [0, 1], [1, 2], "dst_pages"),
], ids=["token chain", "token read after write", "page chain"])
def test_one_buffer_as_source_and_destination_rejects_chained_ids(backend, index_checks, fn, src_ids, dst_ids, name):
    # 1 -> 2, 2 -> 3 in one buffer: slot 2 is read by one pair and written by another, so the result
    # depends on the order the kernel runs them in.
    side = paged_side(2, 4, 64, page_first=False, seed=23)
    before = side.owner.clone()
    with pytest.raises(ValueError, match=f"`{name}`.* is also a source"):
        run(backend, fn, side, side, torch.tensor(src_ids), torch.tensor(dst_ids))
    assert torch.equal(side.owner, before)


def test_one_buffer_as_source_and_destination_with_disjoint_ids_is_fine(backend):
    side = paged_side(2, 4, 64, page_first=False, seed=24)
    expected = side.owner.clone()
    src_ids, dst_ids = torch.tensor([1, 2, 9]), torch.tensor([5, 6, 9])  # 9 -> 9 copies a token onto itself
    transfer_tokens_(side.layers_of(expected), side.layers_of(side.owner.clone()), src_ids, dst_ids)
    run(backend, transfer_cache_dsv4_mla, side, side, src_ids, dst_ids)
    assert torch.equal(side.owner, expected)


ID_BAD = {k: TOKEN_BAD[k] for k in ("negative src", "negative dst, no counts", "src beyond src_num_slots",
                                     "dst beyond dst_num_slots", "dst repeated, other source")}


@pytest.mark.parametrize("case", ID_BAD.values(), ids=ID_BAD.keys())
def test_device_side_id_check_agrees(backend, case):
    """The torch checker the CUDA path runs before launch rejects the same ids with the same error."""
    call, error, name = case
    kw = {"src_num_slots": 128, "dst_num_slots": 128, **call["kw"]}
    device = device_of(backend)
    tables = torch.tensor([4096, 8192], dtype=torch.uint64, device=device), torch.tensor([12288, 16384],
                                                                                         dtype=torch.uint64,
                                                                                         device=device)
    with pytest.raises(error, match=f"`{name}`"):
        check_copy_on_device(*tables, call["src_ids"].to(device), call["dst_ids"].to(device), kw["src_num_slots"],
                             kw["dst_num_slots"], ("src_indices", "dst_indices"))


def test_device_side_check_accepts_valid_repeats_and_rejects_chains_in_one_buffer(backend):
    device = device_of(backend)
    table = torch.tensor([4096, 8192], dtype=torch.uint64, device=device)
    other = torch.tensor([12288, 16384], dtype=torch.uint64, device=device)
    src, dst = torch.tensor([4, 9, 4], device=device), torch.tensor([7, 1, 7], device=device)
    check_copy_on_device(table, other, src, dst, 16, 16, ("src", "dst"))
    with pytest.raises(ValueError, match="null base address"):
        check_copy_on_device(table, torch.zeros_like(other), src, dst, 16, 16, ("src", "dst"))
    check_copy_on_device(table, table, src, dst, 16, 16, ("src", "dst"))  # disjoint ids: fine in one buffer
    with pytest.raises(ValueError, match="`dst`.* is also a source"):
        check_copy_on_device(table, table, src, torch.tensor([7, 4, 7], device=device), 16, 16, ("src", "dst"))


@pytest.mark.no_backend("builds a GPU pointer table: the check runs before any device is touched")
def test_a_gpu_pointer_table_refuses_pageable_host_layers():
    pageable = torch.zeros(2, V4.page_bytes(64), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"`layers`\[0\] is pageable host memory.*pin it"):
        pointer_table([pageable], device="cuda")


# --- raw addresses: the table keeps its layers alive and bounds every id and stride by their bytes ----

@pytest.mark.parametrize("fn, counts, ids, name", [
    (transfer_cache_dsv4_mla, ("src_num_slots", "dst_num_slots"), ([0, 5], [1, 10**6]), "dst_indices"),
    (transfer_cache_dsv4_mla, ("src_num_slots", "dst_num_slots"), ([2**40, 5], [1, 2]), "src_indices"),
    (transfer_pages_dsv4_mla, ("src_num_pages", "dst_num_pages"), ([0, 1], [1, 2]), "dst_pages"),
], ids=["token dst beyond", "token src far beyond", "page dst beyond"])
def test_without_counts_the_ids_are_bounded_by_the_table_s_bytes(backend, index_checks, fn, counts, ids, name):
    # Without slot counts only negative ids were refused: an id past the buffer was copied (SIGSEGV).
    device = device_of(backend)
    src = paged_side(2, 2, 64, page_first=False, seed=31).to(device)
    dst = paged_side(2, 2, 64, page_first=True, seed=32).to(device)
    before = dst.owner.clone()
    with pytest.raises(IndexError, match=f"`{name}`"):
        fn(pointer_table(src.layers), pointer_table(dst.layers), torch.tensor(ids[0], device=device),
           torch.tensor(ids[1], device=device), dst_page_stride=dst.page_stride)
    assert torch.equal(dst.owner, before)
    # In range, the derived counts are the whole buffers: the last slot of each side copies.
    last = 2 * 64 - 1 if fn is transfer_cache_dsv4_mla else 1
    expected = dst.owner.clone()
    (transfer_tokens_ if fn is transfer_cache_dsv4_mla else transfer_pages_)(
        src.layers_of(src.owner.cpu()), dst.layers_of(expected.cpu()), torch.tensor([last]), torch.tensor([last]))
    fn(pointer_table(src.layers), pointer_table(dst.layers), torch.tensor([last], device=device),
       torch.tensor([last], device=device), dst_page_stride=dst.page_stride)
    assert torch.equal(dst.owner.cpu(), expected.cpu())


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("counts", [True, False], ids=["with counts", "derived counts"])
def test_a_page_stride_past_the_buffer_is_refused(backend, index_checks, side, counts):
    # A 10^9-byte page stride read (or wrote) far past the buffer: SIGSEGV.
    device = device_of(backend)
    src = paged_side(2, 2, 64, page_first=False, seed=33).to(device)
    dst = paged_side(2, 2, 64, page_first=False, seed=34).to(device)
    before = dst.owner.clone()
    kw = {f"{side}_page_stride": 10**9}
    if counts:
        kw |= {"src_num_slots": 128, "dst_num_slots": 128}
    error, match = (ValueError, f"`{side}_num_slots` = 128 with `{side}_page_stride` = 1000000000 reaches past") \
        if counts else (IndexError, f"`{side}_indices`")
    with pytest.raises(error, match=match):
        transfer_cache_dsv4_mla(pointer_table(src.layers), pointer_table(dst.layers),
                                torch.tensor([0, 70], device=device), torch.tensor([1, 71], device=device), **kw)
    assert torch.equal(dst.owner, before)


def test_a_table_not_from_pointer_table_needs_its_counts(backend, index_checks):
    device = device_of(backend)
    src = paged_side(2, 2, 64, page_first=False, seed=35).to(device)
    dst = paged_side(2, 2, 64, page_first=False, seed=36).to(device)
    raw = pointer_table(src.layers).clone()  # the same addresses, none of the records
    before = dst.owner.clone()
    with pytest.raises(ValueError, match="`src_num_slots` is required"):
        transfer_cache_dsv4_mla(raw, pointer_table(dst.layers), torch.tensor([0], device=device),
                                torch.tensor([1], device=device))
    assert torch.equal(dst.owner, before)


def test_a_pointer_table_keeps_its_layers_alive_and_a_slice_keeps_the_records(backend):
    # With the layers dropped, ASan saw the copy read freed memory, and it wrote into live tensors.
    device = device_of(backend)
    layers = [torch.zeros(2, PAGE, dtype=torch.uint8, device=device) for _ in range(3)]
    refs = [weakref.ref(t) for t in layers]
    table = pointer_table(layers)
    del layers
    gc.collect()
    assert all(r() is not None for r in refs)
    one = table_layers(table, slice(1, 2))
    with pytest.raises(IndexError, match="`dst_indices`"):  # its counts still come from layer 1's bytes
        transfer_cache_dsv4_mla(one, one, torch.tensor([0], device=device), torch.tensor([128], device=device))
    del table, one
    gc.collect()
    assert all(r() is None for r in refs)

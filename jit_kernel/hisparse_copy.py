"""Token and page copies between paged DSV4 KV buffers, all layers per call (kernels in
``csrc/hisparse_copy.cuh``, byte layout in :mod:`sparsekv.kv_layout`).

* :func:`transfer_cache_dsv4_mla` moves single tokens. A V4 token (584 B) is two byte ranges of
  its page, its 576-byte value record and its 8-byte scale record, so it cannot be moved as a row.
* :func:`transfer_pages_dsv4_mla` moves whole pages as opaque rows (37,440 B for 64 slots).

Both take per-layer base-address tables (uint64 ``[L]``) on the device the ids live on, so one call
covers every layer and any pair of memory spaces (device, pinned host, plain host). A table made by
:func:`pointer_table` (or :func:`table_layers` of one) holds references to its layers, so they live
as long as the table, and records the bytes reachable from each base address: a copy derives its
slot or page counts from them when none are given, and refuses counts and page strides that reach
past them. A table made any other way must come with its counts. Host-resident
ids are validated in full (in C++) before any byte moves. CUDA ids are validated with torch on the
device only with ``SPARSEKV_CHECK_INDICES=1`` (a host sync); otherwise the kernel skips an id outside
its table, so the copies neither synchronize nor allocate and can be captured in a CUDA graph. The
cpu backend runs on up to ``torch.get_num_threads()`` threads when a call moves more than a few MiB.

Both are the custom ops ``sparsekv::transfer_cache_dsv4_mla`` and ``sparsekv::transfer_pages_dsv4_mla``.
The bytes move through the addresses in ``dst_ptrs``, which torch cannot see: the ops declare
``dst_ptrs`` written, so a compiled graph keeps each copy in place among the ops that use the same
table, but it does not order a copy against ops on the destination buffers themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.checks import as_int, int_in, one_of
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.torch_op import (
    check_no_conflicting_destinations,
    first_true,
    index_checks_on_device,
    kernel_op,
)
from sparsekv.kv_layout import C4_PAGE_SLOTS, V4

#: Slots per C4 page for full-token page sizes 128, 256 and 512 (from :mod:`~sparsekv.kv_layout`).
PAGE_SLOTS = C4_PAGE_SLOTS
_PAGE_BYTES = {p: V4.page_bytes(p) for p in PAGE_SLOTS}


def _complete(*, page_slots: int) -> tuple:
    """Template arguments ``<Layout, PageSlots>``: the V4 token layout and a C4 page-slot count."""
    return V4.cpp_type, one_of(page_slots, "page_slots", PAGE_SLOTS, owner="hisparse_copy")


HISPARSE_COPY = register(
    KernelFamily(
        name="hisparse_copy",
        header="hisparse_copy.cuh",
        exports={
            "transfer_tokens": "sparsekv::hisparse_copy::transfer_tokens",
            "copy_pages": "sparsekv::hisparse_copy::copy_pages",
        },
        kernels=("sparsekv::hisparse_copy::TransferTokens", "sparsekv::hisparse_copy::CopyPages"),
        params=("page_slots",),
        complete=_complete,
        instances=tuple({"page_slots": p} for p in PAGE_SLOTS),
    )
)


def pointer_table(layers: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """The uint64 ``[L]`` table of per-layer base addresses that the copies take.

    Parameters
    ----------
    layers : sequence of torch.Tensor
        Per-layer page views (uint8 ``[pages, page_bytes]``); a page-first buffer's layers are
        ``buf[:, l]``, whose base addresses are ``l * page_bytes`` apart.
    device : torch.device or str, optional
        Where the table lives, which picks the backend (default: the first layer's device; pass the
        GPU for pinned host layers copied by the cuda backend).

    Returns
    -------
    torch.Tensor
        The table, holding references to ``layers`` (they are not freed while it lives) and the
        bytes of each layer's storage from its base address on, which the copies check against.

    Raises
    ------
    TypeError
        A layer that is not a tensor.
    ValueError
        No layer; for a GPU table, a host layer that is not pinned (the GPU would read an illegal
        address). The table is built once per pool, so this check stays off the copy path.
    """
    if not layers:
        raise ValueError("sparsekv: argument `layers` must name at least one layer")
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"sparsekv: argument `layers`[{i}] must be a tensor, got {type(t).__name__}")
    device = torch.device(device) if device is not None else layers[0].device
    if device.type == "cuda":
        for i, t in enumerate(layers):
            if t.device.type == "cpu" and not t.is_pinned():
                raise ValueError(f"sparsekv: argument `layers`[{i}] is pageable host memory, which the GPU cannot "
                                 f"read; pin it (tensor.pin_memory(), or allocate it with pin_memory=True)")
    addresses = [t.data_ptr() for t in layers]
    reachable = [t.untyped_storage().nbytes() - (t.data_ptr() - t.untyped_storage().data_ptr()) for t in layers]
    return _recorded(torch.tensor(addresses, dtype=torch.uint64, device=device), tuple(layers), tuple(reachable))


def table_layers(table: torch.Tensor, layers: slice) -> torch.Tensor:
    """``table[layers]``, keeping what :func:`pointer_table` recorded (a plain slice would drop it).

    Raises
    ------
    TypeError
        ``layers`` is not a slice.
    """
    if not isinstance(layers, slice):
        raise TypeError(f"sparsekv: argument `layers` must be a slice, got {type(layers).__name__}")
    held, reachable = getattr(table, _HELD, None), getattr(table, _REACHABLE, None)
    part = table[layers]
    return part if reachable is None else _recorded(part, held[layers], reachable[layers])


#: Attributes of a pointer_table: the layers it points at, the bytes reachable from each address, and
#: what every copy reads of them: ``(layers, fewest bytes)`` (None for no layer; the fewest bound the
#: pages of every layer).
_HELD, _REACHABLE, _BOUND = "_sparsekv_layers", "_sparsekv_reachable_bytes", "_sparsekv_reach_bound"


def _recorded(table: torch.Tensor, held: tuple, reachable: tuple) -> torch.Tensor:
    setattr(table, _HELD, held)
    setattr(table, _REACHABLE, reachable)
    setattr(table, _BOUND, (len(reachable), min(reachable, default=None)))
    return table


def _bounded_count(count: int, table: torch.Tensor, stride: object, page_bytes: int, unit: int,
                   names: tuple[str, str, str]) -> int:
    """The slot or page count of one side: ``count`` (-1: not given), derived from or checked against
    the bytes ``table`` recorded (``unit`` ids per page)."""
    bound = getattr(table, _BOUND, None)
    if bound is None or bound[0] != table.numel():
        if count < 0:
            count_name, ptrs_name, _ = names
            raise ValueError(f"sparsekv: argument `{count_name}` is required: `{ptrs_name}` is not a table from "
                             "pointer_table, so the copy cannot tell how far its buffers reach")
        return count
    least = bound[1]  # the pages a layer holds grow with its bytes: the fewest bound them all
    if type(stride) is not int or stride < page_bytes or least is None:  # noqa: E721 - the entry refuses it
        return count
    pages = (least - page_bytes) // stride + 1 if least >= page_bytes else 0
    if count < 0:
        return pages * unit
    if -(-count // unit) > pages:
        count_name, ptrs_name, stride_name = names
        layer = getattr(table, _REACHABLE).index(least)
        raise ValueError(f"sparsekv: argument `{count_name}` = {count} with `{stride_name}` = {stride} reaches past "
                         f"layer {layer} of `{ptrs_name}` ({least} bytes hold {pages * unit} at that stride)")
    return count


def _count(value: int | None, name: str) -> int:
    """A slot or page count for the C++ entry: -1 for "not given"."""
    return -1 if value is None else int_in(value, name, 0)


def _resolve(page_slots: int, src_page_stride: int | None, dst_page_stride: int | None) -> tuple[int, int, int]:
    """The page's bytes and the two page strides in bytes (default: one page), after checking ``page_slots``."""
    page_bytes = _PAGE_BYTES.get(page_slots) if type(page_slots) is int else None  # noqa: E721 - a bool is no int
    if page_bytes is None:
        page_bytes = _PAGE_BYTES.get(as_int(page_slots, "page_slots"))
        if page_bytes is None:
            raise ValueError(f"sparsekv: argument `page_slots` must be one of {PAGE_SLOTS}, got {page_slots!r}")
    return (page_bytes, page_bytes if src_page_stride is None else src_page_stride,
            page_bytes if dst_page_stride is None else dst_page_stride)


def check_copy_on_device(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, src_ids: torch.Tensor,
                         dst_ids: torch.Tensor, src_count: int | None, dst_count: int | None,
                         names: tuple[str, str]) -> None:
    """Validate tables and id pairs with torch on their own device (the CUDA path with
    ``SPARSEKV_CHECK_INDICES=1``, a host sync; the C++ entry checks host-readable ones the same way,
    rules 3-5 of ``csrc/include/sparsekv/ffi.h``).

    Every base address must be non-null; every id in ``[0, count)`` (``count`` None: only
    non-negative); a destination may repeat only with the same source; and when the two tables
    share a buffer in some layer, no id may be both a source and another pair's destination.

    Raises
    ------
    IndexError
        An id out of range (the message names the argument, position and value).
    ValueError
        A null base address, a destination named twice with different sources, or a chained id.
    """
    # Compared as int64 (same bits): torch's uint64 support is partial.
    src_ptrs, dst_ptrs = src_ptrs.view(torch.int64), dst_ptrs.view(torch.int64)
    for name, ptrs in (("src_ptrs", src_ptrs), ("dst_ptrs", dst_ptrs)):
        null = first_true(ptrs == 0)
        if null is not None:
            raise ValueError(f"sparsekv: argument `{name}`[{null[0]}] is a null base address")
    src_name, dst_name = names
    for name, ids, count in ((src_name, src_ids, src_count), (dst_name, dst_ids, dst_count)):
        bad = first_true(ids < 0 if count is None else (ids < 0) | (ids >= count))
        if bad is not None:
            (pos,) = bad
            bound = "non-negative" if count is None else f"in range [0, {count})"
            raise IndexError(f"sparsekv: argument `{name}`[{pos}] = {int(ids[pos])} is not {bound}")
    if src_ptrs.shape == dst_ptrs.shape and bool((src_ptrs == dst_ptrs).any()):
        chained = first_true((dst_ids != src_ids) & torch.isin(dst_ids, src_ids))
        if chained is not None:
            (pos,) = chained
            raise ValueError(f"sparsekv: argument `{dst_name}`[{pos}] = {int(dst_ids[pos])} is also a source in "
                             f"`{src_name}` while source and destination share a buffer (the result would depend "
                             f"on the copy order)")
    check_no_conflicting_destinations(dst_ids, src_ids, dst_name, src_name)


def _run(export: str, src_ptrs, dst_ptrs, src_ids, dst_ids, names, src_count, dst_count, count_names,
         page_slots, src_page_stride, dst_page_stride) -> None:
    page_bytes, src_stride, dst_stride = _resolve(page_slots, src_page_stride, dst_page_stride)
    unit = page_slots if export == "transfer_tokens" else 1
    src_n = _bounded_count(_count(src_count, count_names[0]), src_ptrs, src_stride,
                           page_bytes, unit, (count_names[0], "src_ptrs", "src_page_stride"))
    dst_n = _bounded_count(_count(dst_count, count_names[1]), dst_ptrs, dst_stride,
                           page_bytes, unit, (count_names[1], "dst_ptrs", "dst_page_stride"))
    if index_checks_on_device(src_ptrs):
        # Only the dtype must be right for the comparisons; shapes and devices are checked in C++.
        for name, ids in zip(names, (src_ids, dst_ids)):
            if ids.dtype != torch.int64:
                raise TypeError(f"sparsekv: argument `{name}` must have dtype int64, got {ids.dtype}")
        if src_ids.dim() == 1 and src_ids.shape == dst_ids.shape and src_ptrs.dtype == dst_ptrs.dtype == torch.uint64:
            # The device check bounds the ids by the same counts.
            check_copy_on_device(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n, dst_n, names)
    module = HISPARSE_COPY.module_for(src_ptrs, page_slots)
    getattr(module, export)(src_ptrs, dst_ptrs, src_ids, dst_ids, src_n, dst_n, src_stride, dst_stride,
                            torch.get_num_threads())


def transfer_cache_dsv4_mla(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    *,
    src_num_slots: int | None = None,
    dst_num_slots: int | None = None,
    page_slots: int = 64,
    src_page_stride: int | None = None,
    dst_page_stride: int | None = None,
) -> None:
    """Copy DSV4 tokens between paged buffers, every layer: slot ``src_indices[i]`` -> ``dst_indices[i]``.

    For every pair and every layer ``l``, the 576 value bytes and the 8 scale bytes of the source
    slot (page ``slot // page_slots`` of ``src_ptrs[l]``) overwrite those of the destination slot.
    Nothing else changes: not other slots, not page padding. ``N == 0`` is a no-op.

    Parameters
    ----------
    src_ptrs, dst_ptrs : torch.Tensor
        uint64 ``[L]``, contiguous: per-layer base addresses of uint8 ``[pages, page_bytes]`` buffers
        (``page_bytes = V4.page_bytes(page_slots)``, 37,440 for 64 slots). Their device picks the
        backend; the buffers may live in device, pinned host or (cpu backend) host memory.
    src_indices, dst_indices : torch.Tensor
        int64 ``[N]``, contiguous, on the pointer tables' device: token slots.
    src_num_slots, dst_num_slots : int, optional
        Slots of each side (pages * page_slots); ids at or beyond them are rejected. Default: as
        many as the recorded bytes of a :func:`pointer_table` hold at the page stride (required
        for a table made otherwise); given, they must fit those bytes.
    page_slots : {32, 64, 128}
        Slots per page (64: the C4 page of full-token page size 256).
    src_page_stride, dst_page_stride : int, optional
        Bytes from one page of a layer to the next (default ``page_bytes``; a page-first host
        buffer ``[pages, L, page_bytes]`` has ``L * page_bytes`` and ``ptrs[l] = base + l * page_bytes``).

    Raises
    ------
    TypeError
        An argument has the wrong dtype.
    ValueError
        Wrong shape, stride, device or length (including pointer tables of different lengths); a
        destination slot named twice with different sources; a slot count missing for a table
        not made by :func:`pointer_table`, or a count and page stride that reach past the bytes
        its layers hold.
    IndexError
        A negative id, or one at or beyond its slot count (CUDA ids: with ``SPARSEKV_CHECK_INDICES=1``;
        otherwise the kernel skips such a pair, and repeated or chained CUDA ids are the caller's duty).

    All checks happen before any byte moves.
    """
    _transfer_tokens(src_ptrs, dst_ptrs, src_indices, dst_indices, src_num_slots, dst_num_slots, page_slots,
                     src_page_stride, dst_page_stride)


@kernel_op("transfer_cache_dsv4_mla", mutates_args=("dst_ptrs",))
def _transfer_tokens(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, src_indices: torch.Tensor,
                     dst_indices: torch.Tensor, src_num_slots: int | None, dst_num_slots: int | None, page_slots: int,
                     src_page_stride: int | None, dst_page_stride: int | None) -> None:
    _run("transfer_tokens", src_ptrs, dst_ptrs, src_indices, dst_indices, ("src_indices", "dst_indices"),
         src_num_slots, dst_num_slots, ("src_num_slots", "dst_num_slots"), page_slots, src_page_stride,
         dst_page_stride)


def transfer_pages_dsv4_mla(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    *,
    src_num_pages: int | None = None,
    dst_num_pages: int | None = None,
    page_slots: int = 64,
    src_page_stride: int | None = None,
    dst_page_stride: int | None = None,
) -> None:
    """Copy whole DSV4 pages between paged buffers, every layer: page ``src_pages[i]`` -> ``dst_pages[i]``.

    Each page moves as one opaque row of ``page_bytes`` (padding included). Parameters, layouts and
    errors are those of :func:`transfer_cache_dsv4_mla`, with page ids in place of slot ids and
    page counts in place of slot counts.
    """
    _copy_pages(src_ptrs, dst_ptrs, src_pages, dst_pages, src_num_pages, dst_num_pages, page_slots, src_page_stride,
                dst_page_stride)


@kernel_op("transfer_pages_dsv4_mla", mutates_args=("dst_ptrs",))
def _copy_pages(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor,
                src_num_pages: int | None, dst_num_pages: int | None, page_slots: int, src_page_stride: int | None,
                dst_page_stride: int | None) -> None:
    _run("copy_pages", src_ptrs, dst_ptrs, src_pages, dst_pages, ("src_pages", "dst_pages"),
         src_num_pages, dst_num_pages, ("src_num_pages", "dst_num_pages"), page_slots, src_page_stride,
         dst_page_stride)

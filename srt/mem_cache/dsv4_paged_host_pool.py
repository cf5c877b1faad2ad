"""``DeepSeekV4PagedHostPool``: the host mirror of DSV4 paged KV buffers (the HiSparse C4 pool).

The host keeps the device's page-padded layout (:data:`sparsekv.kv_layout.V4`, 37,440
bytes per 64-slot page), so a whole page moves as one opaque row and only token-granular moves
need layout-aware code:

* whole aligned pages -> :func:`~sparsekv.jit_kernel.hisparse_copy.transfer_pages_dsv4_mla`;
* anything else -> :func:`~sparsekv.jit_kernel.hisparse_copy.transfer_cache_dsv4_mla` (a token
  is two byte ranges of its page), or ``ValueError`` with ``page_aligned_only=True``.

Host layouts: ``layer_first`` is ``[L, pages, page_bytes]`` (each layer one contiguous region,
what direct PD writes need); ``page_first`` is ``[pages, L, page_bytes]`` (a page of every layer
is contiguous). Either way layer ``l`` is a ``[pages, page_bytes]`` view and the kernels address it
through a base pointer and a page stride.

Example
-------
>>> device = [torch.zeros(5, 37440, dtype=torch.uint8) for _ in range(2)]   # any device pool's layers
>>> pool = DeepSeekV4PagedHostPool("c4", device, num_host_pages=8)
>>> host = pool.alloc_page(1).slots(64)                                      # HostSlots
>>> pool.backup_from_device_all_layer(host, DeviceSlots(torch.arange(64, 128)))  # a page row copy
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.checks import as_int, index_in, int_in
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.hisparse_copy import (
    pointer_table,
    table_layers,
    transfer_cache_dsv4_mla,
    transfer_pages_dsv4_mla,
)
from sparsekv.kv_layout import C4_PAGE_SLOTS, V4
from sparsekv.srt.mem_cache.allocators import PagedAllocator
from sparsekv.srt.mem_cache.base_swa_pool import BufInfos
from sparsekv.srt.mem_cache.hisparse_host_pool import HiSparseHostPoolMixin
from sparsekv.srt.mem_cache.host_kv_cache import HostKVCache
from sparsekv.srt.mem_cache.ids import DeviceSlots, HostSlots

LAYOUTS = ("layer_first", "page_first")


class DeepSeekV4PagedHostPool(HiSparseHostPoolMixin, HostKVCache):
    """Host pages mirroring per-layer DSV4 device page buffers.

    Parameters
    ----------
    pool_name : str
        For messages and logs.
    device_buffers : sequence of torch.Tensor
        The device pool's layers: uint8 ``[device_pages, V4.page_bytes(page_slots)]``, unit
        last stride, one shape and page stride for all, on one device (any device pool works).
    num_host_pages : int
        Host pages per layer.
    page_slots : {32, 64, 128}
        Token slots per page (64: the C4 page of full-token page size 256); formerly
        ``slot_page_size=``, which still works for one release (with a ``DeprecationWarning``).
    layout : {"layer_first", "page_first"}
        Host buffer layout (see the module docstring).
    pin_memory : bool, optional
        Default: pinned exactly when CUDA is available. ``False`` is refused for CUDA device
        buffers (the kernels read and write the host pages directly).
    page_aligned_only : bool
        Reject token-granular transfers (for pools whose tokens must only move as whole pages).
    device_allocator : PagedAllocator, optional
        The device pool's page allocator, whose page owners guard :meth:`load_to_device_per_layer`:
        a load into a device page of another request row is refused. A
        :class:`~sparsekv.srt.managers.hisparse_coordinator.HiSparseCoordinator` attaches its
        allocator's (:meth:`guard_device_writes`); default: unguarded.

    Raises
    ------
    TypeError, ValueError
        Device buffers of the wrong dtype, shape, stride or device mix; a bad size or layout;
        ``pin_memory=False`` with CUDA device buffers (nothing is allocated then).
    """

    @renamed_keywords(slot_page_size="page_slots")
    def __init__(self, pool_name: str, device_buffers: Sequence[torch.Tensor], num_host_pages: int, *,
                 page_slots: int = 64, layout: str = "layer_first", pin_memory: bool | None = None,
                 page_aligned_only: bool = False, device_allocator: PagedAllocator | None = None) -> None:
        page_slots, num_host_pages = as_int(page_slots, "page_slots"), int_in(num_host_pages, "num_host_pages", 1)
        if page_slots not in C4_PAGE_SLOTS:
            raise ValueError(f"sparsekv: argument `page_slots` must be one of {C4_PAGE_SLOTS}, got {page_slots!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"sparsekv: argument `layout` must be one of {LAYOUTS}, got {layout!r}")
        self.item_bytes = V4.page_bytes(page_slots)
        self._check_device_buffers(device_buffers)
        super().__init__(layer_num=len(device_buffers), page_slots=page_slots, num_pages=num_host_pages,
                         pin_memory=pin_memory, device=device_buffers[0].device)
        self.name = pool_name
        self.layout = layout
        self.page_aligned_only = page_aligned_only
        self.device_buffers = list(device_buffers)
        self.device = self.device_buffers[0].device
        self.device_num_pages = self.device_buffers[0].shape[0]
        self.device_page_stride = self.device_buffers[0].stride(0)
        shape = (self.layer_num, num_host_pages, self.item_bytes) if layout == "layer_first" else \
            (num_host_pages, self.layer_num, self.item_bytes)
        self.buffer = self._alloc_host(shape)
        self.kv_buffer = list(self.buffer.unbind(0)) if layout == "layer_first" else \
            [self.buffer[:, layer] for layer in range(self.layer_num)]
        self.host_page_stride = self.kv_buffer[0].stride(0)
        # The tables live where the kernels run: the device buffers' device.
        self.data_ptrs = pointer_table(self.kv_buffer, self.device)
        self.device_ptrs = pointer_table(self.device_buffers, self.device)
        self._init_page_allocator()
        self.device_allocator: PagedAllocator | None = None
        if device_allocator is not None:
            self.guard_device_writes(device_allocator)

    def guard_device_writes(self, device_allocator: PagedAllocator) -> None:
        """Guard loads into the device pool with the page owners of ``device_allocator`` (its pages
        must be this pool's device pages).

        Raises
        ------
        TypeError
            ``device_allocator`` is not a :class:`PagedAllocator`.
        ValueError
            Its page size or page count is not the device buffers', or another allocator guards already.
        """
        if not isinstance(device_allocator, PagedAllocator):
            raise TypeError(f"sparsekv: argument `device_allocator` must be a PagedAllocator, got "
                            f"{type(device_allocator).__name__}")
        if (device_allocator.page_size, device_allocator.num_pages) != (self.page_slots, self.device_num_pages):
            raise ValueError(f"sparsekv: argument `device_allocator` has {device_allocator.num_pages} pages of "
                             f"{device_allocator.page_size} slots; the device buffers have {self.device_num_pages} "
                             f"of {self.page_slots}")
        if self.device_allocator is not None and self.device_allocator is not device_allocator:
            raise ValueError(f"sparsekv: pool {self.name!r} already guards its device writes with another allocator")
        self.device_allocator = device_allocator

    def _check_device_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        if len(buffers) == 0:
            raise ValueError("sparsekv: argument `device_buffers` must hold at least one layer")
        first = buffers[0]
        for layer, b in enumerate(buffers):
            if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8:
                raise TypeError(f"sparsekv: argument `device_buffers`[{layer}] must be a uint8 tensor")
            if b.dim() != 2 or b.shape[1] != self.item_bytes or b.stride(1) != 1:
                raise ValueError(f"sparsekv: argument `device_buffers`[{layer}] must be [pages, {self.item_bytes}] "
                                 f"with a unit last stride, got shape {list(b.shape)} strides {list(b.stride())}")
            if b.shape != first.shape or b.stride() != first.stride() or b.device != first.device:
                raise ValueError(f"sparsekv: argument `device_buffers`[{layer}] must match layer 0's shape, strides "
                                 "and device")

    def get_size_per_token(self) -> int:
        """Host bytes per slot over all layers, page padding included (585 per layer for 64-slot V4 pages)."""
        return self.item_bytes * self.layer_num // self.page_slots

    def get_contiguous_buf_infos(self) -> BufInfos:
        """Per-layer host regions (pointer, byte length, item length = one page row) for direct PD writes.

        Raises
        ------
        ValueError
            The ``page_first`` layout, whose layers are not contiguous regions.
        """
        if self.layout != "layer_first":
            raise ValueError(f"sparsekv: pool {self.name!r} is page_first; direct per-layer writes need layer_first")
        return BufInfos.of(self.kv_buffer, [self.item_bytes] * self.layer_num)

    def backup_from_device_all_layer(self, host_indices: HostSlots, device_indices: DeviceSlots) -> None:
        """Copy device slots to host slots, every layer (``device_indices[i]`` -> ``host_indices[i]``).

        Whole aligned pages on both sides (runs of ``page_slots`` slots starting at a page
        boundary, in order) move as page rows; anything else moves token by token.

        Raises
        ------
        TypeError
            ``host_indices`` is not :class:`HostSlots`, or ``device_indices`` not :class:`DeviceSlots`.
        ValueError
            Different lengths; a token-granular request with ``page_aligned_only``; conflicting
            destinations.
        IndexError
            A slot outside its pool (a negative one included).
        """
        if self._has_transfer_indices(host_indices, device_indices):
            self._copy(host_indices, device_indices, to_host=True, layers=slice(None))

    def load_to_device_per_layer(self, host_indices: HostSlots, device_indices: DeviceSlots, layer_id: int, *,
                                 owner: int | None = None) -> None:
        """Copy host slots to device slots of layer ``layer_id`` (``host_indices[i]`` -> ``device_indices[i]``),
        on behalf of request row ``owner``.

        Paths and errors as :meth:`backup_from_device_all_layer`, plus ``IndexError`` for a bad layer
        (a negative one included), ``TypeError`` for a ``layer_id`` or ``owner`` that is not an int,
        and, when a device allocator guards the pool (:meth:`guard_device_writes`),
        :class:`~sparsekv.srt.errors.RequestStateError` for a device slot in a page of a request
        row other than ``owner`` (any row, without ``owner``); nothing is written then.
        """
        layer_id = index_in(layer_id, "layer_id", self.layer_num)
        owner = None if owner is None else int_in(owner, "owner", 0)
        if self._has_transfer_indices(host_indices, device_indices):
            if self.device_allocator is not None:  # admission's load, not the decode path: reading ids is fine
                pages = self.device_allocator.pages_of(device_indices.tensor)
                self.device_allocator.check_owner(pages, owner, "written", name="device_indices")
            self._copy(host_indices, device_indices, to_host=False, layers=slice(layer_id, layer_id + 1))

    def _copy(self, host: HostSlots, device: DeviceSlots, *, to_host: bool, layers: slice) -> None:
        p = self.page_slots
        host_side = (table_layers(self.data_ptrs, layers), host, self.num_pages, self.host_page_stride)
        device_side = (table_layers(self.device_ptrs, layers), device, self.device_num_pages, self.device_page_stride)
        (src_ptrs, src, src_pages, src_stride), (dst_ptrs, dst, dst_pages, dst_stride) = \
            (device_side, host_side) if to_host else (host_side, device_side)
        # The side on the CPU is read first; device ids (a host sync) are read only when it is whole pages,
        # as in a staging backup of a prefill, never for a decode step's single entries.
        first, second = (src, dst) if src.tensor.device.type == "cpu" else (dst, src)
        first_whole = first.whole_pages(p)
        second_whole = second.whole_pages(p) if first_whole is not None else None
        src_whole, dst_whole = (first_whole, second_whole) if first is src else (second_whole, first_whole)
        if src_whole is not None and dst_whole is not None:
            transfer_pages_dsv4_mla(src_ptrs, dst_ptrs, self._ids(src_whole), self._ids(dst_whole),
                                    src_num_pages=src_pages, dst_num_pages=dst_pages, page_slots=p,
                                    src_page_stride=src_stride, dst_page_stride=dst_stride)
            return
        if self.page_aligned_only:
            raise ValueError(f"sparsekv: pool {self.name!r} is page_aligned_only, but {len(host)} slots are not whole "
                             f"aligned pages of {p} slots on both sides")
        transfer_cache_dsv4_mla(src_ptrs, dst_ptrs, self._ids(src), self._ids(dst), src_num_slots=src_pages * p,
                                dst_num_slots=dst_pages * p, page_slots=p, src_page_stride=src_stride,
                                dst_page_stride=dst_stride)

    def _ids(self, ids) -> torch.Tensor:
        """int64 ids on the kernels' device (an explicit conversion; no layout change)."""
        return ids.tensor.to(self.device, torch.int64)

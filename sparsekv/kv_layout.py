"""Byte layouts of the DSV4 KV caches: the Python mirror of ``csrc/include/sparsekv/kv_layout.h``.

A token is a value record and a scale record. A page of P slots stores them block-split, P value
records, then P scale records, then padding up to a multiple of the layout's page alignment::

    [value 0 .. value P-1][scale 0 .. scale P-1][pad]

so one token is two byte ranges, never one (which is why moving single tokens needs a dedicated
kernel, :mod:`sparsekv.jit_kernel.hisparse_copy`).

======================  ============================  ===========================  =====  ==========
layout                  value record                  scale record                 bytes  page align
======================  ============================  ===========================  =====  ==========
``V4`` (fp8_ds_mla)     448 e4m3 nope + 64 bf16 rope  7 UE8M0 + 1 pad              584    576
``V41``                 512 e4m3                      16 UE8M0 (one per 32)        528    512
``V41_FP4``             256 packed e2m1               32 e4m3 (one per 16)         288    256 *
``INDEXER_FP8``         128 e4m3                      1 fp32                       132    1
``INDEXER_FP4``         64 packed e2m1                4 UE8M0                      68     1 *
======================  ============================  ===========================  =====  ==========

``*`` No published page alignment exists for these two; we chose one: ``V41_FP4`` follows the
other main-KV layouts (a page is a whole number of value records, as FlashMLA's 576 for V4 and 512
for V41), ``INDEXER_FP4`` follows the FP8 indexer (no padding; at any power-of-two page of 4 or
more slots a page is a multiple of 16 bytes anyway). A V4 C4 page of 64 slots is 37,440 bytes.

This module is torch-free at import; only the view helpers touch tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparsekv.checks import as_int, int_in, one_of

if TYPE_CHECKING:
    import torch

__all__ = ["C4_PAGE_SLOTS", "C4_RATIO", "DSV4_PAGE_SIZES", "INDEXER_FP4", "INDEXER_FP8", "INDEXER_HEAD_DIM",
           "INDEXER_LAYOUTS", "LAYOUTS", "MAX_PAGE_SLOTS", "V4", "V41", "V41_FP4", "KVLayout", "c4_page_slots",
           "resident_index_bytes"]


@dataclass(frozen=True)
class KVLayout:
    """One token layout: value and scale record sizes and the page alignment.

    Attributes
    ----------
    name : str
        Layout name (the key in :data:`LAYOUTS`).
    cpp_name : str
        The matching struct in ``csrc/include/sparsekv/kv_layout.h`` (namespace ``sparsekv::kv_layout``).
    value_bytes : int
        Bytes of a token's value record.
    scale_bytes : int
        Bytes of a token's scale record (padding byte included).
    page_align : int
        A page's byte size is rounded up to a multiple of this.
    """

    name: str
    cpp_name: str
    value_bytes: int
    scale_bytes: int
    page_align: int

    @property
    def bytes_per_token(self) -> int:
        """Value plus scale bytes of one token (584 for ``V4``)."""
        return self.value_bytes + self.scale_bytes

    @property
    def cpp_type(self) -> str:
        """The fully qualified C++ struct, usable as a kernel template argument."""
        return f"sparsekv::kv_layout::{self.cpp_name}"

    def page_bytes(self, page_slots: int) -> int:
        """Bytes of one page of ``page_slots`` tokens, padding included.

        Raises
        ------
        TypeError
            ``page_slots`` is not an int (a float, a bool).
        ValueError
            ``page_slots`` is outside ``[1, MAX_PAGE_SLOTS]``.
        """
        page_slots = int_in(page_slots, "page_slots", 1, MAX_PAGE_SLOTS)
        tokens = self.bytes_per_token * page_slots
        return -(-tokens // self.page_align) * self.page_align

    def value_offset(self, slot_in_page: int) -> int:
        """Byte offset of slot ``slot_in_page``'s value record inside its page."""
        return slot_in_page * self.value_bytes

    def scale_offset(self, slot_in_page: int, page_slots: int) -> int:
        """Byte offset of slot ``slot_in_page``'s scale record inside a page of ``page_slots``."""
        return page_slots * self.value_bytes + slot_in_page * self.scale_bytes

    def padding_offset(self, page_slots: int) -> int:
        """Byte offset of a page's padding (equal to :meth:`page_bytes` when there is none)."""
        return page_slots * self.bytes_per_token

    def value_view(self, pages: torch.Tensor, page_slots: int) -> torch.Tensor:
        """Zero-copy view of the value records of a page buffer.

        Parameters
        ----------
        pages : torch.Tensor
            uint8 ``[num_pages, page_bytes(page_slots)]``, unit last stride, any page stride.
        page_slots : int
            Slots per page.

        Returns
        -------
        torch.Tensor
            uint8 ``[num_pages, page_slots, value_bytes]`` sharing ``pages``' storage.

        Raises
        ------
        TypeError
            ``pages`` is not uint8.
        ValueError
            ``pages`` has the wrong shape or a non-unit last stride.
        """
        self._check_pages(pages, page_slots)
        return pages.as_strided((pages.shape[0], page_slots, self.value_bytes),
                                (pages.stride(0), self.value_bytes, 1), pages.storage_offset())

    def scale_view(self, pages: torch.Tensor, page_slots: int) -> torch.Tensor:
        """Zero-copy view of the scale records: uint8 ``[num_pages, page_slots, scale_bytes]``.

        Same parameters and errors as :meth:`value_view`.
        """
        self._check_pages(pages, page_slots)
        return pages.as_strided((pages.shape[0], page_slots, self.scale_bytes),
                                (pages.stride(0), self.scale_bytes, 1),
                                pages.storage_offset() + self.scale_offset(0, page_slots))

    def _check_pages(self, pages: torch.Tensor, page_slots: int) -> None:
        import torch

        want = self.page_bytes(page_slots)
        if pages.dtype != torch.uint8:
            raise TypeError(f"sparsekv: argument `pages` must have dtype uint8, got {pages.dtype}")
        if pages.dim() != 2 or pages.shape[1] != want:
            raise ValueError(f"sparsekv: argument `pages` must be [num_pages, {want}] ({self.name}, "
                             f"{page_slots} slots per page), got shape {list(pages.shape)}")
        if pages.stride(1) != 1:
            raise ValueError("sparsekv: argument `pages` must have a unit stride in its last dim")


#: The largest page any kernel takes, in slots (``kv_layout::kMaxPageSlots``): every size product
#: of a page then fits int64 with room to spare.
MAX_PAGE_SLOTS = 2**20

V4 = KVLayout("V4", "V4", value_bytes=576, scale_bytes=8, page_align=576)
V41 = KVLayout("V41", "V41", value_bytes=512, scale_bytes=16, page_align=512)
V41_FP4 = KVLayout("V41_FP4", "V41Fp4", value_bytes=256, scale_bytes=32, page_align=256)
INDEXER_FP8 = KVLayout("INDEXER_FP8", "IndexerFp8", value_bytes=128, scale_bytes=4, page_align=1)
INDEXER_FP4 = KVLayout("INDEXER_FP4", "IndexerFp4", value_bytes=64, scale_bytes=4, page_align=1)

LAYOUTS: dict[str, KVLayout] = {layout.name: layout for layout in (V4, V41, V41_FP4, INDEXER_FP8, INDEXER_FP4)}
#: The indexer K cache layouts by the name the indexer and its quantizers take (``layout="fp8"``).
INDEXER_LAYOUTS: dict[str, KVLayout] = {"fp8": INDEXER_FP8, "fp4": INDEXER_FP4}
#: Width of an indexer key (and query head): what INDEXER_FP8 / INDEXER_FP4 store per token.
INDEXER_HEAD_DIM = 128

#: Full-token page sizes a DSV4 deployment may use (tokens per page of the uncompressed KV).
DSV4_PAGE_SIZES = (128, 256, 512)
#: Compression ratio of the C4 (CSA) cache: one compressed slot per 4 tokens.
C4_RATIO = 4
#: Token slots per C4 page, one per full-token page size: the single source of every C4 page-slot
#: count (pools, allocators, the coordinator and the kernels' ``page_slots`` parameter).
C4_PAGE_SLOTS = tuple(p // C4_RATIO for p in DSV4_PAGE_SIZES)


def c4_page_slots(page_size: int) -> int:
    """Slots of one C4 page for a full-token ``page_size`` (128 -> 32, 256 -> 64, 512 -> 128).

    Raises
    ------
    TypeError
        ``page_size`` is not an int (``256.0`` too).
    ValueError
        ``page_size`` is not one of :data:`DSV4_PAGE_SIZES`.
    """
    return one_of(as_int(page_size, "page_size"), "page_size", DSV4_PAGE_SIZES) // C4_RATIO


def resident_index_bytes(max_len: int, hot_buffer_size: int) -> int:
    """Device bytes of one request's HiSparse resident-token index in one C4 layer (the indexed
    swap-in, ``sparsekv.jit_kernel.hisparse_index``): ``2 * max_len + 8 * H + 8``.

    An int16 slot per C4 position (``max_len`` of them), an int16 LRU queue of ``2 H`` entries, an
    int32 queue position per hot slot plus head and tail. The tables never grow: this is the bound.
    """
    return 2 * max_len + 2 * (2 * hot_buffer_size) + 4 * (hot_buffer_size + 2)

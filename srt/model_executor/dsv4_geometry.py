"""Byte geometry of the DSV4 KV pools, shared by the pool configurator and the device pool.

Pure integer arithmetic, no torch: the planner (``sparsekv plan-memory``) and
``DeepSeekV4TokenToKVPool`` price and allocate from these same functions, so a pool can never
allocate a layout that the configurator priced differently.

Layouts (the table of ``csrc/include/sparsekv/kv_layout.h`` and its Python mirror ``kv_layout``):

* Main KV (SWA, C4 and C128 alike), FlashMLA "fp8_ds_mla" V4: 584 B per token = 448 e4m3 nope
  + 64 bf16 rope (576 B of value) + 7 UE8M0 scales + 1 pad byte. A page of P tokens stores the P
  values, then the P scale records, padded to a multiple of 576 B (FlashMLA's page alignment):
  64 tokens -> 37,440 B, 256 -> 149,760 B, 2 -> 1,728 B.
* C4 indexer keys: ``index_head_dim`` e4m3 + one fp32 scale per 128 dims (132 B for dim 128),
  page = ``page_size // 4`` entries, no padding.
* Compressor state rings, fp32 (or bf16) rows: C4 attention ``4 * head_dim`` values (kv and score,
  each doubled by the overlapping window), C4 indexer ``4 * index_head_dim``, C128
  ``2 * head_dim``.
"""

from __future__ import annotations

from sparsekv.kv_layout import V4

# FlashMLA V4 token layout, from the one layout table the kernels also use (torch-free).
KV_LAYOUT = V4
KV_BYTES_PER_TOKEN = V4.bytes_per_token

# One fp32 scale per 128 indexer dims.
INDEXER_QUANT_BLOCK = 128
INDEXER_SCALE_BYTES = 4

COMPRESS_RATIOS = (4, 128)


def ceil_div(x: int, y: int) -> int:
    """Return ``ceil(x / y)`` for non-negative ``x`` and positive ``y``."""
    return (x + y - 1) // y


def ceil_align(x: int, y: int) -> int:
    """Return the smallest multiple of ``y`` that is ``>= x``."""
    return ceil_div(x, y) * y


def kv_page_bytes(page_slots: int) -> int:
    """Bytes of one FlashMLA V4 page holding ``page_slots`` entries (values, then scale
    records, padded to a multiple of 576 B)."""
    return V4.page_bytes(page_slots)


def kv_page_slots(page_size: int, compress_ratio: int) -> int:
    """Entries per KV page of a pool (the kernels' ``page_slots``): ``page_size`` for SWA (ratio 0),
    else ``page_size // ratio``.

    A full-token page of ``page_size`` positions produces ``page_size // ratio`` compressed
    entries, so one page id addresses the same positions in every pool.
    """
    return page_size // compress_ratio if compress_ratio else page_size


def paged_kv_bytes_per_token(page_size: int, compress_ratio: int = 0) -> float:
    """Page-padded bytes per entry of the SWA (ratio 0) or a compressed KV pool."""
    slots = kv_page_slots(page_size, compress_ratio)
    return kv_page_bytes(slots) / slots


def indexer_bytes_per_entry(index_head_dim: int) -> int:
    """Bytes of one FP8 indexer key with its fp32 scales (132 for dim 128)."""
    return index_head_dim + index_head_dim // INDEXER_QUANT_BLOCK * INDEXER_SCALE_BYTES


def compress_state_ring_size(compress_ratio: int, speculative: bool) -> int:
    """Ring slots of one compressor state (C4: 8, C128: 128; doubled under speculative decode)."""
    base = {4: 8, 128: 128}[compress_ratio]
    return 2 * base if speculative else base


def compress_state_write_pad(compress_ratio: int, ring_size: int) -> int:
    """Draft tokens a ring can keep resident beyond the compressor's window.

    The window is 8 for C4 (overlapping windows of 8) and 128 for C128.
    """
    window = compress_ratio * (2 if compress_ratio == 4 else 1)
    return ring_size - window + 2 if ring_size > window else 0


def compress_state_row_values(compress_ratio: int, head_dim: int) -> int:
    """Values of one attention compressor state row (kv and score, doubled for overlapping C4)."""
    overlap = 2 if compress_ratio == 4 else 1
    return 2 * overlap * head_dim


def indexer_state_row_values(index_head_dim: int) -> int:
    """Values of one C4 indexer compressor state row."""
    return 2 * 2 * index_head_dim


def compress_state_rows(num_slots: int, ring_size: int, compress_ratio: int) -> int:
    """Rows a compressor state pool allocates for ``num_slots`` addressable ring slots.

    One ring more for the reserved slot 0 (page 0 / request 0 is padding) and one scratch row
    that absorbs writes of padded tokens, rounded up to the compress ratio.
    """
    return ceil_align(num_slots + ring_size + 1, compress_ratio)

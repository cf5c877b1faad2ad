"""Torch references for ``hisparse_copy``: one token's bytes in a page, the token copy, the page copy.

A paged layer is a uint8 ``[pages, page_bytes]`` tensor with a unit last stride and any page
stride (so ``buf[:, l]`` of a page-first ``[pages, L, page_bytes]`` buffer is a layer too).
Addressing goes through the zero-copy value/scale views of :mod:`sparsekv.kv_layout`,
never through the kernel's own offset arithmetic. The copies work in place on the given
destination layers (clone first to keep the original); the benchmark times them as the torch
baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sparsekv.kv_layout import V4, KVLayout


def _split(slots: torch.Tensor, page_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.div(slots, page_slots, rounding_mode="floor"), slots % page_slots


def write_token(pages: torch.Tensor, slot: int, token: torch.Tensor, *, page_slots: int = 64,
                layout: KVLayout = V4) -> None:
    """Write one token's bytes (value record then scale record, ``layout.bytes_per_token`` uint8) to ``slot``."""
    page, off = divmod(slot, page_slots)
    layout.value_view(pages, page_slots)[page, off] = token[: layout.value_bytes]
    layout.scale_view(pages, page_slots)[page, off] = token[layout.value_bytes :]


def read_token(pages: torch.Tensor, slot: int, *, page_slots: int = 64, layout: KVLayout = V4) -> torch.Tensor:
    """The bytes of the token in ``slot``: value record then scale record, a new uint8 tensor."""
    page, off = divmod(slot, page_slots)
    return torch.cat([layout.value_view(pages, page_slots)[page, off], layout.scale_view(pages, page_slots)[page, off]])


def token_pattern(seed: int, layout: KVLayout = V4) -> torch.Tensor:
    """A recognisable token: value bytes ``(k + seed) % 256``, scale bytes ``(k + seed + 17) % 256``."""
    value = (torch.arange(layout.value_bytes) + seed) % 256
    scale = (torch.arange(layout.scale_bytes) + seed + 17) % 256
    return torch.cat([value, scale]).to(torch.uint8)


def transfer_tokens_(dst_layers: Sequence[torch.Tensor], src_layers: Sequence[torch.Tensor],
                     src_indices: torch.Tensor, dst_indices: torch.Tensor, *, page_slots: int = 64,
                     layout: KVLayout = V4) -> None:
    """In place: for every layer, the value and scale records of slot ``src_indices[i]`` -> ``dst_indices[i]``.

    Torch advanced indexing on the strided views; a repeated destination must repeat its source
    (the order of writes is then irrelevant).
    """
    sp, so = _split(src_indices, page_slots)
    dp, do = _split(dst_indices, page_slots)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        layout.value_view(dst, page_slots)[dp, do] = layout.value_view(src, page_slots)[sp, so]
        layout.scale_view(dst, page_slots)[dp, do] = layout.scale_view(src, page_slots)[sp, so]


def transfer_pages_(dst_layers: Sequence[torch.Tensor], src_layers: Sequence[torch.Tensor],
                    src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """In place: for every layer, page row ``src_pages[i]`` -> ``dst_pages[i]`` (padding included)."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_pages] = src[src_pages]

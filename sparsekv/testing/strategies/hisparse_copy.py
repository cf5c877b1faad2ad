"""Hypothesis strategies for ``hisparse_copy``: multi-layer paged buffers (layer-first or page-first)
and id sets that stress the paged addressing: first and last slot of a page, neighbours across a
page boundary, repeated sources, a destination repeated with its own source, N == 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from sparsekv.kv_layout import C4_PAGE_SLOTS, V4

PAGE_SLOTS = C4_PAGE_SLOTS


@dataclass
class PagedSide:
    """One side of a copy: a buffer holding ``num_layers`` paged layers.

    Layer-first: ``owner`` is ``[L, pages, page_bytes]`` and layer l is ``owner[l]``. Page-first:
    ``owner`` is ``[pages, L, page_bytes]`` and layer l is ``owner[:, l]`` (page stride
    ``L * page_bytes``).
    """

    owner: torch.Tensor
    num_layers: int
    num_pages: int
    page_first: bool

    def layers_of(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer ``[pages, page_bytes]`` views of ``buf``, a tensor shaped like ``owner``."""
        return [buf[:, layer] for layer in range(self.num_layers)] if self.page_first else list(buf.unbind(0))

    def to(self, device: torch.device | str) -> PagedSide:
        """The same side with its buffer copied to ``device``."""
        return PagedSide(self.owner.to(device), self.num_layers, self.num_pages, self.page_first)

    @property
    def layers(self) -> list[torch.Tensor]:
        return self.layers_of(self.owner)

    @property
    def page_stride(self) -> int:
        return self.layers[0].stride(0)


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic random uint8 bytes."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def paged_side(num_layers: int, num_pages: int, page_slots: int, *, page_first: bool, seed: int) -> PagedSide:
    """Random-filled paged buffers of ``num_layers`` layers, padding included."""
    page_bytes = V4.page_bytes(page_slots)
    shape = (num_pages, num_layers, page_bytes) if page_first else (num_layers, num_pages, page_bytes)
    return PagedSide(random_bytes(shape, seed), num_layers, num_pages, page_first)


def _edge_slots(num_pages: int, page_slots: int) -> list[int]:
    """First and last slot of every page (so also both neighbours of each page boundary)."""
    return sorted({s for p in range(num_pages) for s in (p * page_slots, p * page_slots + page_slots - 1)})


@st.composite
def slot_pairs(draw, src_slots: int, dst_slots: int, page_slots: int, max_n: int = 24):
    """``(src_ids, dst_ids)`` int64: distinct destinations biased to page edges, sources with repeats,
    sometimes a destination repeated with the same source."""
    dst_edges = _edge_slots(dst_slots // page_slots, page_slots)
    src_edges = _edge_slots(src_slots // page_slots, page_slots)
    pool = draw(st.lists(st.one_of(st.sampled_from(dst_edges), st.integers(0, dst_slots - 1)), max_size=max_n,
                         unique=True))
    src = draw(st.lists(st.one_of(st.sampled_from(src_edges), st.integers(0, src_slots - 1)), min_size=len(pool),
                        max_size=len(pool)))
    if pool and draw(st.booleans()):
        k = draw(st.integers(0, len(pool) - 1))
        pool.append(pool[k])
        src.append(src[k])
    return torch.tensor(src, dtype=torch.int64), torch.tensor(pool, dtype=torch.int64)


def _two_sides(draw, page_slots: int, max_pages: int):
    """A source and a destination side of 1-3 layers (the same count), 1-``max_pages`` pages each."""
    layers = draw(st.integers(1, 3))
    return tuple(paged_side(layers, draw(st.integers(1, max_pages)), page_slots, page_first=draw(st.booleans()),
                            seed=draw(st.integers(0, 2**31 - 1))) for _ in range(2))


@st.composite
def token_copy_case(draw, page_slots: int):
    """``(src_side, dst_side, src_ids, dst_ids)`` for a token copy over 1-3 layers and 1-3 pages."""
    src, dst = _two_sides(draw, page_slots, 3)
    src_ids, dst_ids = draw(slot_pairs(src.num_pages * page_slots, dst.num_pages * page_slots, page_slots))
    return src, dst, src_ids, dst_ids


@st.composite
def page_copy_case(draw, page_slots: int):
    """``(src_side, dst_side, src_pages, dst_pages)``: distinct destination pages, repeated sources allowed."""
    src, dst = _two_sides(draw, page_slots, 4)
    dst_pages = draw(st.permutations(range(dst.num_pages)))[: draw(st.integers(0, dst.num_pages))]
    src_pages = draw(st.lists(st.integers(0, src.num_pages - 1), min_size=len(dst_pages), max_size=len(dst_pages)))
    return src, dst, torch.tensor(src_pages, dtype=torch.int64), torch.tensor(dst_pages, dtype=torch.int64)

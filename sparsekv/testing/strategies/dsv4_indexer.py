"""Hypothesis strategies for the DSV4 lightning indexer: paged FP8 / FP4 indexer K caches written
by torch encoders, shuffled page tables (unused entries -1), queries, head weights and positions
around the visibility and page boundaries."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from sparsekv.kv_layout import INDEXER_HEAD_DIM, INDEXER_LAYOUTS
from sparsekv.testing.reference.dsv4_indexer import visible_entry_count
from sparsekv.testing.reference.dsv4_quant import quantize_indexer_keys

PAGE_SLOTS = (1, 4, 16, 64)


def write_indexer_keys(keys: torch.Tensor, k_cache: torch.Tensor, slots: torch.Tensor, page_slots: int,
                       layout: str) -> None:
    """In place: float32 ``[N, 128]`` keys into ``slots``, the bytes of the reference indexer-key
    quantizer (:func:`sparsekv.testing.reference.dsv4_quant.quantize_indexer_keys`)."""
    quantize_indexer_keys(keys, k_cache, slots, page_slots, layout)


@dataclass
class IndexerCase:
    """The arguments of one indexer call (``layout`` selects the cache format)."""

    q: torch.Tensor
    weights: torch.Tensor
    k_cache: torch.Tensor
    page_table: torch.Tensor
    positions: torch.Tensor
    page_slots: int
    layout: str

    def to(self, device: torch.device) -> IndexerCase:
        """The same case with every tensor on ``device``."""
        return IndexerCase(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in (
            self.q, self.weights, self.k_cache, self.page_table, self.positions, self.page_slots, self.layout)))


@st.composite
def indexer_case(draw, *, layout: str | None = None, max_heads: int = 8, max_pages: int = 6) -> IndexerCase:
    """A small :class:`IndexerCase`: every cache page holds random keys; row ``b`` of the page
    table is a random choice of distinct pages, -1 past the pages its position can see."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    layout = layout or draw(st.sampled_from(sorted(INDEXER_LAYOUTS)))
    batch = draw(st.integers(1, 3))
    heads = draw(st.sampled_from([1, 3, max_heads, 64]))
    page_slots = draw(st.sampled_from(PAGE_SLOTS))
    num_pages = draw(st.integers(1, max_pages))
    table_pages = draw(st.integers(1, num_pages))
    k_cache = torch.zeros(num_pages, INDEXER_LAYOUTS[layout].page_bytes(page_slots), dtype=torch.uint8)
    keys = torch.randn(num_pages * page_slots, INDEXER_HEAD_DIM, generator=g)
    write_indexer_keys(keys, k_cache, torch.arange(num_pages * page_slots), page_slots, layout)
    capacity = table_pages * page_slots
    # Positions around the edges: nothing visible, exactly a page boundary, the whole table.
    positions = torch.tensor([draw(st.sampled_from([-1, 0, 3, 4 * page_slots - 1, 4 * capacity - 1,
                                                    draw(st.integers(0, 4 * capacity - 1))]))
                              for _ in range(batch)], dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    page_table = torch.stack([torch.randperm(num_pages, generator=g)[:table_pages] for _ in range(batch)]).int()
    used = -(-visible_entry_count(positions) // page_slots)
    page_table[torch.arange(table_pages)[None, :] >= used[:, None]] = -1
    q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    q = torch.randn(batch, heads, INDEXER_HEAD_DIM, generator=g).to(q_dtype)
    weights = torch.randn(batch, heads, generator=g)
    return IndexerCase(q, weights, k_cache, page_table, positions, page_slots, layout)


@st.composite
def score_rows(draw, *, max_batch: int = 3, max_width: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores float32 [B, L], positions int64 [B])``: random, heavily tied (few distinct values),
    or signed-zero / infinite scores; positions see nothing, part of, exactly, or beyond the row."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    batch = draw(st.integers(1, max_batch))
    width = draw(st.integers(1, max_width))
    kind = draw(st.sampled_from(["random", "ties", "specials"]))
    if kind == "random":
        scores = torch.randn(batch, width, generator=g) * 10
    elif kind == "ties":
        scores = torch.randint(-3, 4, (batch, width), generator=g).float()
    else:
        pool = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-40, -1e-40, 3e38])
        scores = pool[torch.randint(0, pool.numel(), (batch, width), generator=g)]
    positions = torch.tensor([draw(st.sampled_from([-1, 2, 4 * width - 1, 4 * width + 40,
                                                    draw(st.integers(0, 4 * width))])) for _ in range(batch)])
    return scores, positions

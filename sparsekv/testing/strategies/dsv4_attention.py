"""Hypothesis strategies for DSV4 sparse decode attention: paged V4 caches filled by the byte
oracle, index rows with -1, repeats, out-of-cache-free slots and empty rows, optional extra cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from sparsekv.kv_layout import V4
from sparsekv.testing.reference.dsv4_quant import DIM, quantize_fp8_ds_mla

PAGE_SLOTS = (1, 2, 4, 64)


def v4_cache(rows: torch.Tensor, page_slots: int, extra_pages: int = 0) -> torch.Tensor:
    """A uint8 ``[pages, V4.page_bytes(page_slots)]`` cache whose slot ``i`` holds ``rows[i]`` quantized."""
    pages = -(-rows.shape[0] // page_slots) + extra_pages
    cache = torch.zeros(pages, V4.page_bytes(page_slots), dtype=torch.uint8)
    quantize_fp8_ds_mla(rows, cache, torch.arange(rows.shape[0]), page_slots)
    return cache


def random_rows(n: int, generator: torch.Generator) -> torch.Tensor:
    """float32 ``[n, 512]`` rows with a per-row magnitude between 1/8 and 4 (exercises the UE8M0 scales)."""
    magnitude = torch.exp2(torch.randint(-3, 3, (n, 1), generator=generator).float())
    return torch.randn(n, DIM, generator=generator) * magnitude


@dataclass
class AttentionCase:
    """The arguments of one :func:`~sparsekv.jit_kernel.dsv4_attention.sparse_decode_attention` call."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    indices: torch.Tensor
    sink: torch.Tensor
    page_slots: int
    extra_kv_cache: torch.Tensor | None = None
    extra_indices: torch.Tensor | None = None
    extra_page_slots: int | None = None

    def kwargs(self) -> dict:
        return {"extra_kv_cache": self.extra_kv_cache, "extra_indices": self.extra_indices,
                "extra_page_slots": self.extra_page_slots}

    def to(self, device: torch.device) -> AttentionCase:
        """The same case with every tensor on ``device``."""
        return AttentionCase(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in (
            self.q, self.kv_cache, self.indices, self.sink, self.page_slots, self.extra_kv_cache, self.extra_indices,
            self.extra_page_slots)))


def index_rows(draw, batch: int, width: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    """int32 ``[batch, width]``: slots with repeats, about a quarter -1, sometimes a whole row of -1."""
    slots = torch.randint(0, num_slots, (batch, width), generator=generator, dtype=torch.int32)
    holes = torch.rand(batch, width, generator=generator) < draw(st.sampled_from([0.0, 0.25, 0.9]))
    slots[holes] = -1
    if batch > 1 and draw(st.booleans()):
        slots[draw(st.integers(0, batch - 1))] = -1
    return slots


@st.composite
def attention_case(draw, *, max_batch: int = 3, max_heads: int = 10, max_k: int = 40,
                   extra: bool | None = None) -> AttentionCase:
    """A small :class:`AttentionCase`; ``extra`` None draws whether there is a second cache."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    batch = draw(st.integers(1, max_batch))
    heads = draw(st.integers(1, max_heads))
    page_slots = draw(st.sampled_from(PAGE_SLOTS))
    num_slots = draw(st.integers(1, 3 * page_slots + 5))
    rows = random_rows(num_slots, g)
    q_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    # Logits of order 1 to 10: a query scale of up to 8 on unit rows.
    q = (torch.randn(batch, heads, DIM, generator=g) * draw(st.sampled_from([0.5, 2.0, 8.0]))).to(q_dtype)
    sink = torch.randn(heads, generator=g) * 4
    if draw(st.booleans()):
        sink[0] = float("-inf")
    case = AttentionCase(q, v4_cache(rows, page_slots), index_rows(draw, batch, draw(st.integers(0, max_k)),
                                                                   num_slots, g), sink, page_slots)
    if extra if extra is not None else draw(st.booleans()):
        extra_page = draw(st.sampled_from(PAGE_SLOTS))
        extra_slots = draw(st.integers(1, 2 * extra_page + 3))
        case.extra_kv_cache = v4_cache(random_rows(extra_slots, g), extra_page)
        case.extra_indices = index_rows(draw, batch, draw(st.integers(0, max_k)), extra_slots, g)
        case.extra_page_slots = extra_page
    return case

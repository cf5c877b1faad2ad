"""Hypothesis strategies for ``gather_rows``: row tables (possibly column slices of wider buffers)
and index sets with repeats, first/last rows and N == 0."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def byte_table(draw, max_rows: int = 40, max_row_bytes: int = 80) -> torch.Tensor:
    """A uint8 ``[rows, row_bytes]`` table; sometimes a column slice (row stride > row_bytes)."""
    rows = draw(st.integers(1, max_rows))
    # Widths and offsets that reach every copy width of the GPU path (16, 16 with 8-byte head and
    # tail, 8, 4, 1 bytes), the V4 token row (584 = 36 x 16 + 8) among them.
    row_bytes = draw(st.sampled_from([8, 24, 40, 584]) | st.integers(1, max_row_bytes))
    pad_left = draw(st.sampled_from([0, 8]) | st.integers(0, 9))
    pad_right = draw(st.integers(0, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    wide = torch.randint(0, 256, (rows, pad_left + row_bytes + pad_right), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    return wide[:, pad_left : pad_left + row_bytes]


@st.composite
def gather_case(draw, index_dtype: torch.dtype):
    """``(dst, dst_indices, src, src_indices)`` with distinct destinations and in-range indices."""
    src = draw(byte_table())
    dst_rows = draw(st.integers(1, 40))
    dst = torch.zeros(dst_rows, src.shape[1], dtype=torch.uint8)
    n = draw(st.integers(0, dst_rows))
    dst_idx = draw(st.permutations(range(dst_rows)))[:n]
    src_idx = draw(st.lists(st.sampled_from([0, src.shape[0] - 1, *range(src.shape[0])]), min_size=n, max_size=n))
    return (dst, torch.tensor(dst_idx, dtype=index_dtype), src, torch.tensor(src_idx, dtype=index_dtype))

"""Hypothesis strategies for the DSV4 quantizers: rows whose blocks hit the rounding edge cases.

Each 64-wide block of a row is drawn from one of several kinds: random values at a random
magnitude (huge to tiny), all zeros, an amax exactly at ``448 * 2^k`` (the scale boundary), just
above it, values below the 1e-4 amax floor, and ties of the e4m3 grid.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

BLOCK_KINDS = ("random", "zeros", "amax_at_boundary", "amax_above_boundary", "below_floor", "ties")


def _block(kind: str, exponent: int, gen: torch.Generator, width: int) -> torch.Tensor:
    values = torch.randn(width, generator=gen, dtype=torch.float64)
    if kind == "zeros":
        return torch.zeros(width, dtype=torch.float64)
    if kind == "below_floor":
        return values / values.abs().max() * 5e-5
    if kind in ("amax_at_boundary", "amax_above_boundary"):
        values = values / values.abs().max() * 448.0 * 2.0**exponent
        if kind == "amax_above_boundary":
            values[int(values.abs().argmax())] *= 1 + 2.0**-20
        return values
    if kind == "ties":
        # Halfway points between neighbouring e4m3 codes of the scaled block.
        codes = torch.randint(0, 120, (width,), generator=gen).to(torch.uint8)
        grid = codes.view(torch.float8_e4m3fn).to(torch.float64)
        nxt = (codes + 1).view(torch.float8_e4m3fn).to(torch.float64)
        values = (grid + nxt) / 2
        values[0] = 448.0
        return values * 2.0**exponent
    return values * 2.0**exponent


@st.composite
def quant_rows(draw, width: int = 512, max_rows: int = 12, block: int = 64) -> torch.Tensor:
    """float32 ``[N, width]`` rows (N >= 1) whose blocks are edge cases of the block quantizer."""
    n = draw(st.integers(1, max_rows))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        blocks = []
        for _ in range(width // block):
            kind = draw(st.sampled_from(BLOCK_KINDS))
            exponent = draw(st.integers(-20, 20) | st.sampled_from([-60, 60]))
            blocks.append(_block(kind, exponent, gen, block))
        rows.append(torch.cat(blocks))
    return torch.stack(rows).to(torch.float32)


@st.composite
def slot_case(draw, n: int, page_slots_choices=(1, 2, 16, 64)):
    """``(page_slots, pages, slots)``: ``n`` unique int64 slots of a cache with room to spare."""
    page_slots = draw(st.sampled_from(page_slots_choices))
    pages = -(-n // page_slots) + draw(st.integers(0, 2))
    perm = draw(st.permutations(range(pages * page_slots)))
    return page_slots, pages, torch.tensor(perm[:n], dtype=torch.int64)

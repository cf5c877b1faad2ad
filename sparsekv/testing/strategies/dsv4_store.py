"""Hypothesis strategies for the fused norm + RoPE + store: entries, weights, positions and RoPE settings."""

from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

from sparsekv.rope import RopeParams, RopeTable
from sparsekv.testing.backends import device_of

#: Positions the tests' RoPE tables cover (0 .. 2^16 inclusive: the C4 anchors of a 64k context and more).
TABLE_POSITIONS = (1 << 16) + 1

ROPE_SETTINGS = [
    (160000.0, 16.0, 65536, 32.0, 1.0),  # DSV4 compressed layers (YaRN)
    (10000.0, 1.0, 0, 32.0, 1.0),  # SWA-only layers
    (10000.0, 40.0, 4096, 32.0, 1.0),  # another YaRN blend
]
#: The DSV4 compressed layers' RoPE (YaRN), as ``RopeParams`` arguments.
DSV4_C4_ROPE = (160000, 16, 65536, 32, 1)


@functools.cache
def host_rope_table(rope: tuple) -> RopeTable:
    """The float32 table of ``RopeParams(*rope)`` over :data:`TABLE_POSITIONS`, on the host (built once)."""
    return RopeParams(*rope).table(TABLE_POSITIONS)


def rope_table_on(backend: str, rope: tuple = DSV4_C4_ROPE) -> RopeTable:
    """:func:`host_rope_table` on ``backend``'s device."""
    table = host_rope_table(rope)
    return RopeTable(table.cos.to(device_of(backend)), table.sin.to(device_of(backend)))


@st.composite
def store_case(draw, dim: int, max_rows: int = 12):
    """``(x, weight, eps, positions, rope)``: 1 to ``max_rows`` float32 entries at magnitudes from tiny
    to huge."""
    n = draw(st.integers(1, max_rows))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = 2.0 ** draw(st.integers(-20, 20))
    x = torch.randn(n, dim, generator=gen) * scale
    if draw(st.booleans()):
        x[0] = 0.0  # an all-zero entry: eps keeps the norm finite
    weight = torch.rand(dim, generator=gen) * 2 - 0.5
    eps = draw(st.sampled_from([1e-6, 1e-5]))
    position = (st.integers(0, 1 << 21) | st.sampled_from([0, 4, 128, 65536])).map(lambda p: p % TABLE_POSITIONS)
    positions = torch.tensor(draw(st.lists(position, min_size=n, max_size=n)), dtype=torch.int64)
    rope = draw(st.sampled_from(ROPE_SETTINGS))
    return x, weight, eps, positions, rope

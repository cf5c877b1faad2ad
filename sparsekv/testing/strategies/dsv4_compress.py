"""Hypothesis strategies for the DSV4 compressors: sequences, and ways to feed them in chunks."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def sequence(draw, ratio: int, max_tokens: int | None = None, widths=(8, 32, 40)):
    """``(kv, score, ape)`` float32 for a sequence of T tokens (boundary lengths likely).

    One draw in ten is shorter than ``ratio`` (no entry at all: 0, 1 or ``ratio - 1`` tokens); the
    rest hold at least one entry, so a test's assertions about entries are exercised.
    """
    m = ratio
    max_tokens = max(max_tokens or (6 * m + 3), m)
    if draw(st.integers(0, 9)) == 0:
        t = draw(st.sampled_from([0, 1, m - 1]))
    else:
        t = draw(st.sampled_from([m, m + 1, 2 * m - 1, 2 * m]) | st.integers(m, max_tokens))
    d = draw(st.sampled_from(widths))
    coff = 2 if ratio == 4 else 1
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    spread = draw(st.sampled_from([0.1, 1.0, 10.0]))
    kv = torch.randn(t, coff * d, generator=gen)
    score = torch.randn(t, coff * d, generator=gen) * spread
    ape = torch.randn(ratio, coff * d, generator=gen)
    return kv, score, ape


@st.composite
def feeding(draw, total: int, max_chunk: int, max_drafts: int):
    """A list of ``(start, length, accepted)`` steps feeding positions ``0..total-1``.

    A step is a chunk (``accepted == length``) or an MTP block of drafts of which only the first
    ``accepted`` are kept (the next step starts at ``start + accepted``).
    """
    steps, pos = [], 0
    while pos < total:
        if draw(st.booleans()) and max_drafts > 0:
            n = draw(st.integers(1, max_drafts))
            accepted = draw(st.integers(0, min(n, total - pos)))
            steps.append((pos, n, accepted))
            pos += accepted
        else:
            n = draw(st.integers(1, min(max_chunk, total - pos)))
            steps.append((pos, n, n))
            pos += n
    return steps

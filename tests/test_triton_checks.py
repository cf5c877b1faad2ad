"""The Triton launchers' memory-sharing check (``jit_kernel/triton/checks.py``): one sweep over sorted
byte spans refuses exactly the argument lists a test of every pair refuses, and names the same first
pair (in argument order) the header's ``check_disjoint`` names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.triton.checks import check_disjoint, read, written

#: (first byte, byte count, written, view kind) of one operand inside a shared 256-byte buffer.
operand = st.tuples(st.integers(0, 200), st.integers(0, 48), st.booleans(), st.sampled_from(["flat", "strided"]))


def _view(buffer: torch.Tensor, start: int, count: int, kind: str) -> torch.Tensor:
    if kind == "strided" and count >= 2:  # every other byte: the span runs from the first to the last element
        return buffer[start:start + count:2]
    return buffer[start:start + count]


def _first_clash_pairwise(operands: list) -> tuple[str, str] | None:
    """The reference: every pair in argument order, with its span from first to last byte."""
    def span(t):
        if t.numel() == 0:
            return None
        return t.data_ptr(), t.data_ptr() + (t.numel() - 1) * t.stride(0) + 1

    for i, (a, a_name, a_written) in enumerate(operands):
        for b, b_name, b_written in operands[i + 1:]:
            sa, sb = span(a), span(b)
            if (a_written or b_written) and sa and sb and sa[0] < sb[1] and sb[0] < sa[1]:
                return a_name, b_name
    return None


@given(st.lists(operand, min_size=0, max_size=12))
def test_the_sweep_refuses_what_every_pair_refuses_and_names_the_first_pair(drawn):
    buffer = torch.zeros(256, dtype=torch.uint8)
    operands = [(written if is_written else read)(_view(buffer, start, count, kind), f"t{i}")
                for i, (start, count, is_written, kind) in enumerate(drawn)]
    clash = _first_clash_pairwise(operands)
    if clash is None:
        check_disjoint(*operands)
    else:
        with pytest.raises(ValueError, match=f"`{clash[0]}` and `{clash[1]}` must not share memory"):
            check_disjoint(*operands)


def test_absent_operands_and_reads_sharing_memory_pass():
    buffer = torch.zeros(64, dtype=torch.uint8)
    check_disjoint(read(buffer, "a"), read(buffer[8:], "b"), read(None, "c"), written(torch.zeros(4), "d"))
    with pytest.raises(ValueError, match="`b` and `d` must not share memory"):
        check_disjoint(read(buffer[:4], "a"), read(buffer[8:], "b"), read(None, "c"), written(buffer[60:], "d"))

"""The Triton twin of the fused norm + RoPE (+ Hadamard) + quantize + store (``impl="triton"``): bytes
equal to the torch byte oracle and to the header on identical inputs for every cache kind (bit-exact:
the same rounded float32 steps in the same order, no FMA contraction), with packed word stores and
the byte stores of an unaligned cache; bytes outside the written slots untouched. On CPU tensors it
runs under the Triton interpreter (``tests/conftest.py``). The refusals of bad input are compared in
``test_dsv4_store.py`` (parametrized by ``impl``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import norm_rope_store
from sparsekv.testing.backends import to_backend, triton_examples
from sparsekv.testing.reference.dsv4_store import LAYOUTS, norm_rope_store_reference
from sparsekv.testing.strategies.dsv4_quant import slot_case
from sparsekv.testing.strategies.dsv4_store import host_rope_table, rope_table_on, store_case

KINDS = {"V4": 512, "INDEXER_FP8": 128, "INDEXER_FP4": 128}

pytestmark = pytest.mark.usefixtures("triton_runs_here")


@pytest.mark.parametrize("kind", list(KINDS))
@settings(max_examples=triton_examples())
@given(data=st.data(), offset=st.sampled_from([0, 0, 1, 2]))
def test_triton_bytes_equal_the_reference_and_the_header(backend, kind, data, offset):
    # offset 0: the packed 32-bit stores; 1 and 2: a cache whose base is not word-aligned (byte stores).
    # Up to 4 rows (the interpreter runs a program per row): with page slots 1 and 2 they span pages,
    # every row takes the same path; the header's test draws up to 12.
    x, weight, eps, positions, rope = data.draw(store_case(KINDS[kind], max_rows=4))
    page_slots, pages, slots = data.draw(slot_case(x.shape[0]))
    layout = LAYOUTS[kind]
    page_bytes = layout.page_bytes(page_slots)
    buffer = torch.randint(0, 256, (pages * page_bytes + offset,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(data.draw(st.integers(0, 1000))))
    cache = buffer[offset:].view(pages, page_bytes)
    expected = cache.clone()
    table = host_rope_table(rope)
    norm_rope_store_reference(x, weight, eps, positions, expected, slots, page_slots, table.cos, table.sin, kind)
    x, weight, positions, slots, got, header = to_backend(backend, [x, weight, positions, slots, cache,
                                                                    cache.clone()])
    table = rope_table_on(backend, rope)
    norm_rope_store(x, weight, eps, positions, got, slots, page_slots, table, kind, impl="triton")
    norm_rope_store(x, weight, eps, positions, header, slots, page_slots, table, kind, impl="header")
    # Every byte, the bf16 RoPE dims included; untouched slots and padding keep their noise.
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got.cpu(), header.cpu())

"""End to end on one C4 layer: lightning indexer top-k -> HiSparse swap-in -> sparse decode
attention over the hot buffer gives exactly the output of attention over the fully resident cache.

Two requests over several decode steps: row 0 is longer than the hot buffer (misses are loaded
from the host cache, the newest entry sits in the reserved column H), row 1 fits it (fast path,
slot = position). The indexer keys and the main KV share one page table, as the C4 pools do.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import lightning_indexer, sparse_decode_attention
from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_dsv4_mla
from sparsekv.kv_layout import INDEXER_HEAD_DIM, INDEXER_LAYOUTS, V4, c4_page_slots
from sparsekv.testing.backends import device_of, kernel_backends
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.reference.hisparse import token_bytes, write_token
from sparsekv.testing.strategies.dsv4_attention import random_rows, v4_cache
from sparsekv.testing.strategies.dsv4_indexer import write_indexer_keys

TOP_K, HOT = 5, 7  # a (K, H) of the swap-in's DSV4 instance table
P = c4_page_slots(256)
PAGES_PER_REQ = 3
HEADS, INDEXER_HEADS = 4, 3


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("layout", sorted(INDEXER_LAYOUTS))
@settings(max_examples=scaled_examples(5))
@given(seed=st.integers(0, 2**31 - 1), start=st.integers(HOT + 1, 2 * P), steps=st.integers(1, 4))
def test_indexer_swap_in_attention_equals_the_fully_resident_cache(backend, layout, seed, start, steps):
    g = torch.Generator().manual_seed(seed)
    device = device_of(backend)
    host_pages = 2 * PAGES_PER_REQ + 1
    kv_cache = v4_cache(random_rows(host_pages * P, g), P)  # the fully resident C4 cache (host side too)
    index_cache = torch.zeros(host_pages, INDEXER_LAYOUTS[layout].page_bytes(P), dtype=torch.uint8)
    write_indexer_keys(torch.randn(host_pages * P, INDEXER_HEAD_DIM, generator=g), index_cache,
                       torch.arange(host_pages * P), P, layout)
    page_table = torch.randperm(host_pages, generator=g)[: 2 * PAGES_PER_REQ].reshape(2, PAGES_PER_REQ).int()
    entry = torch.arange(PAGES_PER_REQ * P)
    host_cache_locs = (page_table.long()[:, entry // P] * P + entry % P).contiguous()

    columns = HOT + P
    device_pages = -(-2 * columns // P) + 1
    device_buffer = torch.zeros(device_pages, V4.page_bytes(P), dtype=torch.uint8)
    device_buffer_locs = torch.randperm(device_pages * P, generator=g)[: 2 * columns].reshape(2, columns).int()
    device_buffer_tokens = torch.full((2, columns), -1, dtype=torch.int32)
    device_buffer_tokens[1, :HOT] = torch.arange(HOT, dtype=torch.int32)  # row 1: resident, slot = position
    lru_slots = torch.arange(HOT, dtype=torch.int16).repeat(2, 1)
    sink = torch.randn(HEADS, generator=g)

    def place(rid: int, column: int, token: int) -> None:
        # What the compressor's store does with a new entry: its bytes into the row's device slot.
        src = token_bytes(kv_cache, int(host_cache_locs[rid, token]), page_slots=P)
        write_token(device_buffer, int(device_buffer_locs[rid, column]), src, page_slots=P)

    lengths = [start, 2]
    for token in range(lengths[1]):
        place(1, token, token)
    for _ in range(steps):
        lengths = [lengths[0] + 1, min(lengths[1] + 1, HOT)]
        place(0, HOT, lengths[0] - 1)  # the newest entry of a long row lives in column H
        place(1, lengths[1] - 1, lengths[1] - 1)
        # Any raw position that sees exactly n entries: 4n - 1 .. 4n + 2 (entry n - 1 closes at 4n - 1).
        positions = torch.tensor([4 * n - 1 + int(torch.randint(0, 4, (), generator=g)) for n in lengths])
        q = torch.randn(2, HEADS, 512, generator=g)
        q_index = torch.randn(2, INDEXER_HEADS, INDEXER_HEAD_DIM, generator=g)
        weights = torch.rand(2, INDEXER_HEADS, generator=g)
        on = {name: t.to(device) for name, t in dict(q=q, q_index=q_index, weights=weights, positions=positions,
                                                     page_table=page_table, sink=sink).items()}
        tokens, slots = lightning_indexer(on["q_index"], on["weights"], index_cache.to(device), on["page_table"],
                                          on["positions"], TOP_K, page_slots=P, layout=layout)
        resident = sparse_decode_attention(on["q"], kv_cache.to(device), slots, on["sink"], P)

        hot_buffer = device_buffer.to(device)
        tables = [t.to(device) for t in (device_buffer_tokens, device_buffer_locs, lru_slots)]
        top_k_device_locs = torch.full((2, TOP_K), -1, dtype=torch.int32, device=device)
        host_cache = kv_cache.pin_memory() if backend == "cuda" else kv_cache
        load_cache_to_device_buffer_dsv4_mla(
            tokens, tables[0], host_cache_locs.to(device), tables[1], host_cache, hot_buffer, top_k_device_locs,
            torch.tensor([0, 1], device=device), torch.tensor(lengths, device=device), tables[2],
            V4.bytes_per_token, TOP_K, HOT)
        swapped = sparse_decode_attention(on["q"], hot_buffer, top_k_device_locs, on["sink"], P)

        # Same bytes, same order of entries: bit for bit the same result.
        assert torch.equal(swapped[0].cpu(), resident[0].cpu()) and torch.equal(swapped[1].cpu(), resident[1].cpu())
        expected = sparse_decode_attention_reference(q, kv_cache, slots.cpu(), sink, P)
        torch.testing.assert_close(resident[0].cpu().double(), expected[0], rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(resident[1].cpu().double(), expected[1], rtol=2e-4, atol=2e-4)
        assert bool((tokens.cpu() >= 0).sum(dim=1).eq(torch.tensor([min(TOP_K, n) for n in lengths])).all())
        device_buffer.copy_(hot_buffer.cpu())
        for mine, theirs in zip((device_buffer_tokens, device_buffer_locs, lru_slots), tables):
            mine.copy_(theirs.cpu())

"""dsv4_compress_store: the compressor fused with the store stores the bytes of compress then
norm_rope_store, in a prefill step (CompressorState.extend with a store) and a device-planned decode
step (compress_decode_step), and refuses bad input before anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import (
    RopeParams,
    StoreTarget,
    compress_decode_step,
    norm_rope_store,
)
from sparsekv.jit_kernel.dsv4_compress import window as window_of
from sparsekv.kv_layout import INDEXER_FP8, V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import core_backends, device_of, kernel_backends, to_backend, torch_threads
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.reference.dsv4_store import ENTRY_DIMS, LAYOUTS
from sparsekv.testing.strategies.dsv4_store import DSV4_C4_ROPE, rope_table_on

BACKENDS = kernel_backends()
RATIOS = [4, 128]


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@pytest.mark.parametrize("ratio, kind", [(4, "V4"), (4, "INDEXER_FP8"), (4, "INDEXER_FP4"), (128, "V4")])
@settings(max_examples=scaled_examples(4), deadline=None)
@given(data=st.data())
def test_fused_compress_store_equals_compress_then_store(backend, ratio, kind, data):
    device = device_of(backend)
    dim, coff = ENTRY_DIMS[kind], (2 if ratio == 4 else 1)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    t = data.draw(st.integers(0, 3 * ratio + 2))
    kv, score = torch.randn(t, coff * dim, generator=gen), torch.randn(t, coff * dim, generator=gen)
    ape, weight = torch.randn(ratio, coff * dim, generator=gen), torch.rand(dim, generator=gen) + 0.5
    kv, score, ape, weight = kv.to(device), score.to(device), ape.to(device), weight.to(device)
    rope = rope_table_on(backend)
    layout, page = LAYOUTS[kind], 4
    ring = 2 * (8 if ratio == 4 else 128)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(t - 1, 1)), max_size=3)) + [0, t]))
    fused = torch.zeros(4, layout.page_bytes(page), dtype=torch.uint8, device=device)
    two_pass = torch.zeros_like(fused)
    target = StoreTarget(fused, weight, 1e-6, page, rope, kind)
    state_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    a = CompressorState(torch.zeros(2 * ring, 2 * coff * dim, dtype=state_dtype, device=device), ape, ratio,
                        ring_size=ring)
    b = CompressorState(torch.zeros(2 * ring, 2 * coff * dim, dtype=state_dtype, device=device), ape, ratio,
                        ring_size=ring)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        none, anchors = a.extend([0], [[1]], [lo], kv[lo:hi], score[lo:hi], store=target,
                                 entry_slots=lambda _b, anchor: anchor // ratio)
        entries, anchors_b = b.extend([0], [[1]], [lo], kv[lo:hi], score[lo:hi])
        assert none is None and torch.equal(anchors, anchors_b)
        anchors_b = anchors_b.to(device)
        norm_rope_store(entries, weight, 1e-6, anchors_b, two_pass, anchors_b // ratio, page, rope, kind)
    assert torch.equal(fused.cpu(), two_pass.cpu())
    assert torch.equal(a.state.cpu(), b.state.cpu())


@pytest.mark.sanitizer_case
def test_fused_store_with_a_bad_slot_changes_nothing(backend, index_checks):
    gen = torch.Generator().manual_seed(2)
    kv, score, ape = torch.randn(9, 1024, generator=gen), torch.randn(9, 1024, generator=gen), torch.randn(4, 1024)
    cache = torch.full((2, LAYOUTS["V4"].page_bytes(4)), 7, dtype=torch.uint8)
    kv, score, ape, cache, state, weight = to_backend(backend, [kv, score, ape, cache, torch.zeros(32, 2048),
                                                                torch.ones(512)])
    target = StoreTarget(cache, weight, 1e-6, 4, rope_table_on(backend, (10000,)))
    comp = CompressorState(state, ape, 4, ring_size=16)
    before_cache, before_state = cache.clone(), state.clone()
    with pytest.raises(IndexError, match="`slots`"):
        comp.extend([0], [[1]], [0], kv, score, store=target, entry_slots=lambda _b, anchor: 8 + anchor)
    assert torch.equal(cache, before_cache) and torch.equal(state, before_state)
    # Slots are never rounded: a callback giving 2.5 (once stored at slot 2) is refused, naming them.
    with pytest.raises(TypeError, match="`slots`"):
        comp.extend([0], [[1]], [0], kv, score, store=target, entry_slots=lambda _b, anchor: anchor / 4 + 0.5)
    assert torch.equal(cache, before_cache) and torch.equal(state, before_state)
    # The failed steps did not count: the request still starts at 0.
    comp.extend([0], [[1]], [0], kv, score, store=target, entry_slots=lambda _b, anchor: anchor // 4)
    assert not torch.equal(cache, before_cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("with_store", [False, True], ids=["entries", "store"])
@settings(max_examples=scaled_examples(6), deadline=None)
@given(data=st.data())
def test_decode_step_equals_extend_over_the_same_tokens(backend, ratio, with_store, data):
    """A batch of requests after a chunked prefill, then decode steps: compress_decode_step (state rows
    and positions on the device) gives the entries, emitted flags, ring and stored bytes of
    CompressorState.extend fed the same tokens."""
    device = device_of(backend)
    window, coff, dim = window_of(ratio), (2 if ratio == 4 else 1), 128 if with_store else data.draw(
        st.sampled_from([8, 40]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    batch = data.draw(st.integers(1, 3))
    ring_size = data.draw(st.sampled_from([window, window + 3 if ratio == 4 else 2 * window]))
    rings = torch.randperm(batch + 1, generator=gen)[:batch].tolist()  # ring ids out of order, one unused
    near = [0, 1, ratio - 2, ratio - 1, 2 * ratio - 1]
    prefix = [data.draw(st.sampled_from(near) | st.integers(0, 2 * ratio)) for _ in range(batch)]
    steps = data.draw(st.integers(1, 6 if ratio == 128 else ratio + 3))
    total = max(prefix) + steps
    kv = torch.randn(batch, total, coff * dim, generator=gen)
    score = torch.randn(batch, total, coff * dim, generator=gen) * 3
    ape = torch.randn(ratio, coff * dim, generator=gen).to(device)
    state_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    state = torch.zeros((batch + 1) * ring_size, 2 * coff * dim, dtype=state_dtype, device=device)
    reference, planned = (CompressorState(s, ape, ratio, ring_size=ring_size) for s in (state, state.clone()))
    page, rope = 4, RopeParams(10000).table(total, device)
    caches = [torch.zeros(-(-batch * (total // ratio + 1) // page), INDEXER_FP8.page_bytes(page), dtype=torch.uint8,
                          device=device) for _ in range(2)]
    weight = (torch.rand(dim, generator=gen) + 0.5).to(device)
    targets = [StoreTarget(c, weight, 1e-6, page, rope, "INDEXER_FP8") for c in caches]

    def slot_of(b: int, anchor: int) -> int:
        return b * (total // ratio + 1) + anchor // ratio

    def rows(b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return kv[b, :length].to(device), score[b, :length].to(device)

    ids = list(range(batch))
    for comp in (reference, planned):  # the chunked prefill, one ragged batch
        comp.extend(ids, [[r] for r in rings], [0] * batch, torch.cat([rows(b, n)[0] for b, n in enumerate(prefix)]),
                    torch.cat([rows(b, n)[1] for b, n in enumerate(prefix)]), lengths=prefix)
    out = torch.empty(batch, dim, device=device)
    emitted = torch.empty(batch, dtype=torch.bool, device=device)
    for step in range(steps):
        pos = [n + step for n in prefix]
        new_kv = torch.stack([kv[b, p] for b, p in enumerate(pos)]).to(device)
        new_score = torch.stack([score[b, p] for b, p in enumerate(pos)]).to(device)
        store = dict(store=targets[0], entry_slots=slot_of) if with_store else {}
        expected, anchors = reference.extend(ids, [[r] for r in rings], pos, new_kv, new_score, lengths=[1] * batch,
                                             **store)
        state_rows = torch.tensor([[rings[b] * ring_size + (p - window + 1 + j) % ring_size for j in range(window)]
                                   for b, p in enumerate(pos)], dtype=data.draw(st.sampled_from([torch.int32,
                                                                                                  torch.int64])))
        positions = torch.tensor(pos)
        kwargs = {}
        if with_store:
            kwargs = dict(store=targets[1], entry_slots=torch.tensor(
                [slot_of(b, p - ratio + 1) if (p + 1) % ratio == 0 else -1 for b, p in enumerate(pos)]).to(device))
        got, flags = compress_decode_step(new_kv, new_score, ape, ratio, planned.state, state_rows.to(device),
                                          positions.to(device), out=out, emitted=emitted, **kwargs)
        assert got is out and flags is emitted
        want = torch.tensor([(p + 1) % ratio == 0 for p in pos])
        assert torch.equal(flags.cpu(), want)
        assert torch.equal(anchors, positions[want] - ratio + 1)
        assert not got.cpu()[~want].any()
        if not with_store:
            assert torch.equal(got.cpu()[want], expected.cpu())
        else:
            assert torch.equal(caches[1].cpu(), caches[0].cpu())
        assert torch.equal(planned.state.cpu(), reference.state.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_fused_rows_off_a_16_byte_boundary_store_the_same_bytes(backend, ratio):
    # The GPU pools 16-byte aligned rows 4 channels a lane: C4 with the window held (HeldStore), C128
    # with the window split over a CTA's warps (SplitStore); other rows (here kv, a view one float into
    # a wider buffer) a channel a lane, the window streamed (StreamedStore): the same bytes either way.
    # Planted bug this catches: one form placing a pooled channel in another column of the team row.
    # (A last-bit change of a pooled float rarely changes its fp8 code: the order of a channel's sums
    # is held by test_dsv4_compress's test on the float entries, the pooling being the same function.)
    t, d, page, coff = 3 * ratio + 2, 512, 4, (2 if ratio == 4 else 1)
    device = device_of(backend)
    gen = torch.Generator().manual_seed(11)
    buffer = torch.randn(t, coff * d + 1, generator=gen).to(device)
    score = (torch.randn(t, coff * d, generator=gen) * 4).to(device)
    ape = torch.randn(ratio, coff * d, generator=gen).to(device)
    weight = (torch.rand(d, generator=gen) + 0.5).to(device)
    rope = RopeParams(*DSV4_C4_ROPE).table(t, device)
    ring = 2 * window_of(ratio)

    def run(kv):
        cache = torch.zeros(2, V4.page_bytes(page), dtype=torch.uint8, device=device)
        comp = CompressorState(torch.zeros(2 * ring, 2 * coff * d, device=device), ape, ratio, ring_size=ring)
        comp.extend([0], [[1]], [0], kv, score, store=StoreTarget(cache, weight, 1e-6, page, rope),
                    entry_slots=lambda _b, anchor: anchor // ratio)
        return cache.cpu()

    shifted = run(buffer[:, 1:])
    assert torch.equal(shifted, run(buffer[:, 1:].contiguous()))
    assert shifted.count_nonzero() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_prefill_does_not_depend_on_the_thread_count(backend):
    # 1024 tokens of C4 at d = 512 read 16 MiB: enough for the cpu backend to split the events over
    # two threads (one chunk per 4 MiB). Planted bug this catches: a chunk bound that skips or
    # repeats items, or an item shared by two threads.
    t, d, ratio, page = 1024, 512, 4, 64
    device = device_of(backend)
    gen = torch.Generator().manual_seed(7)
    shapes = ((t, 2 * d), (t, 2 * d), (ratio, 2 * d))
    kv, score, ape = (torch.randn(shape, generator=gen).to(device) for shape in shapes)
    weight = (torch.rand(d, generator=gen) + 0.5).to(device)
    rope = RopeParams(*DSV4_C4_ROPE).table(t, device)

    def run(threads):
        cache = torch.zeros(t // ratio // page + 1, V4.page_bytes(page), dtype=torch.uint8, device=device)
        comp = CompressorState(torch.zeros(32, 4 * d, device=device), ape, ratio, ring_size=16)
        with torch_threads(threads):
            comp.extend([0], [[1]], [0], kv, score, store=StoreTarget(cache, weight, 1e-6, page, rope),
                        entry_slots=lambda _b, anchor: anchor // ratio)
        return cache.cpu()

    one, two = run(1), run(2)
    assert torch.equal(one, two)
    assert one.count_nonzero() > 0

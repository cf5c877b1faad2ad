"""dsv4_compress: one-shot pooling against the fp64 reference, its properties, and the streaming state."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import compress_pool
from sparsekv.jit_kernel.dsv4_compress import check_decode_rows_on_device, compress_decode, compress_extend
from sparsekv.jit_kernel.dsv4_compress import window as window_of
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import core_backends, device_of, kernel_backends, torch_threads
from sparsekv.testing.components import skip_for_gpu
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.reference.dsv4_compress import (
    compress_pool_reference,
    online_fold_reference,
    plan_raw_reference,
)
from sparsekv.testing.strategies.dsv4_compress import feeding, sequence

BACKENDS = kernel_backends()
RATIOS = [4, 128]


def _on(backend, *tensors):
    device = device_of(backend)
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@pytest.mark.parametrize("ratio", RATIOS)
@settings(max_examples=scaled_examples(10), deadline=None)
@given(data=st.data())
def test_compress_pool_matches_fp64_reference(backend, ratio, data):
    kv, score, ape = data.draw(sequence(ratio))
    before = [t.clone() for t in (kv, score, ape)]
    dkv, dscore, dape = _on(backend, kv, score, ape)
    got = compress_pool(dkv, dscore, dape, ratio).cpu()
    expected = compress_pool_reference(kv, score, ape, ratio)
    assert got.shape == expected.shape == (kv.shape[0] // ratio, kv.shape[1] // (2 if ratio == 4 else 1))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    # Inputs are never modified.
    assert all(torch.equal(a, b) for a, b in zip(before, (dkv.cpu(), dscore.cpu(), dape.cpu())))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
@settings(max_examples=scaled_examples(10), deadline=None)
@given(data=st.data(), shift=st.floats(-30, 30))
def test_gauge_invariance_and_convexity(backend, ratio, data, shift):
    kv, score, ape = data.draw(sequence(ratio))
    base = compress_pool(*_on(backend, kv, score, ape), ratio).cpu()
    # A per-channel constant added to every score (both halves alike) leaves every entry unchanged.
    coff = 2 if ratio == 4 else 1
    per_channel = (torch.linspace(-1, 1, score.shape[1] // coff) * shift).repeat(coff)
    shifted = compress_pool(*_on(backend, kv, score + per_channel, ape), ratio).cpu()
    torch.testing.assert_close(shifted, base, atol=1e-5, rtol=1e-5)
    # Each pooled value lies within its window's per-channel min and max.
    d = base.shape[1]
    for i in range(base.shape[0]):
        if ratio == 128:
            window = kv[128 * i : 128 * i + 128]
        else:
            window = kv[4 * i : 4 * i + 4, d:]
            if i > 0:
                window = torch.cat([kv[4 * i - 4 : 4 * i, :d], window])
        slack = 1e-6 * window.abs().amax(0) + 1e-7
        assert bool((base[i] >= window.amin(0) - slack).all()) and bool((base[i] <= window.amax(0) + slack).all())


@pytest.mark.sanitizer_case
@pytest.mark.parametrize("backend", BACKENDS)
def test_c4_entry_zero_uses_only_the_b_halves(backend):
    kv, score, ape = torch.randn(8, 64), torch.randn(8, 64), torch.randn(4, 64)
    base = compress_pool(*_on(backend, kv, score, ape), 4).cpu()
    kv2, score2 = kv.clone(), score.clone()
    kv2[:4, :32] = 1e6
    score2[:4, :32] = 1e3
    other = compress_pool(*_on(backend, kv2, score2, ape), 4).cpu()
    assert torch.equal(other[0], base[0])
    assert not torch.equal(other[1], base[1])  # entry 1 does read those A halves
    only_b = torch.softmax(score[:4, 32:] + ape[:, 32:], 0).mul(kv[:4, 32:]).sum(0)
    torch.testing.assert_close(base[0], only_b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_causality_entry_i_depends_only_on_tokens_up_to_its_last(backend, ratio):
    gen = torch.Generator().manual_seed(ratio)
    coff = 2 if ratio == 4 else 1
    t = 3 * ratio + 1
    kv, score, ape = torch.randn(t, coff * 16, generator=gen), torch.randn(t, coff * 16, generator=gen), torch.randn(
        ratio, coff * 16, generator=gen)
    full = compress_pool(*_on(backend, kv, score, ape), ratio).cpu()
    for length in range(t + 1):
        prefix = compress_pool(*_on(backend, kv[:length], score[:length], ape), ratio).cpu()
        # Entry i exists exactly when token m*i + m - 1 has arrived, and equals the full run's.
        assert prefix.shape[0] == length // ratio == sum(ratio * i + ratio - 1 < length for i in range(4))
        assert torch.equal(prefix, full[: prefix.shape[0]])


@pytest.mark.parametrize("ratio", [0, 1, 2, 3, 8, 64, 256, -4])
def test_other_ratios_are_rejected(backend, ratio):
    device = device_of(backend)
    kv = torch.zeros(256, 16, device=device)
    with pytest.raises(ValueError, match="`ratio`"):
        compress_pool(kv, kv.clone(), torch.zeros(max(ratio, 1), 16, device=device), ratio)
    with pytest.raises(ValueError, match="`ratio`"):
        CompressorState(torch.zeros(16, 32, device=device), torch.zeros(4, 16, device=device), ratio, ring_size=16)


BAD = [
    (lambda kv, s, a: (kv.double(), s, a, 4), TypeError, "kv"),
    (lambda kv, s, a: (kv, s[:-1], a, 4), ValueError, "score"),
    (lambda kv, s, a: (kv, s, a[:3], 4), ValueError, "ape"),
    (lambda kv, s, a: (kv[:, :15], s[:, :15], a[:, :15], 4), ValueError, "kv"),
    (lambda kv, s, a: (kv, s, a.half(), 4), TypeError, "ape"),
]


@pytest.mark.parametrize("mutate, exc, name", BAD)
def test_bad_input_names_the_argument(backend, mutate, exc, name):
    kv, score, ape = _on(backend, torch.randn(8, 16), torch.randn(8, 16), torch.randn(4, 16))
    with pytest.raises(exc, match=f"`{name}`"):
        compress_pool(*mutate(kv, score, ape))


# ---- streaming state ------------------------------------------------------------------------


def _feed(state, steps, kv, score, ring_ids, span, seed):
    """Run ``steps`` for request 0; return the accepted entries in order."""
    gen = torch.Generator().manual_seed(seed)
    kept, anchors_kept = [], []
    for start, n, accepted in steps:
        rows_kv = torch.cat([kv[start : start + accepted], torch.randn(n - accepted, kv.shape[1], generator=gen)])
        rows_s = torch.cat([score[start : start + accepted], torch.randn(n - accepted, kv.shape[1], generator=gen)])
        entries, anchors = state.extend([0], [ring_ids], [start], rows_kv.to(state.state.device),
                                        rows_s.to(state.state.device), ring_span=span)
        for e, a in zip(entries.cpu(), anchors.tolist()):
            if a + state.ratio - 1 < start + accepted:  # built from accepted tokens only
                kept.append(e)
                anchors_kept.append(a)
    d = kv.shape[1] // (2 if state.ratio == 4 else 1)
    return (torch.stack(kept) if kept else torch.zeros(0, d)), anchors_kept


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio, online", [(4, False), (128, False), (128, True)], ids=["c4", "c128", "c128-online"])
@settings(max_examples=scaled_examples(8), deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_one_shot_entries(backend, ratio, online, data):
    kv, score, ape = data.draw(sequence(ratio, max_tokens=3 * ratio + 5, widths=(8, 32)))
    total = kv.shape[0]
    steps = data.draw(feeding(total, max_chunk=2 * ratio + 3, max_drafts=8))
    ring = 2 * (8 if ratio == 4 else 128)  # speculative ring sizes
    # One ring per request, or SWA-page rings (a new ring id every `span` positions).
    span = data.draw(st.sampled_from([None, 64])) if ratio == 4 and not online else None
    ring_ids = data.draw(st.permutations(range(1, 8)))
    device = device_of(backend)
    width = kv.shape[1]
    state = torch.zeros(8 * ring, 2 * width, device=device)
    comp = CompressorState(state, ape.to(device), ratio, ring_size=ring, online=online)
    got, anchors = _feed(comp, steps, kv, score, ring_ids, span, seed=total)
    assert anchors == [ratio * i for i in range(total // ratio)]
    if online:
        # The fold is token by token: any chunking gives the bytes of one chunk...
        one = CompressorState(torch.zeros_like(state), ape.to(device), ratio, ring_size=ring, online=True)
        whole, _ = one.extend([0], [[1]], [0], kv.to(device), score.to(device))
        assert torch.equal(got, whole.cpu())
        # ... and, as any merge order of the online softmax, the batch softmax.
        torch.testing.assert_close(got.double(), online_fold_reference(kv, score, ape), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), compress_pool_reference(kv, score, ape, ratio), atol=1e-5,
                                   rtol=1e-5)
    else:
        assert torch.equal(got, compress_pool(*_on(backend, kv, score, ape), ratio).cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_of_requests_matches_each_alone(backend):
    gen = torch.Generator().manual_seed(3)
    device = device_of(backend)
    seqs = [(torch.randn(t, 32, generator=gen), torch.randn(t, 32, generator=gen)) for t in (13, 6, 21)]
    ape = torch.randn(4, 32, generator=gen).to(device)
    comp = CompressorState(torch.zeros(4 * 16, 64, device=device), ape, 4, ring_size=16)
    cuts = [(0, 5), (5, 9), (9, 30)]
    outs = {r: [] for r in range(3)}
    for lo, hi in cuts:
        ids, rings, starts, lengths, kvs, scores = [], [], [], [], [], []
        for r, (kv, score) in enumerate(seqs):
            a, b = min(lo, kv.shape[0]), min(hi, kv.shape[0])
            ids.append(r), rings.append([r + 1]), starts.append(a), lengths.append(b - a)
            kvs.append(kv[a:b]), scores.append(score[a:b])
        entries, anchors = comp.extend(ids, rings, starts, torch.cat(kvs).to(device), torch.cat(scores).to(device),
                                       lengths=lengths)
        k = 0
        for r, (a, n) in enumerate(zip(starts, lengths)):
            count = (a + n) // 4 - a // 4
            outs[r].append(entries[k : k + count].cpu())
            k += count
    for r, (kv, score) in enumerate(seqs):
        assert torch.equal(torch.cat(outs[r]), compress_pool(kv.to(device), score.to(device), ape, 4).cpu())


def test_rollback_past_the_ring_is_refused_and_state_unchanged(backend):
    device = device_of(backend)

    def rows(n):
        return torch.randn(n, 16, device=device), torch.randn(n, 16, device=device)

    state = torch.zeros(2 * 8, 32, device=device)
    comp = CompressorState(state, torch.randn(4, 16, device=device), 4, ring_size=8)
    comp.extend([0], [[1]], [0], *rows(6))
    comp.extend([0], [[1]], [6], *rows(3))  # overwrote position 0
    before = state.clone()
    with pytest.raises(ValueError, match="`starts`"):
        comp.extend([0], [[1]], [7], *rows(1))
    with pytest.raises(ValueError, match="`starts`"):
        comp.extend([0], [[1]], [10], *rows(1))  # beyond what it holds
    with pytest.raises(IndexError, match="`rings`"):
        comp.extend([0], [[5]], [9], *rows(1))  # ring 5 is outside state
    assert torch.equal(state, before)


def _small_pool_state(backend, ratio: int):
    """A 4-layer DSV4-Flash pool for two requests, and the compressor state buffer of its first ``ratio`` layer."""
    from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
    from sparsekv.srt.model_executor.model_spec import ServerSpec, dsv4_preset
    from sparsekv.srt.model_executor.pool_planner import plan_pipeline

    model = dsv4_preset("dsv4-flash", num_hidden_layers=4)
    rank = plan_pipeline(model, ServerSpec(max_running_requests=2), 64 << 20).ranks[0]
    pool = DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device=device_of(backend))
    layer = next(lid for lid, (r, _) in pool.layer_mapping.items() if r == ratio)
    return pool, pool.get_compress_state(layer)


def test_pool_rings_are_used_in_place(backend):
    pool, buf = _small_pool_state(backend, 4)
    before = buf.clone()
    ring, width = pool.ring_sizes[4], buf.shape[1] // 2
    comp = CompressorState(buf, torch.randn(4, width, device=buf.device), 4, ring_size=ring)
    comp.extend([0], [[1]], [0], torch.randn(6, width, device=buf.device), torch.randn(6, width, device=buf.device))
    changed = (buf != before).any(1).nonzero().flatten().tolist()
    assert changed and all(ring <= r < 2 * ring for r in changed)  # ring 1's rows, in the pool's own buffer


MATRIX = [(ratio, t) for ratio in (0, 4, 128) for t in (0, 1, 3, 4, 5, 7, 8, 9, 127, 128, 129, 255, 256, 257)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio, t", MATRIX)
def test_ratio_and_boundary_length_matrix_with_chunked_prefill_continuation(backend, ratio, t):
    device = device_of(backend)
    coff = 2 if ratio == 4 else 1
    gen = torch.Generator().manual_seed(t)
    kv, score = torch.randn(t, coff * 8, generator=gen), torch.randn(t, coff * 8, generator=gen)
    ape = torch.randn(max(ratio, 1), coff * 8, generator=gen)
    kv, score, ape = kv.to(device), score.to(device), ape.to(device)
    if ratio == 0:  # SWA-only layers have no compressor
        with pytest.raises(ValueError, match="`ratio`"):
            compress_pool(kv, score, ape, ratio)
        return
    one_shot = compress_pool(kv, score, ape, ratio)
    assert one_shot.shape == (t // ratio, 8)
    torch.testing.assert_close(one_shot.cpu().double(), compress_pool_reference(kv.cpu(), score.cpu(), ape.cpu(),
                                                                                ratio), atol=1e-5, rtol=1e-5)
    for online in (False, True) if ratio == 128 else (False,):
        # A prefill chunk, then its continuation from the stored state (cut just before a boundary).
        cut = max(0, (t // 2) // ratio * ratio - 1)
        ring = 2 * window_of(ratio)
        comp = CompressorState(torch.zeros(2 * ring, 2 * coff * 8, device=device), ape, ratio, ring_size=ring,
                               online=online)
        first, _ = comp.extend([0], [[1]], [0], kv[:cut], score[:cut])
        second, _ = comp.extend([0], [[1]], [cut], kv[cut:], score[cut:])
        streamed = torch.cat([first, second]).cpu()
        if online:
            torch.testing.assert_close(streamed, one_shot.cpu(), atol=1e-5, rtol=1e-5)
        else:
            assert torch.equal(streamed, one_shot.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_online_c128_uses_the_pool_request_rings_in_place(backend):
    pool, buf = _small_pool_state(backend, 128)
    ring, d = pool.ring_sizes[128], buf.shape[1] // 2
    gen = torch.Generator().manual_seed(0)
    kv, score, ape = (torch.randn(300, d, generator=gen).to(buf.device), torch.randn(300, d, generator=gen).to(
        buf.device), torch.randn(128, d, generator=gen).to(buf.device))
    comp = CompressorState(buf, ape, 128, ring_size=ring, online=True)
    req = 1
    rows = int(pool.c128_state_loc(torch.tensor(req), torch.tensor(0)))  # the request's first ring row
    before = buf.clone()
    out = torch.cat([comp.extend([req], [[rows // ring]], [s], kv[s:e], score[s:e])[0] for s, e in
                     [(0, 100), (100, 200), (200, 300)]])
    torch.testing.assert_close(out.cpu().double(), compress_pool_reference(kv.cpu(), score.cpu(), ape.cpu(), 128),
                               atol=1e-5, rtol=1e-5)
    changed = (buf != before).any(1).nonzero().flatten().tolist()
    assert changed and all(rows <= r < rows + ring for r in changed)


@pytest.mark.no_backend("the docstring's example runs on CPU tensors, as a reader would run it")
def test_the_documented_streaming_example_holds():
    import doctest

    import sparsekv.srt.mem_cache.compressor_state as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_construction_checks(backend):
    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device_of(backend))

    with pytest.raises(TypeError, match="`state`"):
        CompressorState(zeros(16, 64, dtype=torch.bfloat16), zeros(128, 32), 128, ring_size=16, online=True)
    with pytest.raises(TypeError, match="`state`"):
        CompressorState(zeros(16, 64, dtype=torch.float16), zeros(4, 32), 4, ring_size=16)
    with pytest.raises(TypeError, match="`ape`"):
        CompressorState(zeros(16, 64), zeros(4, 32, dtype=torch.float64), 4, ring_size=16)
    with pytest.raises(ValueError, match="`ring_size`"):
        CompressorState(zeros(16, 64), zeros(4, 32), 4, ring_size=4)
    with pytest.raises(ValueError, match="`online`"):
        CompressorState(zeros(16, 64), zeros(4, 32), 4, ring_size=16, online=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
@settings(max_examples=scaled_examples(6), deadline=None)
@given(data=st.data())
def test_bf16_state_ring_pools_the_bf16_rounded_sequence_under_any_chunking(backend, ratio, data):
    kv, score, ape = data.draw(sequence(ratio, max_tokens=3 * ratio + 5, widths=(8, 32)))
    steps = data.draw(feeding(kv.shape[0], max_chunk=2 * ratio + 3, max_drafts=8))
    device = device_of(backend)
    ring = 2 * window_of(ratio)
    state = torch.zeros(4 * ring, 2 * kv.shape[1], dtype=torch.bfloat16, device=device)
    comp = CompressorState(state, ape.to(device), ratio, ring_size=ring)
    got, _ = _feed(comp, steps, kv, score, [2], None, seed=1)
    rounded = [t.bfloat16().float() for t in (kv, score)]
    assert torch.equal(got, compress_pool(*_on(backend, *rounded, ape), ratio).cpu())



@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=scaled_examples(10), deadline=None)
@given(ratio=st.sampled_from(RATIOS), d=st.integers(1, 21), bf16=st.booleans(), ring_offset=st.integers(0, 7),
       kv_offset=st.integers(0, 3), count=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
@example(ratio=4, d=512, bf16=True, ring_offset=0, kv_offset=0, count=2, seed=0)  # serving rows: 16-byte words only
@example(ratio=128, d=5, bf16=True, ring_offset=1, kv_offset=1, count=5, seed=0)  # odd offset: shared edge words
@example(ratio=4, d=3, bf16=False, ring_offset=1, kv_offset=2, count=5, seed=0)  # fp32 head, tail, straddle
def test_ring_writes_store_their_rows_and_nothing_else_at_any_width_and_alignment(backend, ratio, d, bf16,
                                                                                   ring_offset, kv_offset, count,
                                                                                   seed):
    """compress_extend's ring writes (RingWrite), byte for byte: ring row ``writes[i, 1]`` becomes ``[kv |
    score]`` of input row ``writes[i, 0]`` in the ring's dtype (bf16 rounded to nearest even), and no other
    byte of the state's storage changes. Every row width (16-byte words, a head and a tail of 4-byte words,
    the word that straddles kv | score), every offset of the ring (a bf16 ring at an odd element offset
    shares each row's first and last element's word with the next row or the memory beside the ring) and
    of the input rows (16-byte loads, or 4-byte ones off a 16-byte boundary)."""
    device, dtype = device_of(backend), (torch.bfloat16 if bf16 else torch.float32)
    width, rows, inputs = (2 if ratio == 4 else 1) * d, 5, 4
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(ring_offset + rows * 2 * width + 3, generator=gen).to(dtype).to(device)
    before = storage.cpu().clone()
    state = storage[ring_offset : ring_offset + rows * 2 * width].view(rows, 2 * width)
    # kv and score: views of one projection, 4 floats apart (a word read past kv's end is not score's)
    wide = torch.randn(inputs, kv_offset + 2 * width + 5, generator=gen)
    kv, score = wide[:, kv_offset : kv_offset + width], wide[:, kv_offset + width + 4 : kv_offset + 2 * width + 4]
    dst = torch.randperm(rows, generator=gen)[:count]
    src = torch.randint(0, inputs, (count,), generator=gen)
    no_events = torch.zeros(0, window_of(ratio), dtype=torch.int64)
    compress_extend(*_on(backend, kv, score, torch.zeros(ratio, width)), ratio, state,
                    *_on(backend, no_events, torch.stack([src, dst], 1), torch.zeros(0, d)))
    expected = before.clone()
    ring = expected[ring_offset : ring_offset + rows * 2 * width].view(rows, 2 * width)
    for s, r in zip(src.tolist(), dst.tolist()):
        ring[r] = torch.cat([kv[s], score[s]]).to(dtype)
    assert torch.equal(storage.cpu().view(torch.uint8), expected.view(torch.uint8))


# ---- the raw ring's step plan, on the device -------------------------------------------------


@st.composite
def raw_steps(draw, ratio: int):
    """A ragged batch of chunks (prefill chunks, decode tokens, drafts re-fed from an earlier start):
    the rings, starts and lengths of one step, its ring size and span, and the state's ring count."""
    win = window_of(ratio)
    ring_size = draw(st.sampled_from([win, win + 3, 2 * win]))
    span = draw(st.sampled_from([None, ring_size, 2 * ring_size, 5]))
    batch = draw(st.integers(0, 4))
    near = [0, 1, ratio - 1, ratio, ratio + 1, 2 * ratio - 1, 3 * ratio + 2]
    starts = [draw(st.sampled_from(near) | st.integers(0, 4 * ratio)) for _ in range(batch)]
    lengths = [draw(st.sampled_from([0, 1, 1, 2, ratio - 1, ratio, 2 * win + 3]) | st.integers(0, 3 * ratio))
               for _ in range(batch)]
    num_rings = 9
    needed = [1 if span is None else (s + n + span - 1) // span for s, n in zip(starts, lengths)]
    rings = [draw(st.lists(st.integers(0, num_rings - 1), min_size=k, max_size=k if span is None else k + 2))
             for k in needed]
    return rings, starts, lengths, ring_size, span, num_rings


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
@settings(max_examples=scaled_examples(25), deadline=None)
@given(data=st.data())
def test_device_plan_equals_the_host_planner(backend, ratio, data):
    rings, starts, lengths, ring_size, span, num_rings = data.draw(raw_steps(ratio))
    device = device_of(backend)
    comp = CompressorState(torch.zeros(num_rings * ring_size, 4, device=device), torch.zeros(ratio, 2, device=device),
                           ratio, ring_size=ring_size)
    plan = comp.plan_raw(rings, starts, lengths, span, device)
    sources, writes, anchors, event_requests = plan_raw_reference(rings, starts, lengths, ratio, ring_size, span)
    assert torch.equal(plan.sources.cpu(), sources)
    assert torch.equal(plan.writes.cpu(), writes)
    assert torch.equal(plan.anchors.cpu(), anchors) and torch.equal(plan.host_anchors, anchors)
    assert plan.host_anchors.device.type == "cpu"
    assert torch.equal(plan.event_requests.cpu(), event_requests)


def test_device_plan_refuses_ring_ids_as_the_host_planner_did(backend):
    device = device_of(backend)
    comp = CompressorState(torch.zeros(3 * 8, 32, device=device), torch.zeros(4, 16, device=device), 4, ring_size=8)
    with pytest.raises(IndexError, match=r"`rings` has 1 ring ids, position 8 needs id 1 \(ring_span 8\)"):
        comp.plan_raw([[0]], [0], [9], 8, device)  # the write of position 8
    with pytest.raises(IndexError, match=r"`rings` has 0 ring ids, position 2 needs id 0"):
        comp.plan_raw([[]], [2], [1], 8, device)  # the read of position 2 (entry 0's window)
    with pytest.raises(IndexError, match="ring 3 is outside state"):
        comp.plan_raw([[0], [3]], [0, 0], [1, 1], None, device)
    with pytest.raises(TypeError, match="`rings`"):
        comp.plan_raw([[0, 1.5]], [6], [3], 8, device)
    # A request with nothing to read or write names no ring: nothing to check.
    plan = comp.plan_raw([[]], [5], [0], None, device)
    assert plan.sources.shape == (0, 8) and plan.writes.shape == (0, 2)


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a call runs, and the host tensors it copies to another device."""

    def __init__(self):
        super().__init__()
        self.ops, self.host_to_device = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(func)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            dst = kwargs.get("device") if func is torch.ops.aten._to_copy.default else args[0].device
            if src.device.type == "cpu" and dst is not None and torch.device(dst).type != "cpu":
                self.host_to_device.append(src.numel())
        return func(*args, **kwargs)


@pytest.mark.no_backend("runs on meta tensors: no kernel runs and no device value can be read back")
@pytest.mark.parametrize("ratio, with_store, online", [(4, False, False), (4, True, False), (128, False, False),
                                                     (128, True, False), (128, False, True)],
                         ids=["c4", "c4-store", "c128", "c128-store", "c128-online"])
def test_a_step_plan_reads_nothing_back_and_costs_the_same_at_any_length(ratio, with_store, online):
    """The step on meta tensors: any read of a device value (.item(), .tolist(), a copy to the host)
    raises there. The ops it runs, and its one host-to-device copy (the raw ring: of its per-request
    numbers, the same size), are the same for 256 tokens and 32k: no work per token or event."""
    from sparsekv.jit_kernel.dsv4 import StoreTarget
    from sparsekv.rope import RopeTable

    meta, d = torch.device("meta"), 512
    coff = 2 if ratio == 4 else 1
    state = torch.empty(4 * 256, 2 * coff * d, device=meta)
    comp = CompressorState(state, torch.empty(ratio, coff * d, device=meta), ratio, ring_size=256, online=online)
    comp.staging.reserve(4096)  # the staging buffer of the largest step, once (as before a capture)
    store = {}
    if with_store:
        meta_rope = RopeTable(torch.empty(32768, 32, device=meta), torch.empty(32768, 32, device=meta))
        target = StoreTarget(torch.empty(600, 584 * 64, dtype=torch.uint8, device=meta), torch.empty(d, device=meta),
                             1e-6, 64, meta_rope)
        store = dict(store=target, entry_slots=lambda _b, anchor: anchor // ratio)
    logs = []
    for tokens in (256, 32768):
        kv = torch.empty(2 * tokens, coff * d, device=meta)
        log = _OpLog()
        with log:
            none_or_entries, anchors = comp.extend([0, 1], [[1], [2]], [0, 0], kv, kv, lengths=[tokens, tokens],
                                                   **store)
        comp.release(0), comp.release(1)
        assert anchors.device.type == "cpu" and anchors.shape == (2 * (tokens // ratio),)
        assert (none_or_entries is None) == with_store
        logs.append(log)
    assert [str(op) for op in logs[0].ops] == [str(op) for op in logs[1].ops]
    assert len(logs[0].host_to_device) == len(logs[1].host_to_device) == 1
    if not online:  # the raw ring's per-request block; the online fold's segment table is 7 ints per 128 tokens
        assert logs[0].host_to_device == logs[1].host_to_device


@pytest.mark.gpu
def test_a_step_on_the_gpu_never_synchronizes(backend):
    """On a GPU: extend (raw ring with and without the fused store, and the online fold) under
    set_sync_debug_mode("error"): no read-back and no copy from pageable memory (which synchronizes)."""
    if backend != "cuda":
        skip_for_gpu("set_sync_debug_mode is CUDA's; on the host the meta-tensor test above shows the same")
    from sparsekv.jit_kernel.dsv4 import RopeParams, StoreTarget
    from sparsekv.kv_layout import V4

    device, d, t = torch.device(device_of(backend)), 512, 300
    kv, weight = torch.randn(t, 2 * d, device=device), torch.rand(d, device=device) + 0.5
    store = StoreTarget(torch.zeros(4, V4.page_bytes(64), dtype=torch.uint8, device=device), weight, 1e-6, 64,
                        RopeParams(10000).table(t, device))
    c4 = CompressorState(torch.zeros(4 * 16, 4 * d, device=device), torch.randn(4, 2 * d, device=device), 4, 16)
    online = CompressorState(torch.zeros(4 * 256, 2 * d, device=device), torch.randn(128, d, device=device), 128,
                             256, online=True)
    c4.extend([0], [[1]], [0], kv[:10], kv[:10])  # loads the modules before the checked calls
    online.extend([0], [[1]], [0], kv[:10, :d], kv[:10, :d])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        c4.extend([0, 1], [[1], [2]], [10, 0], kv[10:], kv[10:], lengths=[t - 20, 10], store=store,
                  entry_slots=lambda b, anchor: anchor // 4 - 2 + 80 * b)
        c4.extend([0], [[1]], [t - 10], kv[:5], kv[:5])
        online.extend([0], [[1]], [10], kv[10:, :d], kv[10:, :d])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# ---- device-planned decode step -------------------------------------------------------------


def test_the_device_check_of_decode_rows_reads_only_the_rows_a_step_uses(backend):
    # What SPARSEKV_CHECK_INDICES=1 runs for CUDA tables, here on the backend's device.
    device = device_of(backend)
    rows = torch.arange(16, device=device).reshape(2, 8)
    rows[1, :5] = -1  # position 2: its window starts 5 rows before the sequence, never read
    check_decode_rows_on_device(rows, torch.tensor([9, 2], device=device), 16)
    rows[1, 5] = 16
    with pytest.raises(IndexError, match=r"`state_rows`\[1, 5\] = 16 is outside state \[0, 16\)"):
        check_decode_rows_on_device(rows, torch.tensor([9, 2], device=device), 16)
    with pytest.raises(IndexError, match=r"`positions`\[0\] = -1"):
        check_decode_rows_on_device(rows, torch.tensor([-1, 2], device=device), 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_results_do_not_depend_on_the_thread_count(backend):
    # 1024 tokens of C4 at d = 512 read 16 MiB: enough for the cpu backend to split the events over
    # two threads (one chunk per 4 MiB). Planted bug this catches: a chunk bound that skips or
    # repeats items, or an item shared by two threads.
    t, d, ratio = 1024, 512, 4
    gen = torch.Generator().manual_seed(7)
    shapes = ((t, 2 * d), (t, 2 * d), (ratio, 2 * d))
    kv, score, ape = (torch.randn(shape, generator=gen).to(device_of(backend)) for shape in shapes)
    with torch_threads(1):
        one = compress_pool(kv, score, ape, ratio).cpu()
    with torch_threads(2):
        two = compress_pool(kv, score, ape, ratio).cpu()
    assert torch.equal(one, two)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
def test_rows_off_a_16_byte_boundary_pool_to_the_same_bits(backend, ratio):
    # The GPU pools 16-byte aligned rows 4 channels a lane (C4 the window held in registers, C128 the
    # window split over a CTA's warps, the terms added up in slot order), and other rows (here kv, a
    # view one float into a wider buffer) a channel a lane, the window streamed: the same floats
    # either way. d = 40: the lanes past d store nothing. Planted bugs this catches: one form pooling a
    # channel's slots in another order (C128: two slots of a round swapped in the in-order sum).
    device, coff, d = device_of(backend), (2 if ratio == 4 else 1), 40
    gen = torch.Generator().manual_seed(ratio)
    buffer = torch.randn(3 * ratio, coff * d + 1, generator=gen).to(device)
    score = (torch.randn(3 * ratio, coff * d, generator=gen) * 4).to(device)
    ape = torch.randn(ratio, coff * d, generator=gen).to(device)
    shifted = compress_pool(buffer[:, 1:], score, ape, ratio)
    assert torch.equal(shifted.cpu(), compress_pool(buffer[:, 1:].contiguous(), score, ape, ratio).cpu())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", RATIOS)
@settings(max_examples=scaled_examples(4), deadline=None)
@given(data=st.data())
def test_decode_steps_write_each_token_into_its_ring_row_and_emit_the_one_shot_entries(backend, ratio, data):
    """compress_decode, a token per request per step after a prefill: the new token's kv and score land in
    ring row ``state_rows[b, W - 1]`` (its position's row) and no other row changes; a token that completes
    an entry emits compress_pool's entry over the request's whole sequence. Planted bug this catches: the
    step writing its token into the row of ``W - 2`` (the previous token's row)."""
    device = device_of(backend)
    window, coff, d = window_of(ratio), (2 if ratio == 4 else 1), 8
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    batch, ring_size = 2, window
    prefix = [data.draw(st.integers(0, 2 * ratio), label="prefix") for _ in range(batch)]
    steps = data.draw(st.integers(1, ratio + 2 if ratio == 4 else 3), label="steps")
    if ratio == 128:  # the steps cross an entry boundary at least once
        prefix = [128 * n - 1 - data.draw(st.integers(0, steps - 1)) for n in (1, 2)]
    total = max(prefix) + steps
    kv, score = torch.randn(batch, total, coff * d, generator=gen), torch.randn(batch, total, coff * d, generator=gen)
    ape = torch.randn(ratio, coff * d, generator=gen).to(device)
    state = torch.zeros(batch * ring_size, 2 * coff * d, device=device)
    CompressorState(state, ape, ratio, ring_size=ring_size).extend(
        [0, 1], [[0], [1]], [0, 0], torch.cat([kv[b, :n] for b, n in enumerate(prefix)]).to(device),
        torch.cat([score[b, :n] for b, n in enumerate(prefix)]).to(device), lengths=prefix)
    for step in range(steps):
        pos = [n + step for n in prefix]
        state_rows = torch.tensor([[b * ring_size + (p - window + 1 + j) % ring_size for j in range(window)]
                                   for b, p in enumerate(pos)])
        before = state.cpu().clone()
        out, emitted = compress_decode(*_on(backend, torch.stack([kv[b, p] for b, p in enumerate(pos)]),
                                            torch.stack([score[b, p] for b, p in enumerate(pos)])), ape, ratio, state,
                                       state_rows.to(device), torch.tensor(pos).to(device))
        expected = before.clone()
        for b, p in enumerate(pos):
            expected[b * ring_size + p % ring_size] = torch.cat([kv[b, p], score[b, p]])
        assert torch.equal(state.cpu(), expected)
        assert emitted.cpu().tolist() == [(p + 1) % ratio == 0 for p in pos]
        for b, p in enumerate(pos):
            if (p + 1) % ratio == 0:
                one_shot = compress_pool(*_on(backend, kv[b, : p + 1], score[b, : p + 1]), ape, ratio)[-1]
                torch.testing.assert_close(out[b].cpu(), one_shot.cpu(), rtol=1e-5, atol=1e-6)

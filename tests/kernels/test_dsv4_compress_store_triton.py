"""The Triton twin of the fused compress-store (``impl="triton"``; V4 and both indexer caches, aligned
or not), in a prefill step and
a device-planned decode step: streamed in chunks through ``CompressorState.extend`` (and one decode
step of a batch through ``compress_decode_step``), it stores exactly the bytes of its own pooled entries through the
torch store oracle (bf16, RMSNorm in the team order, RoPE, the V4 quantizer), writes the header's
ring rows, and equals the header's bytes wherever the pooled entries agree (always on a GPU: the same
``expf``; under the interpreter numpy's ``exp`` can move a pooled float by an ulp). Bad input is
refused with the header's exception type and message, nothing written. On CPU tensors the twin runs
under the Triton interpreter (``tests/conftest.py``), at small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import RopeParams, StoreTarget, compress_decode_step, compress_pool
from sparsekv.jit_kernel.dsv4_compress_store import compress_store_step
from sparsekv.kv_layout import V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import device_of, to_backend, triton_examples
from sparsekv.testing.profiles import values_to_draw
from sparsekv.testing.reference.dsv4_store import ENTRY_DIMS, LAYOUTS, norm_rope_store_reference

pytestmark = pytest.mark.usefixtures("triton_runs_here")

D, PAGE = 512, 4
KINDS = {kind: (LAYOUTS[kind], dim) for kind, dim in ENTRY_DIMS.items()}
ROPE = RopeParams(160000, 16, 65536, 32, 1)


# C128 pools a 128-row window: under the interpreter its event costs about ten C4 events (4 s). The
# default profile draws C4 (every kind, ring dtype, alignment and chunking) and runs C128's own paths
# (window 128, no overlap, one half per slot, a window carried in the ring) in the pinned C128 tests
# below; --slow draws C128 too.
RATIOS = values_to_draw([4], [128])


@settings(max_examples=triton_examples(), deadline=None)
@given(kind=st.sampled_from(list(KINDS)), ratio=st.sampled_from(RATIOS), ring_bf16=st.booleans(),
       aligned=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_triton_fused_store_writes_its_entries_bytes_and_the_header_ring(backend, kind, ratio, ring_bf16, aligned,
                                                                         seed, data):
    t = data.draw(st.integers(ratio, 2 * ratio + 3))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, t - 1), max_size=2)) + [0, t]))
    check_fused_store(backend, kind, ratio, ring_bf16, aligned, seed, cuts)


def test_triton_fused_store_at_c128_pools_a_window_half_read_back_from_the_ring(backend):
    # One event (anchor 0) over two chunks: its first 64 rows come back from the ring, row 128 goes in.
    # A float32 ring, an unaligned cache (a bf16 ring costs twice as much here; the C4 draws take it).
    check_fused_store(backend, "V4", 128, ring_bf16=False, aligned=False, seed=128, cuts=[0, 64, 129])


def check_fused_store(backend, kind, ratio, ring_bf16, aligned, seed, cuts):
    """``cuts[-1]`` tokens streamed through both implementations in the chunks ``cuts`` bound: equal
    rings, the twin's bytes those of its own entries through the store oracle, and the header's bytes
    where the pooled entries agree."""
    device = device_of(backend)
    coff = 2 if ratio == 4 else 1
    layout, dim = KINDS[kind]
    t = cuts[-1]
    g = torch.Generator().manual_seed(seed)
    kv, score = torch.randn(t, coff * dim, generator=g), torch.randn(t, coff * dim, generator=g) * 3
    ape, weight = torch.randn(ratio, coff * dim, generator=g), torch.rand(dim, generator=g) + 0.5
    kv, score, ape, weight = to_backend(backend, [kv, score, ape, weight])
    rope = ROPE.table(4 * ratio, device)
    ring = 2 * (8 if ratio == 4 else 128)
    dtype = torch.bfloat16 if ring_bf16 else torch.float32
    caches, states = {}, {}
    for impl in ("header", "triton"):
        # The twin's pages sit in a wider buffer, one byte in when not `aligned`: its record goes out
        # byte by byte. The header writes whole 16-byte words and refuses a page off a 16-byte
        # boundary, so it takes dense pages.
        pages = torch.zeros(4, layout.page_bytes(PAGE) + 1, dtype=torch.uint8, device=device)
        caches[impl] = pages[:, :-1].clone() if impl == "header" else pages[:, :-1] if aligned else pages[:, 1:]
        states[impl] = torch.zeros(2 * ring, 2 * coff * dim, dtype=dtype, device=device)
        comp = CompressorState(states[impl], ape, ratio, ring_size=ring)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            comp.extend([0], [[1]], [lo], kv[lo:hi], score[lo:hi], impl=impl,
                        store=StoreTarget(caches[impl], weight, 1e-6, PAGE, rope, kind),
                        entry_slots=lambda _b, anchor: anchor // ratio)
    assert torch.equal(states["triton"].cpu(), states["header"].cpu())
    # The twin's own entries (a bf16 ring pools the bf16-rounded sequence) through the store oracle.
    rows = [x.bfloat16().float() if ring_bf16 else x for x in (kv, score)]
    entries = {impl: compress_pool(*rows, ape, ratio, impl=impl).cpu() for impl in ("header", "triton")}
    anchors = torch.arange(entries["triton"].shape[0]) * ratio
    expected = torch.zeros_like(caches["triton"]).cpu()
    norm_rope_store_reference(entries["triton"], weight.cpu(), 1e-6, anchors, expected, anchors // ratio, PAGE,
                              rope.cos.cpu(), rope.sin.cpu(), kind)
    assert torch.equal(caches["triton"].cpu(), expected)
    assert expected.count_nonzero() > 0
    if device.type == "cuda" or torch.equal(entries["triton"], entries["header"]):
        assert torch.equal(caches["triton"].cpu(), caches["header"].cpu())


def _args():
    """A valid C4 step over d = 512: one event (kv rows 0-3 in its B half), two ring writes."""
    g = torch.Generator().manual_seed(1)
    return dict(kv=torch.randn(4, 1024, generator=g), score=torch.randn(4, 1024, generator=g),
                ape=torch.randn(4, 1024, generator=g), ratio=4, state=torch.zeros(8, 2048),
                sources=torch.tensor([[-1, -1, -1, -1, 0, 1, 2, 3]]), writes=torch.tensor([[0, 0], [1, 1]]),
                positions=torch.tensor([0]), slots=torch.tensor([2]),
                target=dict(cache=torch.full((2, V4.page_bytes(PAGE)), 7, dtype=torch.uint8),
                            weight=torch.ones(D), eps=1e-6, page_slots=PAGE))


BAD = [
    lambda a: a.update(kv=a["kv"].double()),
    lambda a: a.update(score=a["score"][:3]),
    lambda a: a.update(ape=a["ape"][:, :512]),
    lambda a: a.update(ratio=128),
    lambda a: a.update(state=a["state"].half()),
    lambda a: a.update(state=a["state"][:, :1024]),
    lambda a: a.update(sources=a["sources"].int()),
    lambda a: a.update(sources=a["sources"][:, :4].contiguous()),
    lambda a: a.update(sources=torch.tensor([[-1, -1, -1, -1, 0, 1, 2, 4]])),
    lambda a: a.update(sources=torch.tensor([[-1, -1, -1, -1, 0, 1, 2, -11]])),
    lambda a: a.update(writes=torch.tensor([[0, 0], [1, 8]])),
    lambda a: a.update(writes=torch.tensor([[0, 0, 1]])),
    lambda a: a.update(kv=a["kv"][:, :256], score=a["score"][:, :256], ape=a["ape"][:, :256].contiguous(),
                       state=a["state"][:, :512].contiguous()),
    lambda a: a["target"].update(weight=torch.ones(128)),
    lambda a: a.update(positions=torch.tensor([0, 4])),
    lambda a: a.update(positions=torch.tensor([64])),
    lambda a: a.update(slots=torch.tensor([8])),
    lambda a: a.update(slots=torch.tensor([2, 2]), positions=torch.tensor([0, 4]),
                       sources=torch.tensor([[-1, -1, -1, -1, 0, 1, 2, 3]] * 2)),
    lambda a: a["target"].update(eps=-1.0),
    lambda a: a["target"].update(page_slots=3),
    lambda a: a["target"].update(cache=a["target"]["cache"][:, :100]),
    lambda a: a["target"].update(weight=a["target"]["cache"].view(torch.float32).flatten()[:D]),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_triton_refuses_what_the_header_refuses_with_the_same_error_and_writes_nothing(backend, case):
    refusals = []
    for impl in ("header", "triton"):
        args = _args()
        BAD[case](args)
        args = to_backend(backend, args)
        target = to_backend(backend, args.pop("target"))
        rope = ROPE.table(64, device_of(backend))
        before = [t.clone() for t in (args["state"], target["cache"])]
        with pytest.raises((TypeError, ValueError, IndexError)) as refused:
            compress_store_step(**args, target=StoreTarget(**target, rope=rope), impl=impl)
        assert torch.equal(args["state"], before[0]) and torch.equal(target["cache"], before[1])
        refusals.append((refused.type, str(refused.value)))
    assert refusals[0] == refusals[1]


# ---- the device-planned decode step (compress_decode_step with a store) ---------------------------


def _decode_step(ratio, seed, positions, ring_dtype, rows_dtype, dim=D):
    """One decode step of ``len(positions)`` rows over a random ring (float32 or bf16): its arguments."""
    coff, window = (2 if ratio == 4 else 1), (8 if ratio == 4 else 128)
    g = torch.Generator().manual_seed(seed)
    batch, ring = len(positions), window + 3
    rows = [[b * ring + (p - window + 1 + j) % ring for j in range(window)] for b, p in enumerate(positions)]
    return dict(kv=torch.randn(batch, coff * dim, generator=g), score=torch.randn(batch, coff * dim, generator=g) * 3,
                ape=torch.randn(ratio, coff * dim, generator=g), ratio=ratio,
                state=torch.randn(batch * ring, 2 * coff * dim, generator=g).to(ring_dtype),
                state_rows=torch.tensor(rows, dtype=rows_dtype), positions=torch.tensor(positions),
                entry_slots=torch.tensor([5 - b for b in range(batch)]),
                out=torch.full((batch, dim), 9.0), emitted=torch.zeros(batch, dtype=torch.bool))


@settings(max_examples=triton_examples(), deadline=None)
@given(kind=st.sampled_from(list(KINDS)), ratio=st.sampled_from(RATIOS),
       ring_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       rows_dtype=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_triton_decode_step_matches_the_header_and_stores_its_entries_bytes(backend, kind, ratio, ring_dtype,
                                                                            rows_dtype, seed, data):
    near = [ratio - 1, 2 * ratio - 1, ratio, 3, 5 * ratio - 1]
    positions = data.draw(st.lists(st.sampled_from(near), min_size=1, max_size=3))
    check_decode_step(backend, kind, ratio, ring_dtype, rows_dtype, seed, positions)


def test_triton_decode_step_at_c128_emits_an_entry_from_127_ring_rows_and_its_token(backend):
    # One row (a row costs 128 slots under the interpreter); the C4 draws mask slots before position 0.
    check_decode_step(backend, "V4", 128, torch.float32, torch.int32, 128, [127])


def check_decode_step(backend, kind, ratio, ring_dtype, rows_dtype, seed, positions):
    """One decode step at ``positions`` through both implementations: equal flags, rings and entries,
    the twin's bytes those of its own entries through the store oracle, the header's where the
    entries agree."""
    device = device_of(backend)
    rope = ROPE.table(8 * ratio, device)
    layout, dim = KINDS[kind]
    weight = to_backend(backend, [torch.rand(dim, generator=torch.Generator().manual_seed(seed)) + 0.5])[0]
    got = {}
    for impl in ("header", "triton"):
        args = to_backend(backend, _decode_step(ratio, seed, positions, ring_dtype, rows_dtype, dim))
        cache = torch.zeros(2, layout.page_bytes(PAGE), dtype=torch.uint8, device=device)
        compress_decode_step(**args, store=StoreTarget(cache, weight, 1e-6, PAGE, rope, kind), impl=impl)
        got[impl] = {name: t.cpu() for name, t in dict(args, cache=cache).items() if isinstance(t, torch.Tensor)}
    header, triton = got["header"], got["triton"]
    emits = torch.tensor([(p + 1) % ratio == 0 for p in positions])
    assert torch.equal(triton["emitted"], emits) and torch.equal(header["emitted"], emits)
    assert torch.equal(triton["state"], header["state"])  # the new tokens' ring rows, nothing else
    assert not triton["out"][~emits].any()
    torch.testing.assert_close(triton["out"], header["out"], atol=1e-5, rtol=1e-5)
    expected = torch.zeros_like(triton["cache"])
    anchors = torch.tensor(positions)[emits] - ratio + 1
    norm_rope_store_reference(triton["out"][emits], weight.cpu(), 1e-6, anchors, expected,
                              triton["entry_slots"][emits], PAGE, rope.cos.cpu(), rope.sin.cpu(), kind)
    assert torch.equal(triton["cache"], expected)
    if device.type == "cuda" or torch.equal(triton["out"], header["out"]):
        assert torch.equal(triton["cache"], header["cache"])


DECODE_BAD = [
    lambda a: a.update(state_rows=a["state_rows"].float()),
    lambda a: a.update(state_rows=a["state_rows"][:, :4].contiguous()),
    lambda a: a.update(positions=torch.tensor([3, -1])),
    lambda a: a.update(positions=a["positions"].int()),
    lambda a: a["state_rows"].__setitem__((0, 7), 40),
    lambda a: a["state_rows"].__setitem__((1, 7), int(a["state_rows"][0, 7])),
    # The first bad slot in row-major order is named (row 0's slot 5, not row 1's slot 0); row 0
    # (position 3) does not read its slots 0-3, so a bad row there is no refusal.
    lambda a: (a["state_rows"].__setitem__((1, 0), 99), a["state_rows"].__setitem__((0, 5), -3),
               a["state_rows"].__setitem__((0, 1), 99)),
    lambda a: a.update(emitted=torch.zeros(2, dtype=torch.int32)),
    lambda a: a.update(out=torch.zeros(2, 128)),
    lambda a: a.update(entry_slots=torch.tensor([5, 8])),
    lambda a: a.update(entry_slots=torch.tensor([3, 3])),
    lambda a: a.update(positions=torch.tensor([3, 7, 11, 15]), entry_slots=torch.tensor([4, 1, 4, 1]),
                       kv=a["kv"].repeat(2, 1), score=a["score"].repeat(2, 1), out=a["out"].repeat(2, 1),
                       emitted=a["emitted"].repeat(2), state_rows=torch.cat([a["state_rows"], a["state_rows"] + 1])),
    lambda a: a.update(positions=torch.tensor([3, 4 * 64 + 3])),
    lambda a: a.update(kv=a["kv"][:, :256], score=a["score"][:, :256], ape=a["ape"][:, :256].contiguous(),
                       state=a["state"][:, :512].contiguous()),
    lambda a: a.update(state=a["state"].half()),
]


@pytest.mark.parametrize("case", range(len(DECODE_BAD)))
def test_triton_decode_refuses_what_the_header_refuses_and_writes_nothing(backend, case):
    refusals = []
    for impl in ("header", "triton"):
        args = _decode_step(4, 0, [3, 7], torch.float32, torch.int64)
        DECODE_BAD[case](args)
        args = to_backend(backend, args)
        cache = to_backend(backend, [torch.full((2, V4.page_bytes(PAGE)), 7, dtype=torch.uint8)])[0]
        weight = torch.ones(D, device=cache.device)
        before = [t.clone() for t in (args["state"], args["out"], args["emitted"], cache)]
        with pytest.raises((TypeError, ValueError, IndexError)) as refused:
            compress_decode_step(**args, store=StoreTarget(cache, weight, 1e-6, PAGE, ROPE.table(64, cache.device)),
                                 impl=impl)
        assert all(torch.equal(a, b) for a, b in zip((args["state"], args["out"], args["emitted"], cache), before))
        refusals.append((refused.type, str(refused.value)))
    assert refusals[0] == refusals[1]


def test_a_triton_decode_step_traces_under_torch_compile_fullgraph_and_writes_eager_bytes(backend):
    # The twins stay torch custom ops: the compressor step with its fused store and the one-shot pool,
    # impl="triton", compiled with fullgraph=True (no graph break) write what the eager calls write.
    device = device_of(backend)
    rope = ROPE.table(64, device)

    def step(args, cache, sequence):
        entries, emitted = compress_decode_step(**args, store=StoreTarget(cache, torch.ones(D, device=device), 1e-6,
                                                                          PAGE, rope), impl="triton")
        return entries, emitted, args["state"], cache, compress_pool(*sequence, 4, impl="triton")

    def fresh():
        args = to_backend(backend, _decode_step(4, 7, [3, 7], torch.float32, torch.int64))
        sequence = [t[:, :64].repeat(4, 1) for t in (args["kv"], args["score"])] + [args["ape"][:, :64].contiguous()]
        return args, torch.zeros(2, V4.page_bytes(PAGE), dtype=torch.uint8, device=device), sequence

    torch._dynamo.reset()
    try:
        traced = torch.compile(step, fullgraph=True, backend="eager")(*fresh())
    finally:
        torch._dynamo.reset()
    for a, b in zip(traced, step(*fresh()), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())

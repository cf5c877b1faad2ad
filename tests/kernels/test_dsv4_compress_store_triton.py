"""The Triton twin of the fused compress-store (``impl="triton"``, the V4 cache): streamed in chunks
through ``CompressorState.extend``, it stores exactly the bytes of its own pooled entries through the
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

from sparsekv.jit_kernel.dsv4 import RopeParams, StoreTarget, compress_pool
from sparsekv.jit_kernel.dsv4_compress_store import compress_store_step
from sparsekv.kv_layout import INDEXER_FP8, V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import device_of, to_backend, triton_examples
from sparsekv.testing.reference.dsv4_store import norm_rope_store_reference

pytestmark = pytest.mark.usefixtures("triton_runs_here")

D, PAGE = 512, 4
ROPE = RopeParams(160000, 16, 65536, 32, 1)


@settings(max_examples=triton_examples(), deadline=None)
@given(ratio=st.sampled_from([4, 128]), ring_bf16=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_triton_fused_store_writes_its_entries_bytes_and_the_header_ring(backend, ratio, ring_bf16, seed, data):
    device = device_of(backend)
    coff = 2 if ratio == 4 else 1
    t = data.draw(st.integers(ratio, 2 * ratio + 3))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, t - 1), max_size=2)) + [0, t]))
    g = torch.Generator().manual_seed(seed)
    kv, score = torch.randn(t, coff * D, generator=g), torch.randn(t, coff * D, generator=g) * 3
    ape, weight = torch.randn(ratio, coff * D, generator=g), torch.rand(D, generator=g) + 0.5
    kv, score, ape, weight = to_backend(backend, [kv, score, ape, weight])
    rope = ROPE.table(4 * ratio, device)
    ring = 2 * (8 if ratio == 4 else 128)
    dtype = torch.bfloat16 if ring_bf16 else torch.float32
    caches, states = {}, {}
    for impl in ("header", "triton"):
        caches[impl] = torch.zeros(4, V4.page_bytes(PAGE), dtype=torch.uint8, device=device)
        states[impl] = torch.zeros(2 * ring, 2 * coff * D, dtype=dtype, device=device)
        comp = CompressorState(states[impl], ape, ratio, ring_size=ring)
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            comp.extend([0], [[1]], [lo], kv[lo:hi], score[lo:hi], impl=impl,
                        store=StoreTarget(caches[impl], weight, 1e-6, PAGE, rope),
                        entry_slots=lambda _b, anchor: anchor // ratio)
    assert torch.equal(states["triton"].cpu(), states["header"].cpu())
    # The twin's own entries (a bf16 ring pools the bf16-rounded sequence) through the store oracle.
    rows = [x.bfloat16().float() if ring_bf16 else x for x in (kv, score)]
    entries = {impl: compress_pool(*rows, ape, ratio, impl=impl).cpu() for impl in ("header", "triton")}
    anchors = torch.arange(entries["triton"].shape[0]) * ratio
    expected = torch.zeros_like(caches["triton"]).cpu()
    norm_rope_store_reference(entries["triton"], weight.cpu(), 1e-6, anchors, expected, anchors // ratio, PAGE,
                              rope.cos.cpu(), rope.sin.cpu())
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
                            weight=torch.ones(D), eps=1e-6, page_size=PAGE))


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
    lambda a: a["target"].update(page_size=3),
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


def test_the_indexer_caches_have_no_twin_and_say_so(backend):
    args = to_backend(backend, _args())
    del args["target"]
    args.update(to_backend(backend, dict(kv=args["kv"][:, :256].contiguous(), score=args["score"][:, :256].contiguous(),
                                         ape=args["ape"][:, :256].contiguous(), state=torch.zeros(8, 512))))
    cache = to_backend(backend, [torch.zeros(2, INDEXER_FP8.page_bytes(PAGE), dtype=torch.uint8)])[0]
    target = StoreTarget(cache, torch.ones(128, device=cache.device), 1e-6, PAGE, ROPE.table(64, cache.device),
                         "INDEXER_FP8")
    with pytest.raises(ValueError, match="`cache_kind` 'INDEXER_FP8' has no Triton twin"):
        compress_store_step(**args, target=target, impl="triton")
    assert not cache.any() and not args["state"].any()
    compress_store_step(**args, target=target, impl="header")  # the header stores it
    assert cache.any()

"""The Triton twin of ``compress_pool`` (``impl="triton"``, C4 and C128): entries against the fp64
reference and against the header on identical inputs, within the documented tolerance (the
exponential is the one operation that can round differently: numpy's ``exp`` under the interpreter,
glibc's ``expf`` in the cpu header), bit for bit against the cuda header on a GPU (libdevice's
``expf``, the same order of explicitly rounded steps), and the same refusals of bad input as the
header's (type and message) with nothing written. On CPU tensors the twin runs under the Triton
interpreter (``tests/conftest.py``), at small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import compress_pool
from sparsekv.testing.backends import device_of, to_backend, triton_examples
from sparsekv.testing.reference.dsv4_compress import compress_pool_reference
from sparsekv.testing.strategies.dsv4_compress import sequence

pytestmark = pytest.mark.usefixtures("triton_runs_here")

#: The documented tolerance of both implementations against the fp64 reference, and between them.
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def pooled(backend: str, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, impl: str):
    return compress_pool(*to_backend(backend, [kv, score, ape]), ratio, impl=impl).cpu()


@settings(max_examples=triton_examples(), deadline=None)
@given(ratio=st.sampled_from([4, 128]), data=st.data())
def test_triton_entries_match_the_reference_and_the_header(backend, ratio, data):
    kv, score, ape = data.draw(sequence(ratio, max_tokens=2 * ratio + 5, widths=(8, 40, 96)))
    got = pooled(backend, kv, score, ape, ratio, "triton")
    header = pooled(backend, kv, score, ape, ratio, "header")
    assert got.shape == header.shape == (kv.shape[0] // ratio, kv.shape[1] // (2 if ratio == 4 else 1))
    torch.testing.assert_close(got.double(), compress_pool_reference(kv, score, ape, ratio), **TOLERANCE)
    torch.testing.assert_close(got, header, **TOLERANCE)
    if device_of(backend).type == "cuda":
        assert torch.equal(got, header)  # libdevice's expf is the header's; every other step is rounded alike


@pytest.mark.parametrize("ratio, d", [(4, 512), (128, 128)])
def test_triton_entries_at_the_model_widths_and_an_unaligned_view(backend, ratio, d):
    # The model's widths (several channel blocks for d = 512), rows of a wider buffer (row stride >
    # width), and C4's entry 0 (no A half) next to entries that read both halves.
    coff = 2 if ratio == 4 else 1
    g = torch.Generator().manual_seed(d)
    t = 3 * ratio if ratio == 4 else ratio + 3
    buffer = torch.randn(t, coff * d + 8, generator=g)
    kv, score = buffer[:, 3:3 + coff * d], torch.randn(t, coff * d, generator=g) * 4
    ape = torch.randn(ratio, coff * d, generator=g)
    got = pooled(backend, kv, score, ape, ratio, "triton")
    torch.testing.assert_close(got.double(), compress_pool_reference(kv, score, ape, ratio), **TOLERANCE)
    torch.testing.assert_close(got, pooled(backend, kv, score, ape, ratio, "header"), **TOLERANCE)


def _bad_inputs():
    kv, score, ape = torch.randn(8, 16), torch.randn(8, 16), torch.randn(4, 16)
    out = torch.full((2, 8), 7.0)
    return [
        dict(kv=kv.double(), score=score, ape=ape, ratio=4, out=out),
        dict(kv=kv, score=score[:-1], ape=ape, ratio=4, out=out),
        dict(kv=kv, score=score.int(), ape=ape, ratio=4, out=out),
        dict(kv=kv, score=score, ape=ape[:3], ratio=4, out=out),
        dict(kv=kv, score=score, ape=ape.half(), ratio=4, out=out),
        dict(kv=kv, score=score, ape=ape.t().contiguous().t(), ratio=4, out=out),
        dict(kv=kv[:, :15], score=score[:, :15], ape=ape[:, :15], ratio=4, out=out),
        dict(kv=kv[:, ::2], score=score[:, ::2], ape=ape[:, ::2].contiguous(), ratio=4, out=torch.zeros(2, 4)),
        dict(kv=kv, score=score, ape=ape, ratio=4, out=torch.zeros(3, 8)),
        dict(kv=kv, score=score, ape=ape, ratio=4, out=torch.zeros(2, 8, dtype=torch.float64)),
        dict(kv=kv, score=score, ape=ape, ratio=4, out=torch.zeros(8, 2).t()),
        dict(kv=kv, score=score, ape=ape, ratio=8, out=out),
        dict(kv=torch.zeros(8), score=score, ape=ape, ratio=4, out=out),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_triton_refuses_what_the_header_refuses_with_the_same_error_and_writes_nothing(backend, case):
    args = to_backend(backend, _bad_inputs()[case])
    refusals = []
    for impl in ("header", "triton"):
        before = args["out"].clone()
        with pytest.raises((TypeError, ValueError, IndexError)) as refused:
            compress_pool(**args, impl=impl)
        assert torch.equal(args["out"], before)
        refusals.append((refused.type, str(refused.value)))
    assert refusals[0] == refusals[1]


def test_triton_refuses_an_output_that_shares_memory_with_an_input_as_the_header_does(backend):
    kv = to_backend(backend, [torch.randn(8, 16)])[0]
    ape = kv[:4].clone()
    refusals = []
    for impl in ("header", "triton"):
        with pytest.raises(ValueError) as refused:
            compress_pool(kv, kv.clone(), ape, 4, out=kv[:2, :8], impl=impl)
        refusals.append(str(refused.value))
    assert refusals[0] == refusals[1] and "`kv` and `out`" in refusals[0]

"""The Triton twins of the lightning indexer (``impl="triton"``): scores against the fp64 reference
(the header's documented tolerance) and against the header on identical inputs; the top-k identical
to the header's (same set, ascending positions, ties toward the lower position; page-table slots).
On CPU tensors they run under the Triton interpreter (``tests/conftest.py``). The refusals of bad
input are compared in ``test_dsv4_indexer.py`` (parametrized by ``impl``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk
from sparsekv.testing.backends import device_of, triton_examples
from sparsekv.testing.reference.dsv4_indexer import decode_indexer_keys, indexer_scores_reference
from sparsekv.testing.strategies.dsv4_indexer import IndexerCase, indexer_case

pytestmark = pytest.mark.usefixtures("triton_runs_here")


def scores_of(case: IndexerCase, backend: str, impl: str) -> torch.Tensor:
    c = case.to(device_of(backend))
    return indexer_scores(c.q, c.weights, c.k_cache, c.page_table, c.positions, page_size=c.page_size,
                          layout=c.layout, impl=impl).cpu()


def score_bound(case: IndexerCase) -> torch.Tensor:
    """Per-row ``sum_h |w_h| |q_h|`` times the largest key norm: the scale of float32 rounding."""
    keys = decode_indexer_keys(case.k_cache, torch.arange(case.k_cache.shape[0] * case.page_size), case.page_size,
                               case.layout)
    return (case.weights.abs().double() * case.q.double().norm(dim=2)).sum(dim=1) * keys.norm(dim=1).max()


def assert_scores_close(case: IndexerCase, got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite) and bool((got[~finite] == float("-inf")).all())
    error = (got.double() - expected.double()).where(finite, torch.zeros(()))
    assert bool((error.abs() <= tol * score_bound(case)[:, None]).all()), float(error.abs().max())


@settings(max_examples=triton_examples())
@given(case=indexer_case(), k=st.integers(1, 40))
def test_triton_scores_and_topk_match_the_reference_and_the_header(backend, case, k):
    got = scores_of(case, backend, "triton")
    expected = indexer_scores_reference(case.q, case.weights, case.k_cache, case.page_table, case.positions,
                                        page_size=case.page_size, layout=case.layout, width=got.shape[1])
    header = scores_of(case, backend, "header")
    # Documented tolerance (both implementations): 1e-5 of sum_h |w_h| |q_h| |k|; from each other, twice it.
    assert_scores_close(case, got, expected, 1e-5)
    assert_scores_close(case, got, header, 2e-5)
    # Top-k of the same scores: identical tokens and slots.
    c = case.to(device_of(backend))
    scores = header.to(c.q.device)
    triton_out = indexer_topk(scores, c.positions, k, page_table=c.page_table, page_size=c.page_size, impl="triton")
    header_out = indexer_topk(scores, c.positions, k, page_table=c.page_table, page_size=c.page_size, impl="header")
    for a, b in zip(triton_out, header_out):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("ties", [False, True])
def test_triton_topk_equals_the_header_on_long_rows_with_ties_and_infinities(backend, ties):
    # Rows longer than one block of the twin (1024), equal scores at the threshold, +-inf and NaN.
    g = torch.Generator().manual_seed(int(ties))
    scores = torch.randn(3, 2500, generator=g)
    if ties:
        scores = torch.round(scores * 2) / 2
        scores[0, :100] = float("inf")
        scores[1, 5:9] = float("nan")
        scores[2, 1000:] = float("-inf")
    positions = torch.tensor([4 * 2500 + 3, 4 * 1200, 4 * 1800 + 1])
    device = device_of(backend)
    for k in (1, 300, 1500, 3000):
        got = indexer_topk(scores.to(device), positions.to(device), k, impl="triton")[0].cpu()
        assert torch.equal(got, indexer_topk(scores.to(device), positions.to(device), k, impl="header")[0].cpu())


def test_memory_sharing_is_refused_with_the_headers_message(backend):
    # The scores written over the query, the tokens over the slots: both refused, same message.
    device = device_of(backend)
    q = torch.randn(2, 4, 128, device=device)
    k_cache = torch.zeros(3, 132 * 4, dtype=torch.uint8, device=device)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=device)
    positions = torch.tensor([30, 12], device=device)
    shared = torch.full((2, 4), 7, dtype=torch.int32, device=device)
    calls = [(indexer_scores, dict(q=q, weights=torch.rand(2, 4, device=device), k_cache=k_cache, page_table=table,
                                   positions=positions, page_size=4, out=q.view(-1)[:16].view(2, 8))),
             (indexer_topk, dict(scores=torch.randn(2, 8, device=device), positions=positions, top_k=4,
                                 page_table=table, page_size=4, out=shared, out_slots=shared))]
    for fn, args in calls:
        messages = []
        for impl in ("header", "triton"):
            with pytest.raises(ValueError, match="must not share memory") as error:
                fn(**args, impl=impl)
            messages.append(str(error.value))
        assert messages[0] == messages[1]

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

from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk, topk_workspace_ints
from sparsekv.testing.allocations import allocations
from sparsekv.testing.backends import device_of, triton_examples
from sparsekv.testing.reference.dsv4_indexer import decode_indexer_keys, indexer_scores_reference
from sparsekv.testing.strategies.dsv4_indexer import IndexerCase, indexer_case, write_indexer_keys

pytestmark = pytest.mark.usefixtures("triton_runs_here")


def scores_of(case: IndexerCase, backend: str, impl: str) -> torch.Tensor:
    c = case.to(device_of(backend))
    return indexer_scores(c.q, c.weights, c.k_cache, c.page_table, c.positions, page_slots=c.page_slots,
                          layout=c.layout, impl=impl).cpu()


def score_bound(case: IndexerCase) -> torch.Tensor:
    """Per-row ``sum_h |w_h| |q_h|`` times the largest key norm: the scale of float32 rounding."""
    keys = decode_indexer_keys(case.k_cache, torch.arange(case.k_cache.shape[0] * case.page_slots), case.page_slots,
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
                                        page_slots=case.page_slots, layout=case.layout, width=got.shape[1])
    header = scores_of(case, backend, "header")
    # Documented tolerance (both implementations): 1e-5 of sum_h |w_h| |q_h| |k|; from each other, twice it.
    assert_scores_close(case, got, expected, 1e-5)
    assert_scores_close(case, got, header, 2e-5)
    # Top-k of the same scores: identical tokens and slots.
    c = case.to(device_of(backend))
    scores = header.to(c.q.device)
    triton_out = indexer_topk(scores, c.positions, k, page_table=c.page_table, page_slots=c.page_slots, impl="triton")
    header_out = indexer_topk(scores, c.positions, k, page_table=c.page_table, page_slots=c.page_slots, impl="header")
    for a, b in zip(triton_out, header_out):
        assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_fp8_scores_hold_the_tolerance_at_every_query_magnitude(backend, q_dtype):
    # The FP8 twin scales each head of q by a power of two into float16's top binade: heads far
    # below float16's normal range (1e-8) or above its largest value (1e5, 3e30) keep the bound
    # (unscaled, the first would lose its low bits and the others overflow to inf).
    g = torch.Generator().manual_seed(7)
    page_slots, pages = 16, 2
    k_cache = torch.zeros(pages, 132 * page_slots, dtype=torch.uint8)
    write_indexer_keys(torch.randn(pages * page_slots, 128, generator=g), k_cache, torch.arange(pages * page_slots),
                       page_slots, "fp8")
    table, positions = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([4 * 32 - 1])
    for magnitude in (1e-8, 1e-3, 1.0, 1e5, 3e30):  # one head a case, so its own size sets the bound
        q = (torch.randn(1, 1, 128, generator=g) * magnitude).to(q_dtype)
        one = IndexerCase(q, torch.rand(1, 1, generator=g) + 0.5, k_cache, table, positions, page_slots, "fp8")
        got = scores_of(one, backend, "triton")
        expected = indexer_scores_reference(q, one.weights, k_cache, table, positions, page_slots=page_slots,
                                            layout="fp8", width=got.shape[1])
        assert_scores_close(one, got, expected, 1e-5)


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


@settings(max_examples=triton_examples())
@given(batch=st.integers(1, 2), width=st.integers(1, 300), k=st.integers(1, 12), chunk=st.sampled_from([8, 32]),
       final=st.sampled_from([16, 64]), ties=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_triton_topk_levels_equal_the_header_and_torch_topk(backend, batch, width, k, chunk, final, ties, seed, data):
    # Small chunk and finish sizes reach the on-chip levels (one or several) and the radix path
    # (k above the chunk) at widths the interpreter runs quickly; the default sizes take these widths whole.
    from sparsekv.jit_kernel.triton import dsv4_indexer as triton_indexer

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, width, generator=g)
    if ties:
        scores = torch.round(scores * 2) / 2
        scores[:, ::7] = float("-inf")
    visible = data.draw(st.lists(st.integers(0, width + 3), min_size=batch, max_size=batch))
    positions = torch.tensor([4 * n - 1 + data.draw(st.integers(0, 3)) for n in visible])  # sees n entries
    table = torch.randint(0, 9, (batch, -(-width // 4) + 1), dtype=torch.int32, generator=g)
    device = device_of(backend)
    header, header_slots = indexer_topk(scores.to(device), positions.to(device), k, page_table=table.to(device),
                                        page_slots=4, impl="header")
    out = torch.empty(batch, k, dtype=torch.int32, device=device)
    out_slots = torch.empty_like(out)
    triton_indexer.indexer_topk(scores.to(device), positions.to(device), out, table.to(device), out_slots, 4,
                                chunk=chunk, final=final)
    assert torch.equal(out.cpu(), header.cpu()) and torch.equal(out_slots.cpu(), header_slots.cpu())
    for b, n in enumerate(min(v, width) for v in visible):  # the same values as torch.topk's (its ties are its own)
        taken = out[b].cpu()
        assert torch.equal(taken[:min(k, n)], taken[:min(k, n)].sort().values) and bool((taken[min(k, n):] == -1).all())
        expected = torch.topk(scores[b, :n], min(k, n)).values.sort().values
        assert torch.equal(scores[b, taken[:min(k, n)].long()].sort().values, expected)


@pytest.mark.parametrize("k", [9, 12, 20, 40])
def test_triton_topk_radix_path_takes_the_first_ties_by_position(backend, k):
    # Explicit examples, not draws: the radix path needs k above the chunk (9 with chunk 8) and a row
    # wider than the finish, and only ties at the threshold tell `equal_rank <= remaining` from `<`.
    # Scores 0..3 repeating: 16 entries of each value, so the k-th largest is tied 16 ways (or, at
    # k = 20 and 40, the threshold falls inside the 2s). The row sees 60 of its 64 entries.
    from sparsekv.jit_kernel.triton import dsv4_indexer as triton_indexer

    width, chunk, final = 64, 8, 16
    assert triton_indexer.topk_plan(width, k, chunk, final) is None  # the radix kernel
    scores = (torch.arange(2 * width) % 4).float().view(2, width)
    scores[1] = scores[1].flip(0)
    positions = torch.tensor([4 * 60 - 1, 4 * width + 2])
    device = device_of(backend)
    out = torch.empty(2, k, dtype=torch.int32, device=device)
    triton_indexer.indexer_topk(scores.to(device), positions.to(device), out, None, None, 4, chunk=chunk, final=final)
    for b, n in enumerate((60, width)):
        # Largest first, ties in position order (a stable sort): the first k, in ascending position.
        order = torch.sort(scores[b, :n], descending=True, stable=True).indices[:k]
        assert out[b].cpu().tolist() == order.sort().values.tolist()
    header = indexer_topk(scores.to(device), positions.to(device), k, impl="header")[0]
    assert torch.equal(out.cpu(), header.cpu())


@pytest.mark.no_backend("the plan is computed in Python")
def test_topk_plan_reads_the_row_once_and_shrinks_each_level_fourfold():
    from sparsekv.jit_kernel.triton import dsv4_indexer as triton_indexer

    # 64k entries, k = 512: one level of 4096-item chunks (16 programs a row), then the finish of 8192.
    assert triton_indexer.topk_plan(65536, 512) == [(65536, 4096)]
    assert triton_indexer.topk_plan(8192, 512) == []
    assert triton_indexer.topk_plan(1 << 20, 2048) == [(1 << 20, 8192), (1 << 18, 8192), (65536, 8192),
                                                         (16384, 8192)]
    assert triton_indexer.topk_plan(65536, 4097) is None  # too large to keep on chip: the radix kernel


def test_memory_sharing_is_refused_with_the_headers_message(backend):
    # The scores written over the query, the tokens over the slots: both refused, same message.
    device = device_of(backend)
    q = torch.randn(2, 4, 128, device=device)
    k_cache = torch.zeros(3, 132 * 4, dtype=torch.uint8, device=device)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device=device)
    positions = torch.tensor([30, 12], device=device)
    shared = torch.full((2, 4), 7, dtype=torch.int32, device=device)
    calls = [(indexer_scores, dict(q=q, weights=torch.rand(2, 4, device=device), k_cache=k_cache, page_table=table,
                                   positions=positions, page_slots=4, out=q.view(-1)[:16].view(2, 8))),
             (indexer_topk, dict(scores=torch.randn(2, 8, device=device), positions=positions, num_top_k=4,
                                 page_table=table, page_slots=4, out=shared, out_slots=shared))]
    for fn, args in calls:
        messages = []
        for impl in ("header", "triton"):
            with pytest.raises(ValueError, match="must not share memory") as error:
                fn(**args, impl=impl)
            messages.append(str(error.value))
        assert messages[0] == messages[1]


def test_triton_topk_keeps_its_scratch_in_the_given_workspace_and_allocates_nothing(backend):
    # Rows past the finish's 8192 items take one on-chip level: its lists live in the workspace (the
    # sentinel is overwritten by each chunk's positions) and the tokens are the header's. On a GPU the
    # profiler sees no allocation (under the interpreter the interpreter's own copies would show).
    device = device_of(backend)
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 9000, generator=g).to(device)
    positions = torch.tensor([4 * 9000, 4 * 5000], device=device)
    k = 8
    need = topk_workspace_ints(2, 9000, k, "triton")
    assert need == 2 * 2 * 3 * k  # keys and positions of 3 chunks of 4096 per row
    workspace = torch.full((need,), -7, dtype=torch.int32, device=device)
    out = torch.empty(2, k, dtype=torch.int32, device=device)
    indexer_topk(scores, positions, k, out=out, workspace=workspace, impl="triton")
    assert torch.equal(out.cpu(), indexer_topk(scores, positions, k, impl="header")[0].cpu())
    chunk_positions = workspace[need // 2:].view(2, 3, k).cpu()
    assert bool((chunk_positions[0] >= 0).all())  # row 0 sees all 9000 entries: every chunk keeps k
    if backend == "cuda":
        assert allocations(lambda: indexer_topk(scores, positions, k, out=out, workspace=workspace,
                                                impl="triton")) == []
    with pytest.raises(ValueError, match="`workspace`"):
        indexer_topk(scores, positions, k, out=out, workspace=workspace[:need - 1], impl="triton")
    with pytest.raises(ValueError, match="`workspace`"):
        indexer_topk(scores, positions, k, out=out, workspace=out.view(-1), impl="header")


@pytest.mark.parametrize("layout", ["fp8", "fp4"])
def test_a_key_cache_off_a_word_boundary_is_refused_by_the_triton_scores_and_served_by_the_header(backend, layout):
    # The twin reads each key's scale as one 4-byte word: a byte-offset view of the cache would be a
    # misaligned load on a GPU, so it is refused, naming `k_cache`, before `out` is touched. The
    # header reads bytes and serves the same view, equal to the aligned copy's scores.
    device = device_of(backend)
    g = torch.Generator().manual_seed(11)
    page_slots, pages = 4, 2
    record = {"fp8": 132, "fp4": 68}[layout]
    aligned = torch.zeros(pages, record * page_slots, dtype=torch.uint8)
    write_indexer_keys(torch.randn(pages * page_slots, 128, generator=g), aligned, torch.arange(pages * page_slots),
                       page_slots, layout)
    shifted = torch.empty(aligned.numel() + 1, dtype=torch.uint8, device=device)[1:].view_as(aligned)
    shifted.copy_(aligned.to(device))
    q = torch.randn(1, 2, 128, generator=g).to(torch.bfloat16).to(device)
    weights = torch.rand(1, 2, generator=g).to(device)
    table = torch.tensor([[1, 0]], dtype=torch.int32, device=device)
    positions = torch.tensor([4 * 8 - 1], device=device)
    out = torch.full((1, 8), -3.0, device=device)
    with pytest.raises(ValueError, match="`k_cache` and its rows must start on a 4-byte boundary"):
        indexer_scores(q, weights, shifted, table, positions, page_slots=page_slots, layout=layout, out=out,
                       impl="triton")
    assert bool((out == -3.0).all())
    header = indexer_scores(q, weights, shifted, table, positions, page_slots=page_slots, layout=layout,
                            impl="header")
    assert torch.equal(header.cpu(), indexer_scores(q, weights, aligned.to(device), table, positions,
                                                    page_slots=page_slots, layout=layout, impl="header").cpu())

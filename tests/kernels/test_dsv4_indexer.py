"""DSV4 lightning indexer: scores (every test backend) against the fp64 reference, top-k against the
defined selection (and torch.topk), the page-table transform, the properties (scale folding,
causality, page permutations, ties, more rows than a grid dimension) and the bad-input contract."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4_indexer import (
    INDEXER,
    INDEXER_LAYOUTS,
    check_pages_in_use,
    indexer_scores,
    indexer_template_args,
    indexer_topk,
    lightning_indexer,
    topk_workspace_ints,
    visible_entries,
)
from sparsekv.testing.backends import core_backends, device_of, kernel_backends, skip_unless_triton_runs, to_backend
from sparsekv.testing.reference.dsv4_indexer import (
    decode_indexer_keys,
    entry_slots,
    indexer_scores_reference,
    indexer_topk_reference,
    visible_entry_count,
)
from sparsekv.testing.strategies.dsv4_indexer import IndexerCase, indexer_case, score_rows, write_indexer_keys

BACKENDS = kernel_backends()
LAYOUTS = sorted(INDEXER_LAYOUTS)


def scores_of(case: IndexerCase, backend: str) -> torch.Tensor:
    c = case.to(device_of(backend))
    return indexer_scores(c.q, c.weights, c.k_cache, c.page_table, c.positions, page_slots=c.page_slots,
                          layout=c.layout).cpu()


def score_bound(case: IndexerCase) -> torch.Tensor:
    """Per-row ``sum_h |w_h| |q_h|`` times the largest key norm: the scale of float32 rounding."""
    keys = decode_indexer_keys(case.k_cache, torch.arange(case.k_cache.shape[0] * case.page_slots), case.page_slots,
                               case.layout)
    return (case.weights.abs().double() * case.q.double().norm(dim=2)).sum(dim=1) * keys.norm(dim=1).max()


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@pytest.mark.parametrize("layout", LAYOUTS)
@given(data=st.data())
def test_scores_match_the_fp64_reference(backend, layout, data):
    case = data.draw(indexer_case(layout=layout))
    got = scores_of(case, backend)
    expected = indexer_scores_reference(case.q, case.weights, case.k_cache, case.page_table, case.positions,
                                        page_slots=case.page_slots, layout=layout, width=got.shape[1])
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got), finite) and bool((got[~finite] == float("-inf")).all())
    # Documented tolerance: 1e-5 of sum_h |w_h| |q_h| |k|.
    error = (got.double() - expected).where(finite, torch.zeros(()))
    assert bool((error.abs() <= 1e-5 * score_bound(case)[:, None] + 1e-30).all())


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=indexer_case(), data=st.data())
def test_positive_query_scales_fold_into_the_weights(backend, case, data):
    heads = case.q.shape[1]
    # Powers of two: folding is exact, bit for bit. Any positive scale: equal up to rounding.
    exponents = torch.tensor(data.draw(st.lists(st.integers(-6, 6), min_size=heads, max_size=heads)))
    scale = torch.exp2(exponents.double())[None, :].expand(case.q.shape[0], heads)
    q = case.q
    base = IndexerCase(q, case.weights * scale.float(), case.k_cache, case.page_table, case.positions,
                       case.page_slots, case.layout)
    scaled = IndexerCase((q.double() * scale[..., None]).to(q.dtype), case.weights, case.k_cache, case.page_table,
                         case.positions, case.page_slots, case.layout)
    assert torch.equal(scores_of(base, backend), scores_of(scaled, backend))
    ratio = torch.rand(case.q.shape[0], heads, dtype=torch.float64) * 4 + 0.05
    folded = IndexerCase(q.float(), case.weights * ratio.float(), case.k_cache, case.page_table, case.positions,
                         case.page_slots, case.layout)
    unfolded = IndexerCase((q.double() * ratio[..., None]).float(), case.weights, case.k_cache, case.page_table,
                           case.positions, case.page_slots, case.layout)
    a, b = scores_of(folded, backend), scores_of(unfolded, backend)
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b))
    assert bool(((a - b).where(finite, torch.zeros(())).abs() <= 1e-5 * 5 * score_bound(case)[:, None] + 1e-30).all())


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=indexer_case(), seed=st.integers(0, 2**16), num_top_k=st.integers(1, 40))
def test_permuting_cache_pages_with_the_page_table_changes_nothing(backend, case, seed, num_top_k):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(case.k_cache.shape[0], generator=g)  # new page p holds old page perm[p]
    where = torch.argsort(perm).int()  # old page -> new page
    table = torch.where(case.page_table >= 0, where[case.page_table.clamp_min(0).long()], case.page_table)
    moved = IndexerCase(case.q, case.weights, case.k_cache[perm].contiguous(), table, case.positions, case.page_slots,
                        case.layout)
    scores, moved_scores = scores_of(case, backend), scores_of(moved, backend)
    assert torch.equal(scores, moved_scores)
    device = device_of(backend)
    tokens, slots = indexer_topk(scores.to(device), case.positions.to(device), num_top_k,
                                 page_table=case.page_table.to(device), page_slots=case.page_slots)
    tokens2, slots2 = indexer_topk(moved_scores.to(device), case.positions.to(device), num_top_k,
                                   page_table=table.to(device), page_slots=case.page_slots)
    assert torch.equal(tokens.cpu().sort(dim=1).values, tokens2.cpu().sort(dim=1).values)
    # The slots differ, the keys they hold do not.
    for b in range(tokens.shape[0]):
        ours, theirs = slots[b][slots[b] >= 0].cpu(), slots2[b][slots2[b] >= 0].cpu()
        keys = decode_indexer_keys(case.k_cache, ours, case.page_slots, case.layout)
        keys2 = decode_indexer_keys(moved.k_cache, theirs, case.page_slots, case.layout)
        assert torch.equal(keys[tokens[b][tokens[b] >= 0].cpu().argsort()],
                           keys2[tokens2[b][tokens2[b] >= 0].cpu().argsort()])


def check_topk(tokens: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, num_top_k: int) -> None:
    """The one defined answer (ascending positions, ties at the threshold toward the lower position),
    token for token; and, independently of that reference, the same multiset of scores as torch.topk."""
    expected = indexer_topk_reference(scores, positions, num_top_k)
    assert torch.equal(tokens.to(torch.int64), expected)
    visible = visible_entry_count(positions).clamp(max=scores.shape[1])
    for b in range(tokens.shape[0]):
        n = int(visible[b])
        count = min(num_top_k, n)
        picked = tokens[b, :count].to(torch.int64)
        assert bool((picked[1:] > picked[:-1]).all()) and bool((tokens[b, count:] == -1).all())
        theirs = torch.topk(scores[b, :n], count).values.sort().values
        ours = scores[b, picked].sort().values
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)) or torch.equal(ours, theirs)


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@given(rows=score_rows(), num_top_k=st.sampled_from([1, 2, 7, 64, 512, 1024, 2048, 2500]))
def test_topk_is_the_defined_selection_in_ascending_order(backend, rows, num_top_k):
    scores, positions = rows
    device = device_of(backend)
    tokens, slots = indexer_topk(scores.to(device), positions.to(device), num_top_k)
    assert slots is None
    check_topk(tokens.cpu(), scores, positions, num_top_k)


@pytest.mark.sanitizer_case
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_the_threshold_go_to_the_lower_positions(backend):
    # Row 0: all equal, so the first k positions. Rows 1 and 2: two above the threshold at the end of
    # the visible entries, then the lowest positions of the tied rest. The GPU keeps up to 3,072
    # candidates on chip (rows 0 and 1); row 2's 3,198 tied entries take its position-ordered pass
    # over the row, which spans several tiles of 1,024.
    width, num_top_k = 3200, 600
    visible = torch.tensor([3000, 3000, width])
    scores = torch.zeros(3, width)
    for b in (1, 2):
        scores[b, int(visible[b]) - 2:int(visible[b])] = 1.0
    positions = 4 * visible - 1
    device = device_of(backend)
    tokens, _ = indexer_topk(scores.to(device), positions.to(device), num_top_k)
    expected = torch.stack([torch.arange(num_top_k)] + [
        torch.cat([torch.arange(num_top_k - 2), torch.tensor([n - 2, n - 1])]) for n in visible[1:].tolist()])
    assert torch.equal(tokens.cpu().to(torch.int64), expected)


def check_split_workspace(workspace: torch.Tensor, fill: int, backend: str, visible: torch.Tensor, num_top_k: int,
                          splits: int) -> None:
    """The header's split rows used the workspace as designed: on the GPU path (sim, cuda) each row with
    more than ``num_top_k`` visible entries has its first-digit histogram summing to them and all
    ``splits`` CTAs arrived; the cpu backend never touches it."""
    if backend == "cpu":
        assert bool((workspace == fill).all())
        return
    row_words = workspace.numel() // visible.numel()
    for b in range(visible.numel()):
        row = workspace[b * row_words:(b + 1) * row_words].cpu()
        if int(visible[b]) > num_top_k:
            assert int(row[:4096].sum()) == int(visible[b]) and int(row[4096]) == splits


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=score_rows(max_width=20_000), num_top_k=st.sampled_from([1, 7, 512, 600, 2048, 3000, 4000]),
       fill=st.sampled_from([0, -1, 0x7FFFFFFF]))
def test_split_rows_give_the_one_selection_whatever_the_workspace_held(backend, rows, num_top_k, fill):
    # With a workspace the GPU path splits a row of more than 4,096 entries over up to 32 CTAs (one
    # per 4,096 entries), merged by whichever CTA arrives last (the sim runs the CTAs in a shuffled
    # order): the same answer as one CTA a row, ties, -inf / NaN / signed zeros, and rows whose
    # candidates pass the 3,072 kept on chip included. The workspace may hold anything on entry.
    scores, positions = rows
    device = device_of(backend)
    batch, width = scores.shape
    workspace = torch.full((topk_workspace_ints(batch, width, num_top_k),), fill, dtype=torch.int32, device=device)
    num_top_k = min(num_top_k, width)
    tokens, _ = indexer_topk(scores.to(device), positions.to(device), num_top_k, workspace=workspace, impl="header")
    check_topk(tokens.cpu(), scores, positions, num_top_k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["spread ties on chip", "ties past the chip", "top in the last slice",
                                  "top in the first slice"])
def test_split_rows_literal_selections(backend, kind):
    # 3 rows of 12,289 entries: 4 CTAs a row (3 of 3,076 entries, one of 3,061), k = 600.
    width, num_top_k = 12_289, 600
    scores = torch.full((3, width), -1.0)
    if kind == "spread ties on chip":  # 1,000 equal keys, 250 in each slice: the lowest 600 positions
        tied = torch.arange(0, width - 1, 12)[:1000]
        scores[:, tied] = 0.5
        expected = tied[:num_top_k]
    elif kind == "ties past the chip":  # all equal but two: the row read again by the merging CTA
        scores.fill_(0.0)
        scores[:, [5000, width - 1]] = 1.0
        expected = torch.cat([torch.arange(num_top_k - 2), torch.tensor([5000, width - 1])])
    elif kind == "top in the last slice":
        expected = torch.arange(width - num_top_k, width)
        scores[:, expected] = torch.linspace(1.0, 2.0, num_top_k)
    else:
        expected = torch.arange(num_top_k)
        scores[:, expected] = float("inf")
        scores[:, num_top_k:num_top_k + 10] = float("nan")  # above +inf as keys: taken first
        expected = torch.cat([torch.arange(num_top_k - 10), torch.arange(num_top_k, num_top_k + 10)])
    positions = torch.full((3,), 4 * width - 1)
    device = device_of(backend)
    workspace = torch.full((topk_workspace_ints(3, width, num_top_k, "header"),), -1, dtype=torch.int32,
                           device=device)
    tokens, _ = indexer_topk(scores.to(device), positions.to(device), num_top_k, workspace=workspace, impl="header")
    assert torch.equal(tokens.cpu().to(torch.int64), expected.expand(3, -1))
    check_split_workspace(workspace, -1, backend, torch.full((3,), width), num_top_k, splits=4)


def test_a_split_workspace_too_small_or_of_the_wrong_kind_is_refused_before_anything_is_written(backend):
    device = device_of(backend)
    scores, positions = torch.randn(2, 9000, device=device), torch.tensor([4 * 9000 - 1, 400], device=device)
    need = topk_workspace_ints(2, 9000, 512, "header")
    assert need == 2 * (4160 + 2 * 3 * 3000)  # 3 CTAs of 3,000 entries a row
    out = torch.full((2, 512), 7, dtype=torch.int32, device=device)
    workspace = torch.full((need,), 5, dtype=torch.int32, device=device)
    for bad in (workspace[:need - 1], workspace.view(2, -1), workspace[::2], workspace.float(), workspace.long()):
        with pytest.raises(ValueError, match="`workspace`"):
            indexer_topk(scores, positions, 512, out=out, workspace=bad, impl="header")
    assert bool((out == 7).all()) and bool((workspace == 5).all())
    indexer_topk(scores, positions, 512, out=out, workspace=workspace, impl="header")
    check_topk(out.cpu(), scores.cpu(), positions.cpu(), 512)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_of_more_rows_than_a_grid_dimension_holds(backend):
    # 70,000 query rows (a prefill chunk): the cuda launch may not put one row per gridDim.y block.
    rows, page_slots = 70_000, 4
    g = torch.Generator().manual_seed(5)
    layout = INDEXER_LAYOUTS["fp8"]
    cache = torch.randint(0, 0x70, (2, layout.page_bytes(page_slots)), dtype=torch.uint8, generator=g)  # no NaN code
    layout.scale_view(cache, page_slots).view(torch.float32)[:] = 0.5
    case = IndexerCase(torch.randn(rows, 1, 128, generator=g), torch.rand(rows, 1, generator=g), cache,
                       torch.tensor([[0, 1]], dtype=torch.int32).expand(rows, 2).contiguous(),
                       torch.randint(-1, 4 * 2 * page_slots, (rows,), generator=g), page_slots, "fp8")
    got = scores_of(case, backend)
    # Rows are independent: each row equals the same row scored alone, past the 65,535 mark too.
    picked = torch.tensor([0, 1, 65_534, 65_535, 65_536, rows - 1])
    sub = IndexerCase(case.q[picked], case.weights[picked], cache, case.page_table[picked], case.positions[picked],
                      page_slots, "fp8")
    assert torch.equal(got[picked], scores_of(sub, backend))
    expected = indexer_scores_reference(sub.q, sub.weights, cache, sub.page_table, sub.positions,
                                        page_slots=page_slots, layout="fp8", width=got.shape[1])
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(got[picked]), finite)
    error = (got[picked].double() - expected).where(finite, torch.zeros(()))
    assert bool((error.abs() <= 1e-5 * score_bound(sub)[:, None] + 1e-30).all())


@pytest.mark.parametrize("backend", BACKENDS)
@given(rows=score_rows(), num_top_k=st.integers(1, 64))
def test_no_invisible_entry_is_ever_selected(backend, rows, num_top_k):
    # Entries past the visible prefix score highest here: a kernel that looked at them would pick them.
    scores, positions = rows
    visible = visible_entry_count(positions).clamp(max=scores.shape[1])
    poisoned = torch.where(torch.arange(scores.shape[1])[None, :] >= visible[:, None], torch.full((), 1e30), scores)
    device = device_of(backend)
    tokens, _ = indexer_topk(poisoned.to(device), positions.to(device), num_top_k)
    tokens = tokens.cpu()
    assert bool((tokens < visible[:, None]).all())
    assert torch.equal((tokens >= 0).sum(dim=1), visible.clamp(max=num_top_k).to(torch.int64))


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=indexer_case(), num_top_k=st.integers(1, 300))
def test_fused_indexer_slots_are_the_page_transform_of_the_tokens(backend, case, num_top_k):
    c = case.to(device_of(backend))
    tokens, slots = lightning_indexer(c.q, c.weights, c.k_cache, c.page_table, c.positions, num_top_k,
                                      page_slots=c.page_slots, layout=c.layout)
    tokens, slots = tokens.cpu(), slots.cpu()
    scores = scores_of(case, backend)
    check_topk(tokens, scores, case.positions, num_top_k)
    for b in range(tokens.shape[0]):
        valid = tokens[b] >= 0
        assert bool((slots[b][~valid] == -1).all())
        n = int(tokens[b].max()) + 1 if bool(valid.any()) else 0
        assert torch.equal(slots[b][valid].long(), entry_slots(case.page_table[b], n, case.page_slots)[
            tokens[b][valid].long()])


def _fresh():
    g = torch.Generator().manual_seed(3)
    layout = INDEXER_LAYOUTS["fp8"]
    cache = torch.zeros(4, layout.page_bytes(4), dtype=torch.uint8)
    return dict(q=torch.randn(2, 3, 128, generator=g), weights=torch.rand(2, 3, generator=g), k_cache=cache,
                page_table=torch.tensor([[0, 1, 2], [3, 2, -1]], dtype=torch.int32), positions=torch.tensor([40, 20]),
                page_slots=4, layout="fp8", out=torch.full((2, 12), 7.0))


SCORE_BAD_INPUTS = [
    (lambda a: a.update(q=torch.randn(2, 65, 128), weights=torch.rand(2, 65)), ValueError, "q"),
    (lambda a: a.update(q=a["q"].half()), TypeError, "q"),
    (lambda a: a.update(q=a["q"][:, :, :64]), ValueError, "q"),
    (lambda a: a.update(weights=a["weights"][:, :2]), ValueError, "weights"),
    (lambda a: a.update(weights=a["weights"].double()), TypeError, "weights"),
    (lambda a: a.update(layout="fp16"), ValueError, "layout"),
    (lambda a: a.update(layout="fp4"), ValueError, "k_cache"),
    (lambda a: a.update(page_slots=3), ValueError, "page_slots"),
    (lambda a: a.update(page_table=torch.tensor([[0, 1, 4], [3, 2, -1]], dtype=torch.int32)), IndexError,
     "page_table"),
    (lambda a: a.update(page_table=torch.tensor([[0, 1, 2], [3, -1, -1]], dtype=torch.int32)), IndexError,
     "page_table"),
    (lambda a: a.update(positions=torch.tensor([60, 20])), ValueError, "page_table"),
    (lambda a: a.update(page_table=a["page_table"].long()), TypeError, "page_table"),
    (lambda a: a.update(positions=a["positions"].float()), TypeError, "positions"),
    (lambda a: a.update(positions=a["positions"][:1]), ValueError, "positions"),
    (lambda a: a.update(out=a["out"].double()), TypeError, "out"),  # the entry's `scores`, named as passed
]


@pytest.mark.parametrize("impl", ["header", "triton"])
@pytest.mark.parametrize("mutate, exc, name", SCORE_BAD_INPUTS)
def test_bad_score_input_raises_naming_the_argument_and_leaves_out_untouched(backend, index_checks, mutate, exc,
                                                                              name, impl):
    # Both implementations refuse the same inputs with the same exception naming the same argument.
    if impl == "triton":
        skip_unless_triton_runs(backend)
    args = _fresh()
    mutate(args)
    args = to_backend(backend, args)
    before = args["out"].clone()
    with pytest.raises(exc, match=f"`{name}`"):
        indexer_scores(**args, impl=impl)
    assert torch.equal(args["out"], before)


TOPK_BAD_INPUTS = [
    (dict(num_top_k=0), ValueError, "num_top_k"),
    (dict(num_top_k=2.5), TypeError, "num_top_k"),
    (dict(out=torch.zeros(2, 5, dtype=torch.int32)), ValueError, "out"),
    (dict(out=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "out"),
    (dict(out_slots=torch.zeros(2, 4, dtype=torch.int32), page_table=None), ValueError, "out_slots"),
    (dict(page_table=torch.tensor([[0, -1, 2], [1, 0, 0]], dtype=torch.int32)), IndexError, "page_table"),
    (dict(page_table=torch.tensor([[0, 1, 2]], dtype=torch.int32)), ValueError, "page_table"),
    (dict(page_slots=6), ValueError, "page_slots"),
    (dict(scores=torch.zeros(2, 12, dtype=torch.float64)), TypeError, "scores"),
    (dict(positions=torch.tensor([1, 2, 3])), ValueError, "positions"),
]


@pytest.mark.parametrize("impl", ["header", "triton"])
@pytest.mark.parametrize("change, exc, name", TOPK_BAD_INPUTS)
def test_bad_topk_input_raises_naming_the_argument_and_leaves_outputs_untouched(backend, index_checks, change, exc,
                                                                                name, impl):
    if impl == "triton":
        skip_unless_triton_runs(backend)
    args = dict(scores=torch.randn(2, 12), positions=torch.tensor([40, 20]), num_top_k=4,
                page_table=torch.tensor([[0, 1, 2], [1, 0, 0]], dtype=torch.int32), page_slots=4,
                out=torch.full((2, 4), 7, dtype=torch.int32), out_slots=torch.full((2, 4), 7, dtype=torch.int32))
    args.update(change)
    args = to_backend(backend, args)
    outputs = [t.clone() for t in (args["out"], args["out_slots"])]
    with pytest.raises(exc, match=f"`{name}`"):
        indexer_topk(**args, impl=impl)
    assert torch.equal(args["out"], outputs[0]) and torch.equal(args["out_slots"], outputs[1])


@pytest.mark.parametrize("mutate, exc, name", [m for m in SCORE_BAD_INPUTS if (m[2], m[1]) in (
    ("page_table", ValueError), ("page_table", IndexError), ("page_slots", ValueError), ("positions", ValueError),
    ("positions", TypeError))])
def test_the_device_side_page_check_agrees_with_the_host_entry(backend, mutate, exc, name):
    # SPARSEKV_CHECK_INDICES=1 runs this torch check on the GPU; it must refuse what the host entry refuses,
    # naming the same argument (on an H200 a bad page_slots or positions was named as a page_table error).
    args = to_backend(backend, _fresh())
    check_pages_in_use(args["page_table"], args["positions"], args["page_slots"], args["k_cache"].shape[0])
    mutate(args)
    args = to_backend(backend, args)
    with pytest.raises(exc, match=f"`{name}`"):
        check_pages_in_use(args["page_table"], args["positions"], args["page_slots"], args["k_cache"].shape[0])


# Raw position -> visible C4 entries, by hand: entry i closes at raw position 4i + 3.
VISIBLE = {-5: 0, -1: 0, 0: 0, 1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1, 7: 2, 10: 2, 11: 3, 12: 3, 4095: 1024, 4096: 1024,
           4098: 1024, 4099: 1025}


@pytest.mark.no_backend("literal values of the Python helpers")
def test_visible_entry_counts_are_the_literal_values():
    positions = torch.tensor(list(VISIBLE))
    expected = torch.tensor(list(VISIBLE.values()))
    assert torch.equal(visible_entry_count(positions), expected)
    assert torch.equal(visible_entries(positions), expected)  # the wrapper's own (page checks)


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.int64], ids=str)
def test_the_kernel_scores_exactly_the_literal_visible_entries(backend, positions_dtype):
    # One page table row long enough for every literal position: the kernel's own visibility
    # formula (csrc/dsv4_indexer.cuh) decides which entries get a finite score.
    layout, page_slots, width = "fp8", 64, 1100
    pages = -(-width // page_slots)
    g = torch.Generator().manual_seed(4)
    cache = torch.zeros(pages, INDEXER_LAYOUTS[layout].page_bytes(page_slots), dtype=torch.uint8)
    write_indexer_keys(torch.randn(pages * page_slots, 128, generator=g), cache, torch.arange(pages * page_slots),
                       page_slots, layout)
    batch = len(VISIBLE)
    args = to_backend(backend, dict(
        q=torch.randn(batch, 2, 128, generator=g), weights=torch.rand(batch, 2, generator=g), k_cache=cache,
        page_table=torch.arange(pages, dtype=torch.int32).repeat(batch, 1),
        positions=torch.tensor(list(VISIBLE), dtype=positions_dtype), page_slots=page_slots, layout=layout,
        out=torch.zeros(batch, width)))
    indexer_scores(**args)
    finite = torch.isfinite(args["out"].cpu()).sum(dim=1)
    assert finite.tolist() == list(VISIBLE.values())


def test_every_fp4_code_byte_and_scale_byte_decodes_exactly(backend):
    # Row b's two heads are e_b and -e_b, weighted 1 and -1, so its score of entry i is
    # relu(k_i[b]) - relu(-k_i[b]) = k_i[b]: the kernel's decoded key itself, which must equal the
    # fp64 decode bit for bit (e2m1 times a power of two is a bf16). Entry i's byte j is
    # (i + 37 j) % 256, so every dim sees every byte; its block scales are (4 i + k) % 253, every
    # UE8M0 byte whose products stay finite (0: the subnormal 2^-127).
    layout, page_slots, entries = "fp4", 64, 256
    cache_layout = INDEXER_LAYOUTS[layout]
    cache = torch.zeros(entries // page_slots, cache_layout.page_bytes(page_slots), dtype=torch.uint8)
    i = torch.arange(entries)
    values = (i[:, None] + 37 * torch.arange(64)[None, :]) % 256
    scales = (4 * i[:, None] + torch.arange(4)[None, :]) % 253
    cache_layout.value_view(cache, page_slots)[:] = values.to(torch.uint8).view(-1, page_slots, 64)
    cache_layout.scale_view(cache, page_slots)[:] = scales.to(torch.uint8).view(-1, page_slots, 4)
    unit = torch.eye(128)
    args = to_backend(backend, dict(
        q=torch.stack([unit, -unit], dim=1).to(torch.bfloat16), weights=torch.tensor([[1.0, -1.0]]).repeat(128, 1),
        k_cache=cache, page_table=torch.arange(entries // page_slots, dtype=torch.int32).repeat(128, 1),
        positions=torch.full((128,), 4 * entries - 1), page_slots=page_slots, layout=layout,
        out=torch.zeros(128, entries)))
    indexer_scores(**args)
    assert torch.equal(args["out"].cpu(), decode_indexer_keys(cache, i, page_slots, layout).float().T)


@pytest.mark.no_backend("template arguments are computed in Python")
def test_template_args_cover_the_instance_table():
    args = {indexer_template_args(layout, dtype) for layout in LAYOUTS for dtype in (torch.float32, torch.bfloat16)}
    assert args == {INDEXER.template_args(values) for values in INDEXER.instances}
    with pytest.raises(ValueError, match="`layout`"):
        indexer_template_args("int8", torch.float32)


def _fused_bad_topk(args: dict) -> dict[str, tuple[dict, type[Exception], str]]:
    """The sweep's top-k refusals of a lightning_indexer call, which once came after the scores were written."""
    scores = args["scores"]
    return {
        "num_top_k 0": (dict(num_top_k=0), ValueError, "num_top_k"),
        "out of width 4": (dict(out=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "out"),
        "int64 out_slots": (dict(out_slots=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "out_slots"),
        "float32 workspace": (dict(workspace=torch.zeros(64, dtype=torch.float32)), ValueError, "workspace"),
        "scores overlapping out": (dict(out=scores.view(torch.int32)[:, :3]), ValueError, "out"),
        "num_top_k above the row length": (dict(num_top_k=2**16 + 1), ValueError, "num_top_k"),
    }


@pytest.mark.parametrize("impl", ["header", "triton"])
@pytest.mark.parametrize("case", ["num_top_k 0", "out of width 4", "int64 out_slots", "float32 workspace",
                                  "scores overlapping out", "num_top_k above the row length"])
def test_lightning_indexer_checks_the_topk_before_it_writes_the_scores(backend, case, impl):
    # Validate, then write: these were refused by the top-k only after the scores had been written.
    if impl == "triton":
        skip_unless_triton_runs(backend)
    fresh = _fresh()
    args = {k: v for k, v in fresh.items() if k != "out"}
    args.update(scores=torch.full((2, 12), 7.0), num_top_k=3)
    change, exc, name = _fused_bad_topk(args)[case]
    args = to_backend(backend, {**args, **change})
    before = args["scores"].clone()
    with pytest.raises(exc, match=f"`{name}`"):
        lightning_indexer(**args, impl=impl)
    assert torch.equal(args["scores"], before)


#: Changes to the buffers of a lightning_indexer call the top-k checks passed, each refused as a new call
#: is: the change and its undoing, the exception, the argument it names and its words. All but the first
#: keep every tensor object of the call.
_IN_PLACE_CHANGES = {
    "the same shape and strides at another address (inside `scores`)": (
        lambda a: a.update(out_slots=a["scores"].view(torch.int32).view(-1)[:6].view(2, 3)),
        lambda a, kept: a.update(out_slots=kept),
        ValueError, "out_slots", "must not share memory"),
    "resize_ (same address)": (
        lambda a: a["out"].resize_(2, 2), lambda a, _: a["out"].resize_(2, 3), ValueError, "out",
        "must be [B, num_top_k=3]"),
    "as_strided_ (same address and shape)": (
        lambda a: a["out"].as_strided_((2, 3), (1, 2)), lambda a, _: a["out"].as_strided_((2, 3), (3, 1)), ValueError,
        "out", "unit stride"),
    ".data (same address, shape and strides)": (
        lambda a: setattr(a["out"], "data", a["out"].view(torch.float32)),
        lambda a, _: setattr(a["out"], "data", a["out"].view(torch.int32)), TypeError, "out", "int32"),
}


@pytest.mark.parametrize("impl", ["header", "triton"])
def test_a_call_whose_topk_passed_before_is_refused_after_a_buffer_changes_in_place(backend, impl):
    # The Triton top-k's pre-check keeps the calls that passed, by what its checks read: a buffer changed
    # in place after a passing call must be refused as in a new call, before the scores are written.
    # Every call here names a layout the scores refuse, which they check after the top-k's checks: the
    # first call's top-k checks pass (the memo holds them) and no kernel runs (the interpreter's ~1 s).
    if impl == "triton":
        skip_unless_triton_runs(backend)
    args = {k: v for k, v in _fresh().items() if k != "out"}
    args.update(scores=torch.full((2, 12), 7.0), num_top_k=3, out=torch.full((2, 3), 7, dtype=torch.int32),
                out_slots=torch.full((2, 3), 7, dtype=torch.int32), layout="fp16")
    args = to_backend(backend, args)
    with pytest.raises(ValueError, match="`layout` must be one of"):
        lightning_indexer(**args, impl=impl)
    for change, undo, exc, name, words in _IN_PLACE_CHANGES.values():  # each after the passing checks, undone after
        kept = args["out_slots"]
        change(args)
        before = [args[k].clone() for k in ("scores", "out", "out_slots")]
        with pytest.raises(exc, match=f"`{name}`.*{re.escape(words)}"):
            lightning_indexer(**args, impl=impl)
        assert all(torch.equal(args[k], b) for k, b in zip(("scores", "out", "out_slots"), before))
        undo(args, kept)
        with pytest.raises(ValueError, match="`layout` must be one of"):  # undone: the top-k's checks pass
            lightning_indexer(**args, impl=impl)


def test_a_topk_is_bounded_by_the_row_length_past_the_columns_a_model_takes(backend):
    # indexer_topk(num_top_k=2**28) once allocated (and wrote) 1 GiB of -1 for 12-entry rows.
    device = device_of(backend)
    scores, positions = torch.randn(2, 12, device=device), torch.tensor([40, 20], device=device)
    for num_top_k, out in ((2**28, None), (2**16 + 1, torch.full((2, 2**16 + 1), 7, dtype=torch.int32, device=device))):
        with pytest.raises(ValueError, match=f"`num_top_k` = {num_top_k} is more than the 12 entries"):
            indexer_topk(scores, positions, num_top_k, out=out)
        assert out is None or bool((out == 7).all())
    wide = torch.randn(1, 2**16 + 8, device=device)  # a row that long takes a num_top_k that long
    tokens, _ = indexer_topk(wide, torch.tensor([4 * (2**16 + 8)], device=device), 2**16 + 1)
    assert tokens.shape == (1, 2**16 + 1) and int((tokens >= 0).sum()) == 2**16 + 1
    # A short row keeps a model's fixed top-k: the columns past its length are -1.
    tokens = indexer_topk(scores, positions, 512)[0].cpu()
    assert torch.equal(tokens[:, :12], indexer_topk(scores, positions, 12)[0].cpu())
    assert bool((tokens[:, 12:] == -1).all())


def test_the_triton_scores_refuse_the_largest_int64_position_as_the_header_does(backend):
    # (t + 1) wrapped in the twin's host check at t = 2^63 - 1: it saw 0 entries and accepted the call.
    skip_unless_triton_runs(backend)
    args = to_backend(backend, {**_fresh(), "positions": torch.tensor([2**63 - 1, 20])})
    for impl in ("header", "triton"):
        with pytest.raises(ValueError, match="`page_table`.*sees 2305843009213693952 entries"):
            indexer_scores(**args, impl=impl)

"""The generic send as a plan: the bytes it moves equal a per-item copy, runs are coalesced, and every
bad input is refused before a plan exists. The manifest check refuses what would misplace a write."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.srt.disaggregation.kv_args import KVArgs, StateType
from sparsekv.srt.disaggregation.manifest import Manifest, ManifestMismatchError, check_manifests
from sparsekv.srt.disaggregation.transfer_plan import coalesce_runs, plan_transfer


def apply_rows(rows: np.ndarray, src_mem: np.ndarray, dst_mem: np.ndarray, src_base: int, dst_base: int) -> None:
    """Execute a plan on two numpy 'address spaces' (addresses relative to the bases)."""
    for s, d, n in rows.tolist():
        dst_mem[d - dst_base : d - dst_base + n] = src_mem[s - src_base : s - src_base + n]


@st.composite
def transfers(draw):
    item = draw(st.sampled_from([1, 3, 8, 64]))
    src_items, dst_items = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    n = draw(st.integers(0, min(src_items, dst_items)))
    src = draw(st.lists(st.integers(0, src_items - 1), min_size=n, max_size=n))
    # Destinations are distinct (as allocated slots are); runs appear when draws happen to be consecutive.
    dst = draw(st.permutations(range(dst_items)))[:n] if draw(st.booleans()) else \
        list(range(draw(st.integers(0, dst_items - n)), dst_items))[:n]
    regions = draw(st.integers(1, 3))
    return item, src_items, dst_items, src, dst, regions


@given(transfers(), st.booleans())
def test_plan_moves_exactly_the_items_of_a_per_item_copy(case, coalesce):
    item, src_items, dst_items, src, dst, regions = case
    rng = np.random.default_rng(len(src))
    src_mem = rng.integers(0, 256, regions * src_items * item, dtype=np.uint8)
    dst_mem = rng.integers(0, 256, regions * dst_items * item, dtype=np.uint8)
    expected = dst_mem.copy()
    src_base, dst_base = 1 << 20, 1 << 30
    src_ptrs = [src_base + r * src_items * item for r in range(regions)]
    dst_ptrs = [dst_base + r * dst_items * item for r in range(regions)]
    for r in range(regions):
        for s, d in zip(src, dst):
            so, do = r * src_items * item + s * item, r * dst_items * item + d * item
            expected[do : do + item] = src_mem[so : so + item]
    rows = plan_transfer(src_ptrs, dst_ptrs, [item] * regions, src, dst, src_lens=[src_items * item] * regions,
                         dst_lens=[dst_items * item] * regions, coalesce=coalesce)
    apply_rows(rows, src_mem, dst_mem, src_base, dst_base)
    assert np.array_equal(dst_mem, expected)
    assert int(rows[:, 2].sum()) == regions * len(src) * item
    runs = len(coalesce_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64))[0])
    assert rows.shape[0] == regions * (runs if coalesce else len(src))


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=30))
def test_coalesced_runs_expand_back_to_the_pairs(pairs):
    src = np.array([p[0] for p in pairs], dtype=np.int64)
    dst = np.array([p[1] for p in pairs], dtype=np.int64)
    s0, d0, lengths = coalesce_runs(src, dst)
    expanded = [(int(s + k), int(d + k)) for s, d, n in zip(s0, d0, lengths) for k in range(n)]
    assert expanded == [(int(a), int(b)) for a, b in zip(src, dst)]
    # Maximal: no two neighbouring runs could have been one.
    ends = s0[:-1] + lengths[:-1], d0[:-1] + lengths[:-1]
    assert not bool(((ends[0] == s0[1:]) & (ends[1] == d0[1:])).any())


def test_a_request_of_consecutive_pages_is_one_write_per_region():
    rows = plan_transfer([0, 10_000], [50_000, 90_000], [100, 100], range(3, 40), range(1, 38),
                         src_lens=[5_000, 5_000], dst_lens=[4_000, 4_000])
    assert rows.tolist() == [[300, 50_100, 3_700], [10_300, 90_100, 3_700]]


@pytest.mark.parametrize(("src", "dst", "error", "match"), [
    ([1, 2], [1], ValueError, "index length mismatch: 2 source and 1 destination"),
    ([1, -1], [1, 2], ValueError, "non-negative"),
    ([1, 50], [1, 2], IndexError, "source index 50 is outside region 0"),
    ([1, 2], [1, 35], IndexError, "destination index 35 is outside region 1"),
    ([1.5], [1], TypeError, "src_indices"),
])
def test_bad_indices_are_refused_before_a_plan_exists(src, dst, error, match):
    with pytest.raises(error, match=match):
        plan_transfer([0, 0], [0, 0], [10, 10], src, dst, src_lens=[500, 500], dst_lens=[400, 300])


def _args(labels, items, states=(), tp=1, is_mla=True, page=256) -> KVArgs:
    args = KVArgs(kv_data_ptrs=[4096 * (i + 1) for i in range(len(labels))], kv_data_lens=[100 * x for x in items],
                  kv_item_lens=list(items), kv_labels=list(labels), kv_mem_kinds=["DRAM"] * len(labels),
                  page_size=page, attn_tp_size=tp, is_mla=is_mla)
    for state_type, st_labels in states:
        args.add_state(state_type, ([1] * len(st_labels), [64] * len(st_labels), [8] * len(st_labels)),
                       st_labels, "DRAM")
    return args


def test_matching_manifests_pass_and_a_decode_holding_more_layers_is_fine():
    prefill = _args(["c4_kv:2"], [10], [(StateType.SWA, ["swa_kv:2"])])
    decode = _args(["c4_kv:2", "c4_kv:4"], [10, 10], [(StateType.SWA, ["swa_kv:2", "swa_kv:4"])])
    check_manifests(Manifest.of(prefill), Manifest.of(decode))
    check_manifests(Manifest.from_dict(Manifest.of(prefill).to_dict()), Manifest.of(decode))


@pytest.mark.parametrize(("decode", "match"), [
    (_args(["c4_kv:2"], [10], [(StateType.DSA, ["swa_kv:2"])]), "state components differ"),
    (_args(["c4_kv:4"], [10], [(StateType.SWA, ["swa_kv:2"])]), r"kv: decode has no region for \['c4_kv:2'\]"),
    (_args(["c4_kv:2"], [12], [(StateType.SWA, ["swa_kv:2"])]), "items are 10 B on prefill and 12 B on decode"),
    (_args(["c4_kv:2"], [10], [(StateType.SWA, ["swa_kv:2"])], page=128), "page sizes differ"),
    (_args(["c4_kv:2"], [10], [(StateType.SWA, ["swa_kv:2"])], tp=2, is_mla=False),
     "different attention TP sizes .* non-MLA SWA"),
])
def test_manifest_mismatches_are_refused(decode, match):
    prefill = _args(["c4_kv:2"], [10], [(StateType.SWA, ["swa_kv:2"])], is_mla=decode.is_mla)
    with pytest.raises(ManifestMismatchError, match=match):
        check_manifests(Manifest.of(prefill), Manifest.of(decode))


def test_mla_pools_may_differ_in_tp_but_mamba_may_not():
    mla = _args(["kv:0"], [10], [(StateType.SWA, ["s:0"])])
    check_manifests(Manifest.of(mla), Manifest.of(_args(["kv:0"], [10], [(StateType.SWA, ["s:0"])], tp=4)))
    mamba = _args(["kv:0"], [10], [(StateType.MAMBA, ["m:0"])])
    with pytest.raises(ManifestMismatchError, match="MAMBA"):
        check_manifests(Manifest.of(mamba), Manifest.of(_args(["kv:0"], [10], [(StateType.MAMBA, ["m:0"])], tp=2)))


def test_a_malformed_manifest_is_a_mismatch():
    with pytest.raises(ManifestMismatchError, match="malformed"):
        Manifest.from_dict({"components": [["kv", [{"label": "x"}]]]})


def _with(field: str, value) -> dict:
    """A valid manifest's dict with one field (a dotted path) replaced."""
    d = Manifest.of(_args(["c4_kv:2"], [10], [(StateType.SWA, ["swa_kv:2"])])).to_dict()
    *path, last = field.split(".")
    target = d
    for key in path:
        target = target[int(key)] if isinstance(target, list) else target[key]
    target[int(last) if isinstance(target, list) else last] = value
    return d


@pytest.mark.parametrize(("field", "value", "named"), [
    ("page_size", 64.9, "manifest.page_size"),
    ("page_size", "256", "manifest.page_size"),
    ("page_size", True, "manifest.page_size"),
    ("page_size", 0, "manifest.page_size"),
    ("is_mla", "false", "manifest.is_mla"),
    ("is_mla", 0, "manifest.is_mla"),
    ("attn_tp_size", -3, "manifest.attn_tp_size"),
    ("attn_tp_rank", 1, "manifest.attn_tp_rank"),  # TP size 1: rank 0 only
    ("layers", [3, 1], r"manifest.layers\[1\]"),
    ("layers", [0, 1.0], r"manifest.layers\[1\]"),
    ("components.0.1.0.nbytes", -1, r"manifest.components\[0\]\[1\]\[0\].nbytes"),
    ("components.0.1.0.item_len", 0, r"manifest.components\[0\]\[1\]\[0\].item_len"),
    ("components.0.1.0.ptr", 2**63, r"manifest.components\[0\]\[1\]\[0\].ptr"),
    ("components.0.1.0.mem_kind", "HBM", r"manifest.components\[0\]\[1\]\[0\].mem_kind"),
    ("components.0.1.0.label", 7, r"manifest.components\[0\]\[1\]\[0\].label"),
    ("components.1.0", ["swa"], r"manifest.components\[1\]\[0\]"),
    ("components.1", ["swa"], r"manifest.components\[1\]"),
])
def test_manifest_fields_are_checked_in_their_exact_type_and_range(field, value, named):
    with pytest.raises(ManifestMismatchError, match=f"`{named}`"):
        Manifest.from_dict(_with(field, value))


def test_a_manifest_round_trips_exactly_through_json():
    manifest = Manifest.of(_args(["c4_kv:2"], [10], [(StateType.SWA, ["swa_kv:2"])], tp=2, is_mla=False))
    assert Manifest.from_dict(json.loads(json.dumps(manifest.to_dict()))) == manifest


def test_a_region_with_an_unknown_field_is_refused():
    d = _with("components.0.1.0.label", "c4_kv:2")
    d["components"][0][1][0]["offset"] = 4
    with pytest.raises(ManifestMismatchError, match="unknown fields"):
        Manifest.from_dict(d)

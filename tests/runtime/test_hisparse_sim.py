"""The trace replay behind tools/hisparse_sim.py: Belady is optimal (against brute force on tiny
traces), its LRU is the kernel's policy (against the kernel's own counters, also on the shipped
demo traces), traces round-trip."""

from __future__ import annotations

import functools
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step
from sparsekv.testing.hisparse_traces import POLICIES, RequestTrace, Trace, TraceGenerator, replay, synthetic_trace
from sparsekv.testing.strategies.hisparse import make_world

REPO = Path(__file__).resolve().parents[2]
# The shipped recording: one trace per C4 layer of the demo model (named, so a missing file fails
# its test instead of leaving an empty parameter list).
DEMO_TRACES = [REPO / "tools" / "hisparse_traces" / f"demo_layer{layer}.json" for layer in (1, 3)]


def brute_force_min_loads(steps: list[tuple[int, list[int]]], hot: int) -> int:
    """The fewest loads any demand policy can do: try every eviction choice (tiny traces only)."""

    @functools.cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(steps):
            return 0
        seq_len, top_k = steps[i]
        if seq_len <= hot:
            return best(i + 1, cache)
        need = {t for t in top_k if 0 <= t < seq_len - 1}
        missing = need - cache
        evict = len(cache) + len(missing) - hot
        if evict <= 0:
            return len(missing) + best(i + 1, cache | missing)
        return len(missing) + min(best(i + 1, (cache - set(victims)) | missing)
                                  for victims in itertools.combinations(sorted(cache - need), evict))

    return best(0, frozenset(range(hot)))


@st.composite
def tiny_steps(draw, hot: int, k: int):
    seq_len = draw(st.integers(hot - 1, hot + 4))
    steps = []
    for _ in range(draw(st.integers(1, 7))):
        seq_len += draw(st.integers(0, 1))
        steps.append((seq_len, draw(st.lists(st.integers(-1, seq_len), min_size=k, max_size=k))))
    return steps


@given(steps=tiny_steps(hot=3, k=2))
def test_belady_loads_as_few_as_the_brute_force_optimum(steps):
    trace = Trace(2, [RequestTrace("r", steps)])
    assert replay(trace, 3, "belady").loads == brute_force_min_loads(steps, 3)


@given(steps=tiny_steps(hot=4, k=3))
def test_belady_never_loads_more_than_lru(steps):
    trace = Trace(3, [RequestTrace("r", steps)])
    lru, opt = replay(trace, 4, "lru"), replay(trace, 4, "belady")
    assert opt.loads <= lru.loads
    assert [s.lookups for s in opt.steps] == [s.lookups for s in lru.steps]


@given(steps=tiny_steps(hot=4, k=3), window=st.integers(0, 3))
def test_belady_never_loads_more_than_recent_lru_and_window_0_is_lru(steps, window):
    trace = Trace(3, [RequestTrace("r", steps)])
    recent = replay(trace, 4, "recent_lru", protect_recent=window)
    assert replay(trace, 4, "belady").loads <= recent.loads
    if window == 0:
        assert [(s.hits, s.loads) for s in recent.steps] == [(s.hits, s.loads) for s in replay(trace, 4, "lru").steps]


def test_recent_lru_evicts_an_old_entry_before_a_less_recently_used_recent_one():
    # Slots 0..2 hold tokens 42 (recent: within 4 of the newest, 45), 3 and 7; LRU order 0, 1, 2.
    # One miss (token 9): LRU takes slot 0 (token 42), the recency-protected LRU slot 1 (token 3).
    for window, victim in ((0, 0), (4, 1)):
        buffer = HotBuffer(tokens=[42, 3, 7], lru=[0, 1, 2])
        step = swap_in_step(buffer, [9, 7], 46, protect_recent=window)
        assert step.misses == [(9, victim)]
        assert buffer.lru == [s for s in (0, 1) if s != victim] + [victim, 2]


@given(steps=tiny_steps(hot=4, k=3), window=st.integers(0, 3), span=st.integers(0, 2))
def test_belady_never_loads_more_than_near_lru_and_span_0_is_recent_lru(steps, window, span):
    trace = Trace(3, [RequestTrace("r", steps)])
    near = replay(trace, 4, "near_lru", protect_recent=window, protect_near=span)
    assert replay(trace, 4, "belady").loads <= near.loads
    if span == 0:
        recent = replay(trace, 4, "recent_lru", protect_recent=window)
        assert [(s.hits, s.loads) for s in near.steps] == [(s.hits, s.loads) for s in recent.steps]


def test_near_lru_evicts_a_far_entry_before_a_less_recently_used_neighbour():
    # Slots 0..3 hold tokens 20 (next to the requested 21), 3, 7 and 21; LRU order 0, 1, 2, 3; newest
    # 45. Two misses (30, 31): LRU takes slots 0 and 1; with span 1 token 20 is protected: slots 1, 2.
    for span, victims in ((0, [0, 1]), (1, [1, 2])):
        buffer = HotBuffer(tokens=[20, 3, 7, 21], lru=[0, 1, 2, 3])
        step = swap_in_step(buffer, [21, 30, 31], 46, protect_near=span)
        assert step.misses == [(30, victims[0]), (31, victims[1])]
        assert buffer.lru == [s for s in (0, 1, 2) if s not in victims] + victims + [3]


def test_belady_hand_example():
    # H = 2 (tokens 0 and 1 resident), newest is 9 throughout. Step 1 needs 2: LRU evicts slot 0
    # (token 0), Belady evicts token 1, which is never needed again; step 2 needs 0 again.
    steps = [(10, [0, 1]), (10, [2, 9]), (10, [0, 2])]
    trace = Trace(2, [RequestTrace("r", steps)])
    assert replay(trace, 2, "belady").loads == 1
    assert replay(trace, 2, "lru").loads == 2
    assert [s.hits for s in replay(trace, 2, "belady").steps] == [2, 1, 2]


@given(steps=tiny_steps(hot=3, k=2), recency=st.sampled_from([0.0, 0.5]), locality=st.sampled_from([0.0, 1.0]))
def test_informed_policy_never_beats_belady(steps, recency, locality):
    trace = Trace(2, [RequestTrace("r", steps)], TraceGenerator(recency, 2, locality, 1))
    assert replay(trace, 3, "belady").loads <= replay(trace, 3, "informed").loads


def test_informed_policy_keeps_the_likely_pick():
    # H = 3 (tokens 0, 1, 2), K = 1, newest 9; the generator only draws neighbours (span 1) of the
    # current top-k. Hits on 0 then 1 leave token 2 least recently used; 3 then misses: LRU evicts 2,
    # the informed policy keeps 2 (next to 3, chance 1/3) and evicts 0 (chance 0, lower position).
    steps = [(10, [0]), (10, [1]), (10, [3]), (10, [2])]
    trace = Trace(1, [RequestTrace("r", steps)], TraceGenerator(0.0, 2, 1.0, 1))
    assert [s.loads for s in replay(trace, 3, "lru").steps] == [0, 0, 1, 1]
    assert [s.loads for s in replay(trace, 3, "informed").steps] == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="informed"):
        replay(Trace(1, [RequestTrace("r", steps)]), 3, "informed")


def test_pick_chances_sum_to_one():
    generator = TraceGenerator(recency=0.3, recency_window=16, locality=0.4, locality_span=3)
    members = [20, 21, 40, 77]
    total = sum(generator.pick_chance(pos, members, newest=100) for pos in range(100))
    assert total == pytest.approx(1.0)
    assert generator.pick_chance(90, members, 100) > generator.pick_chance(41, members, 100) \
        > generator.pick_chance(60, members, 100) > 0


def test_lru_replay_matches_the_kernel_counters():
    k, h = 5, 7
    trace = synthetic_trace(num_requests=3, num_steps=60, num_top_k=k, start_len=12, growth=0.5, drift=0.3,
                            recency=0.3, recency_window=6, locality=0.3, locality_span=2, seed=7)
    max_len = max(n for r in trace.requests for n, _ in r.steps)
    world = make_world(k, h, is_dsv4_layout=False, max_reqs=3, max_len=max_len, seed=1)
    for rid in range(3):
        world.reset_request(rid, resident=True)
    counters = torch.zeros(3, dtype=torch.int64)
    for step in range(trace.num_steps):
        rows = [(rid, r.steps[step]) for rid, r in enumerate(trace.requests)]
        world.swap_in([top_k for _, (_, top_k) in rows], [rid for rid, _ in rows], [n for _, (n, _) in rows],
                      counters=counters)
    lru = replay(trace, h, "lru")
    assert counters[:2].tolist() == [sum(s.hits for s in lru.steps), lru.loads]
    assert 0 < lru.loads < sum(s.lookups for s in lru.steps)


def test_trace_round_trips_and_rejects_other_formats(tmp_path):
    trace = synthetic_trace(num_requests=2, num_steps=5, num_top_k=4, start_len=10, seed=3)
    path = tmp_path / "t.json"
    trace.save(path)
    assert Trace.load(path) == trace
    with pytest.raises(ValueError, match="not a"):
        Trace.from_json({"format": "other", "num_top_k": 1, "requests": []})
    doc = trace.to_json()
    doc["requests"][0]["steps"][0]["top_k"] += [1]
    with pytest.raises(ValueError, match="num_top_k"):
        Trace.from_json(doc)


def test_synthetic_trace_is_a_drifting_distinct_top_k():
    trace = synthetic_trace(num_requests=1, num_steps=50, num_top_k=64, start_len=1000, drift=0.1, seed=5)
    steps = trace.requests[0].steps
    for (n0, _), (n1, b) in zip(steps, steps[1:]):
        assert len(set(b)) == 64 and all(0 <= t < n1 - 1 for t in b) and n0 <= n1 <= n0 + 1
    kept = [len(set(a) & set(b)) / 64 for (_, a), (_, b) in zip(steps, steps[1:])]
    assert 0.75 < sum(kept) / len(kept) < 0.99


def test_sim_tool_reports_every_policy_of_every_trace(tmp_path):
    # A folder of two traces (one recorded-like, without a generator: no "informed") and a file.
    folder = tmp_path / "traces"
    folder.mkdir()
    traces = {folder / "a.json": synthetic_trace(num_requests=2, num_steps=30, num_top_k=8, start_len=100, seed=2),
              folder / "b.json": Trace(4, synthetic_trace(num_requests=1, num_steps=20, num_top_k=4, start_len=50,
                                                          seed=3).requests, source={"kind": "test"}),
              tmp_path / "c.json": synthetic_trace(num_requests=1, num_steps=10, num_top_k=16, start_len=40, seed=4)}
    for path, trace in traces.items():
        trace.save(path)
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(REPO / "tools" / "hisparse_sim.py"), "--trace", str(folder),
                    str(tmp_path / "c.json"), "--hot", "16,24", "--json", str(out), "--plot", str(tmp_path / "p.png")],
                   check=True, capture_output=True, timeout=300)
    results = json.loads(out.read_text())["traces"]
    assert [r["trace"] for r in results] == [str(p) for p in traces]
    assert results[1]["source"] == {"kind": "test"}
    for result, trace in zip(results, traces.values()):
        rows = result["rows"]
        assert [r["hot"] for r in rows] == [16, 24]
        for r in rows:
            for policy in POLICIES:
                if trace.generator is None and policy == "informed":
                    assert "informed_bytes" not in r
                    continue
                replayed = replay(trace, r["hot"], policy)
                assert r[f"{policy}_hit_rate"] == replayed.hit_rate
                assert r[f"{policy}_bytes"] == replayed.loads * 584
                assert len(r[f"{policy}_steps"]) == trace.num_steps
    assert (tmp_path / "p.png").stat().st_size > 0


def test_sim_tool_default_hot_sizes_follow_the_top_k(tmp_path):
    trace = synthetic_trace(num_requests=1, num_steps=5, num_top_k=8, start_len=40, seed=1)
    trace.save(tmp_path / "t.json")
    subprocess.run([sys.executable, str(REPO / "tools" / "hisparse_sim.py"), "--trace", str(tmp_path / "t.json"),
                    "--json", str(tmp_path / "out.json")], check=True, capture_output=True, timeout=300)
    rows = json.loads((tmp_path / "out.json").read_text())["traces"][0]["rows"]
    assert [r["hot"] for r in rows] == [8, 9, 10, 12, 16, 24, 32]


@pytest.mark.parametrize("path", DEMO_TRACES, ids=lambda p: p.name)
def test_shipped_demo_trace_replays_what_the_swap_in_kernel_did(path):
    """The recorded demo decode (``sparsekv demo --save-traces``): LRU replayed at the recording's
    hot buffer gives, step by step, the hits and loads the swap-in kernel counted in that run; the
    requests outgrow H = 1,024 (so the sweep's largest H evicts), and Belady loads least there."""
    assert sorted(path.parent.glob("demo_layer*.json")) == DEMO_TRACES
    trace = Trace.load(path)
    source = trace.source
    assert source["kind"] == "sparsekv demo" and source["policy"] == "lru" and trace.num_top_k == 64
    result = replay(trace, source["hot_buffer"], source["policy"])
    assert [[s.hits, s.loads] for s in result.steps] == source["kernel_steps"]
    assert len(trace.requests) == 2 and all(len(r.steps) == source["demo"]["steps"] for r in trace.requests)
    assert min(n for r in trace.requests for n, _ in r.steps) > 1024
    loads = {p: replay(trace, 1024, p).loads for p in ("lru", "recent_lru", "near_lru", "belady")}
    assert 0 < loads["belady"] <= min(loads.values())

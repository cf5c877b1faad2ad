"""Top-k traces and hot-buffer policies to replay them: our yardstick for HiSparse eviction policies.

A trace is what the indexer asked for, per request and decode step, in one layer: the request's
compressed length and its top-k positions. :func:`replay` runs a policy over it and counts, per
step, the lookups served from the hot buffer and the entries loaded host -> device:

* ``"lru"``: the swap-in kernel's policy (:func:`sparsekv.testing.hisparse_policy.swap_in_step`);
* ``"recent_lru"``: LRU that evicts entries of the last :data:`PROTECT_RECENT` positions only after
  every older one (``swap_in_step(..., protect_recent=...)``): decode attention returns to recent
  entries more than to old ones;
* ``"near_lru"``: LRU that also protects the entries within :data:`PROTECT_NEAR` positions of a token
  the step asks for (``swap_in_step(..., protect_recent=..., protect_near=...)``): the top-k's
  neighbours are picked more often than the rest (locality);
* ``"belady"``: Belady's MIN on the same trace, the offline optimum for demand loading: a missing
  entry must be loaded, and the entry evicted is the one (not needed this step) whose next use is
  furthest in the future;
* ``"informed"`` (synthetic traces only): the best-informed online policy we can state, a yardstick
  and not a kernel candidate. It is told the generator's parameters (:class:`TraceGenerator`) and
  evicts the entries least likely to be picked at the next step; what separates it from Belady is
  what no online policy can know (which uniform draw comes next). With ``drift=1, recency=0,
  locality=0`` every step is a fresh uniform draw: every entry is as likely as any other, no
  online policy can expect to load less than LRU, and ``"informed"`` loads about what LRU loads
  (the control for traces of independent picks, such as the demo's decode).

Both start as a prefill staged on the device (slot ``i`` holds position ``i``), give the newest
entry its reserved slot for free, and serve everything while ``seq_len <= H`` (the fast path).

Trace file format (JSON)::

    {"format": "sparsekv.hisparse_trace/1",
     "num_top_k": 512,
     "requests": [{"id": "r0", "steps": [{"seq_len": 4097, "top_k": [17, 4095, ...]}, ...]}, ...]}

``top_k`` lists at most ``num_top_k`` positions; entries outside ``[0, seq_len)`` mean "no token".
Steps of different requests with the same index happen in the same decode step. A synthetic trace
also carries ``"generator"``: the parameters of :class:`TraceGenerator`. A recorded trace may carry
``"source"``: where it came from, a JSON object that replays ignore (readers of this format ignore
keys they do not know, so an optional key keeps the version). ``sparsekv demo --save-traces DIR``
writes one trace per C4 layer (:class:`TraceRecorder`) whose ``source`` holds the demo's settings,
the model layer, and the swap-in kernel's own counters per step at the run's hot buffer::

    "source": {"kind": "sparsekv demo", "demo": {"tokens": 8192, ...}, "layer": 1,
               "hot_buffer": 128, "policy": "lru", "kernel_steps": [[hits, loads], ...]}

so that :func:`replay` with that ``policy`` and ``hot_buffer`` can be held to what the kernel did.
"""

from __future__ import annotations

import bisect
import heapq
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparsekv.testing.hisparse_policy import HotBuffer, swap_in_step

FORMAT = "sparsekv.hisparse_trace/1"
POLICIES = ("lru", "recent_lru", "near_lru", "belady", "informed")
#: Positions before the newest that ``"recent_lru"`` protects (the synthetic traces' recency window).
PROTECT_RECENT = 256
#: Positions either side of a requested token that ``"near_lru"`` protects (the synthetic traces' locality span).
PROTECT_NEAR = 16


@dataclass
class RequestTrace:
    """One request: ``steps[i] = (seq_len, top_k)``."""

    id: str
    steps: list[tuple[int, list[int]]]


@dataclass(frozen=True)
class TraceGenerator:
    """How :func:`synthetic_trace` draws a new top-k member (see there): the ``"informed"`` policy's knowledge."""

    recency: float
    recency_window: int
    locality: float
    locality_span: int

    def pick_chance(self, pos: int, members: list[int], newest: int) -> float:
        """Chance that one new draw is ``pos``, given the current ``members`` (sorted) and ``newest``."""
        span = self.locality_span
        near = bisect.bisect_right(members, pos + span) - bisect.bisect_left(members, pos - span)
        recent = self.recency / self.recency_window if newest - self.recency_window <= pos < newest else 0.0
        other = 1 - self.recency
        return (recent + other * self.locality * near / (max(len(members), 1) * (2 * span + 1))
                + other * (1 - self.locality) / max(newest, 1))


@dataclass
class Trace:
    """Top-k selections of several requests over decode steps (``generator``: set on synthetic
    traces; ``source``: where a recorded trace came from, free-form JSON)."""

    num_top_k: int
    requests: list[RequestTrace]
    generator: TraceGenerator | None = None
    source: dict | None = None

    @property
    def num_steps(self) -> int:
        return max((len(r.steps) for r in self.requests), default=0)

    def to_json(self) -> dict:
        doc = {"format": FORMAT, "num_top_k": self.num_top_k,
               "requests": [{"id": r.id, "steps": [{"seq_len": n, "top_k": k} for n, k in r.steps]}
                            for r in self.requests]}
        if self.generator is not None:
            doc["generator"] = vars(self.generator)
        if self.source is not None:
            doc["source"] = self.source
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> Trace:
        """Parse a trace document.

        Raises
        ------
        ValueError
            Not a trace of this format, or a step with more than ``num_top_k`` entries.
        """
        if doc.get("format") != FORMAT:
            raise ValueError(f"sparsekv: not a {FORMAT} trace (format = {doc.get('format')!r})")
        k = int(doc["num_top_k"])
        requests = []
        for r in doc["requests"]:
            steps = [(int(s["seq_len"]), [int(t) for t in s["top_k"]]) for s in r["steps"]]
            if any(len(t) > k for _, t in steps):
                raise ValueError(f"sparsekv: request {r['id']!r} has a step with more than num_top_k={k} entries")
            requests.append(RequestTrace(str(r["id"]), steps))
        generator, source = doc.get("generator"), doc.get("source")
        if source is not None and not isinstance(source, dict):
            raise ValueError(f"sparsekv: a trace's `source` must be a JSON object, got {type(source).__name__}")
        return cls(k, requests, None if generator is None else TraceGenerator(**generator), source)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        return cls.from_json(json.loads(Path(path).read_text()))


class TraceRecorder:
    """Builds a :class:`Trace` of one layer from what its indexer selected, one decode step at a time.

    Parameters
    ----------
    num_top_k : int
        Width of the top-k rows recorded.
    source : dict, optional
        The trace's ``source`` (see the format above); :meth:`record` appends to its
        ``"kernel_steps"`` when given a step's counters.
    """

    def __init__(self, num_top_k: int, source: dict | None = None):
        self.num_top_k = num_top_k
        self.source = source
        self._steps: dict[str, list[tuple[int, list[int]]]] = {}

    def record(self, request_ids: Sequence[int], seq_lens: Sequence[int], top_k: Sequence[Sequence[int]],
               kernel_counts: tuple[int, int] | None = None) -> None:
        """One decode step: request ``request_ids[b]`` of ``seq_lens[b]`` entries asked for ``top_k[b]``
        (plain lists: the caller reads tensors back, which waits for the device);
        ``kernel_counts``: the swap-in's ``(hits, loads)`` over these rows, kept in ``source``.

        Raises
        ------
        ValueError
            The three sequences differ in length, a request appears twice, or a row is wider than
            ``num_top_k``.
        """
        if not len(request_ids) == len(seq_lens) == len(top_k):
            raise ValueError(f"sparsekv: arguments `request_ids`, `seq_lens` and `top_k` must have equal lengths, "
                             f"got {len(request_ids)}, {len(seq_lens)} and {len(top_k)}")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"sparsekv: argument `request_ids` names a request twice: {list(request_ids)}")
        for rid, n, row in zip(request_ids, seq_lens, top_k):
            if len(row) > self.num_top_k:
                raise ValueError(f"sparsekv: argument `top_k` has a row of {len(row)} entries, more than "
                                 f"num_top_k={self.num_top_k}")
            self._steps.setdefault(f"r{rid}", []).append((int(n), [int(t) for t in row]))
        if kernel_counts is not None:
            if self.source is None:
                self.source = {}
            self.source.setdefault("kernel_steps", []).append([int(c) for c in kernel_counts])

    def trace(self) -> Trace:
        """What was recorded so far, requests in the order they first appeared."""
        return Trace(self.num_top_k, [RequestTrace(rid, steps) for rid, steps in self._steps.items()],
                     source=self.source)


def synthetic_trace(*, num_requests: int = 4, num_steps: int = 200, num_top_k: int = 512, start_len: int = 4096,
                    growth: float = 0.25, drift: float = 0.05, recency: float = 0.3, recency_window: int = 256,
                    locality: float = 0.3, locality_span: int = 16, seed: int = 0) -> Trace:
    """A trace whose top-k is a slowly drifting set of positions.

    Each request starts with ``start_len`` compressed entries and a random top-k set. Every step
    its length grows by one with probability ``growth`` (one C4 entry per 4 tokens: 0.25), and a
    ``drift`` fraction of the set is replaced by new positions, each drawn

    * with probability ``recency`` from the last ``recency_window`` positions (recency bias),
    * else with probability ``locality`` within ``locality_span`` of a current member (locality),
    * else uniformly from the whole sequence.

    Raises
    ------
    ValueError
        ``start_len <= num_top_k`` (a full top-k needs more distinct positions than that).
    """
    if start_len <= num_top_k:
        raise ValueError(f"sparsekv: argument `start_len` ({start_len}) must exceed `num_top_k` ({num_top_k})")
    rng = random.Random(seed)
    requests = []
    for r in range(num_requests):
        seq_len = start_len
        chosen = rng.sample(range(seq_len - 1), num_top_k)
        members = set(chosen)
        steps = []
        for _ in range(num_steps):
            if rng.random() < growth:
                seq_len += 1
            replace = sum(rng.random() < drift for _ in range(num_top_k))
            for victim in rng.sample(chosen, replace):
                members.discard(victim)
            while len(members) < num_top_k:
                u = rng.random()
                if u < recency:
                    pos = seq_len - 1 - rng.randint(1, min(recency_window, seq_len - 1))
                elif u < recency + (1 - recency) * locality:
                    pos = rng.choice(chosen) + rng.randint(-locality_span, locality_span)
                else:
                    pos = rng.randrange(seq_len - 1)
                if 0 <= pos < seq_len - 1:
                    members.add(pos)
            chosen = sorted(members)
            order = chosen[:]
            rng.shuffle(order)
            steps.append((seq_len, order))
        requests.append(RequestTrace(f"r{r}", steps))
    return Trace(num_top_k, requests, TraceGenerator(recency, recency_window, locality, locality_span))


@dataclass
class StepStats:
    """Totals of one decode step over the requests active in it."""

    lookups: int = 0
    hits: int = 0
    loads: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 1.0


@dataclass
class ReplayResult:
    """Per-step totals of one policy over one trace at one hot-buffer size."""

    policy: str
    hot: int
    steps: list[StepStats] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        lookups = sum(s.lookups for s in self.steps)
        return sum(s.hits for s in self.steps) / lookups if lookups else 1.0

    @property
    def loads(self) -> int:
        return sum(s.loads for s in self.steps)


def _lookups(seq_len: int, top_k: list[int], hot: int) -> int:
    """Entries that name a token: on the fast path only the first ``min(seq_len, K)`` count."""
    used = min(seq_len, len(top_k)) if seq_len <= hot else len(top_k)
    return sum(0 <= t < seq_len for t in top_k[:used])


def _replay_lru(steps: list[tuple[int, list[int]]], hot: int, protect_recent: int = 0,
                protect_near: int = 0) -> list[tuple[int, int, int]]:
    buffer = HotBuffer.resident_prefix(hot)
    out = []
    for seq_len, top_k in steps:
        step = swap_in_step(buffer, top_k, seq_len, protect_recent=protect_recent, protect_near=protect_near)
        out.append((_lookups(seq_len, top_k, hot), step.hits, len(step.misses)))
    return out


def _replay_ranked(steps: list[tuple[int, list[int]]], hot: int,
                   rank: Callable[[int, int], object]) -> list[tuple[int, int, int]]:
    """A demand policy that loads each step's missing entries and evicts, among the entries this
    step does not need, those of the lowest ``rank(token, step)``."""
    cache = set(range(hot))
    out = []
    for i, (seq_len, top_k) in enumerate(steps):
        lookups = _lookups(seq_len, top_k, hot)
        if seq_len <= hot:
            out.append((lookups, lookups, 0))
            continue
        need = {t for t in top_k if 0 <= t < seq_len - 1}
        missing = need - cache
        hits = sum(1 for t in top_k if t == seq_len - 1 or (0 <= t < seq_len - 1 and t in cache))
        evict = len(cache) + len(missing) - hot
        if evict > 0:
            cache -= set(heapq.nsmallest(evict, cache - need, key=lambda t: rank(t, i)))
        cache |= missing
        out.append((lookups, hits, len(missing)))
    return out


def _replay_belady(steps: list[tuple[int, list[int]]], hot: int) -> list[tuple[int, int, int]]:
    uses: dict[int, list[int]] = {}  # per token, the steps (ascending) that need it
    for i, (seq_len, top_k) in enumerate(steps):
        for t in {t for t in top_k if 0 <= t < seq_len - 1}:
            uses.setdefault(t, []).append(i)

    def next_use(token: int, now: int) -> float:
        times = uses.get(token, [])
        j = bisect.bisect_right(times, now)
        return times[j] if j < len(times) else float("inf")

    return _replay_ranked(steps, hot, lambda t, i: -next_use(t, i))


def _replay_informed(steps: list[tuple[int, list[int]]], hot: int,
                     generator: TraceGenerator) -> list[tuple[int, int, int]]:
    members = [sorted({t for t in top_k if 0 <= t < seq_len - 1}) for seq_len, top_k in steps]
    return _replay_ranked(steps, hot, lambda t, i: (generator.pick_chance(t, members[i], steps[i][0] - 1), t))


def replay(trace: Trace, hot: int, policy: str, *, protect_recent: int = PROTECT_RECENT,
           protect_near: int = PROTECT_NEAR) -> ReplayResult:
    """Run ``policy`` (one of :data:`POLICIES`) with ``hot`` slots per request over ``trace``
    (``protect_recent``: the window of ``"recent_lru"`` and ``"near_lru"``; ``protect_near``: the
    span of ``"near_lru"``).

    Raises
    ------
    ValueError
        An unknown policy, ``"informed"`` on a trace without a generator, or ``hot < trace.num_top_k``.
    """
    if policy not in POLICIES:
        raise ValueError(f"sparsekv: argument `policy` must be one of {POLICIES}, got {policy!r}")
    if policy == "informed" and trace.generator is None:
        raise ValueError("sparsekv: argument `policy` 'informed' needs a synthetic trace (one with a generator)")
    if hot < trace.num_top_k:
        raise ValueError(f"sparsekv: argument `hot` ({hot}) must be >= the trace's num_top_k ({trace.num_top_k})")
    runs = {"lru": _replay_lru, "recent_lru": lambda steps, h: _replay_lru(steps, h, protect_recent),
            "near_lru": lambda steps, h: _replay_lru(steps, h, protect_recent, protect_near),
            "belady": _replay_belady, "informed": lambda steps, h: _replay_informed(steps, h, trace.generator)}
    run = runs[policy]
    result = ReplayResult(policy, hot, [StepStats() for _ in range(trace.num_steps)])
    for request in trace.requests:
        for stats, (lookups, hits, loads) in zip(result.steps, run(request.steps, hot)):
            stats.lookups += lookups
            stats.hits += hits
            stats.loads += loads
    return result

"""What limits a memory plan, and the smallest change that makes an impossible plan feasible.

Each fix is found by searching the one setting it changes, everything else held fixed, and is
re-checked by planning with it, so a suggestion is never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from .memory_case import MemoryCase
from .pool_planner import PoolPlan

# Searches stop here: a per-rank KV budget of 1 PiB, or a ratio of 1.
MAX_BUDGET_BYTES = 1 << 50
RATIO_STEP = 1e-3
# sglang's estimate of max_running_requests never exceeds this.
MAX_ESTIMATED_REQUESTS = 4096


def _feasible(case: MemoryCase) -> bool:
    try:
        case.plan()
    except (ValueError, RuntimeError):
        return False
    return True


def _smallest_int(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """Smallest ``x`` in ``(lo, hi]`` with ``ok(x)``, assuming ``ok`` flips once from False to True."""
    if not ok(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def min_budget_bytes(case: MemoryCase) -> int | None:
    """Smallest per-rank KV budget that plans, or ``None`` if even 1 PiB does not.

    With ``max_running_requests`` fixed, feasibility is monotone in the budget and this is the
    minimum. Unset, sglang's capacity-based request estimate makes it non-monotone; the budget
    returned then plans while one byte less does not.
    """
    hi = max(case.available_bytes, 1 << 20)
    while hi < MAX_BUDGET_BYTES and not _feasible(replace(case, available_bytes=hi)):
        hi *= 2
    hi = min(hi, MAX_BUDGET_BYTES)
    return _smallest_int(case.available_bytes, hi, lambda b: _feasible(replace(case, available_bytes=b)))


def min_swa_ratio(case: MemoryCase) -> float | None:
    """Smallest ``swa_full_tokens_ratio`` above the current one (a multiple of 0.001, at most 1) that plans.

    A scan, not a bisection: page alignment makes feasibility non-monotone in the ratio (a larger
    ratio shrinks the full pool, which can round the SWA pool down by a page).
    """
    current = case.server.swa_full_tokens_ratio
    if current is None or current >= 1:
        return None
    for k in range(math.floor(current / RATIO_STEP) + 1, round(1 / RATIO_STEP) + 1):
        ratio = round(k * RATIO_STEP, 3)
        if _feasible(replace(case, server=replace(case.server, swa_full_tokens_ratio=ratio))):
            return ratio
    return None


def max_running_requests_that_fit(case: MemoryCase) -> int | None:
    """Largest ``max_running_requests`` below the current one (unset: below sglang's 4096 ceiling) that plans."""
    current = case.server.max_running_requests
    if current is None:
        current = MAX_ESTIMATED_REQUESTS + 1
    if current <= 1:
        return None

    def too_many(m: int) -> bool:
        return not _feasible(replace(case, server=replace(case.server, max_running_requests=m)))

    first_infeasible = _smallest_int(0, current, too_many)
    if first_infeasible is None or first_infeasible <= 1:
        return None
    return first_infeasible - 1


def min_max_total_tokens(case: MemoryCase) -> int | None:
    """Smallest user ``max_total_tokens`` cap that plans (only when a cap is set)."""
    cap = case.server.max_total_tokens
    if cap is None:
        return None
    uncapped = replace(case, server=replace(case.server, max_total_tokens=None))
    if not _feasible(uncapped):
        return None
    hi = uncapped.plan().agreed_tokens
    return _smallest_int(cap, hi, lambda n: _feasible(replace(case, server=replace(case.server, max_total_tokens=n))))


@dataclass(frozen=True)
class Fix:
    """One change that turns an infeasible case into a plan: set ``field`` (a case path such as
    ``server.swa_full_tokens_ratio``) to ``value``; ``bound`` says whether ``value`` is the
    ``minimum`` or ``maximum`` that plans, or ``exact``."""

    field: str
    value: int | float
    bound: str

    def describe(self, names: Mapping[str, str] | None = None) -> str:
        """The fix in words, naming the setting as the user wrote it (``names``: field -> flag)."""
        name = (names or {}).get(self.field, self.field)
        if self.field == "available_bytes":
            return f"raise the KV budget ({name}) to >= {self.value / (1 << 30):.2f} GiB per rank ({self.value} bytes)"
        if self.bound == "exact":
            return f"set {name} explicitly to {self.value} (size SWA by ratio instead of the request cap)"
        verb = "raise" if self.bound == "minimum" else "lower"
        return f"{verb} {name} to {'>=' if self.bound == 'minimum' else '<='} {self.value}"


def fixes(case: MemoryCase) -> list[Fix]:
    """The smallest changes, each on its own, that turn an infeasible ``case`` into a plan."""
    found = []
    budget = min_budget_bytes(case)
    if budget is not None:
        found.append(Fix("available_bytes", budget, "minimum"))
    ratio = min_swa_ratio(case)
    if ratio is not None:
        found.append(Fix("server.swa_full_tokens_ratio", ratio, "minimum"))
    cap = min_max_total_tokens(case)
    if cap is not None:
        found.append(Fix("server.max_total_tokens", cap, "minimum"))
    if case.is_dsv4 and (case.server.swa_full_tokens_ratio is None or case.server.max_running_requests is None):
        requests = max_running_requests_that_fit(case)
        if requests is not None:
            found.append(Fix("server.max_running_requests", requests, "maximum"))
    if case.is_dsv4 and case.server.swa_full_tokens_ratio is None:
        explicit = replace(case, server=replace(case.server, swa_full_tokens_ratio=0.1))
        if _feasible(explicit):
            found.append(Fix("server.swa_full_tokens_ratio", 0.1, "exact"))
    return found


def limiting_factor(case: MemoryCase, plan: PoolPlan, names: Mapping[str, str] | None = None) -> str:
    """What bounds the agreed full-pool size: the user cap, one PP rank's budget, or the budget.

    ``names`` maps case fields to the flags the user typed (``server.max_total_tokens`` ->
    ``--max-total-tokens``).
    """
    names = names or {}
    profiled = [r.profiled_tokens for r in plan.ranks]
    cap = case.server.max_total_tokens
    if cap is not None and cap < min(profiled):
        name = names.get("server.max_total_tokens", "max_total_tokens")
        return f"the {name} cap ({cap}); the KV budget alone allows {min(profiled)}"
    if len(set(profiled)) > 1:
        worst = min(plan.ranks, key=lambda r: r.profiled_tokens)
        start, end = worst.layers
        return (
            f"the KV budget of PP rank {worst.pp_rank} (layers [{start},{end}), its layers cost the most per "
            "token); the other ranks are held to its count by the MIN over ranks"
        )
    return "the KV budget"

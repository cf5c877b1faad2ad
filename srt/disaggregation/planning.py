"""Planning a room: every write of one request's KV and state, checked before any is issued.

The KV regions go by label (``get_contiguous_buf_infos``: one index = one full-token page, the
same page id in every region; a region group such as ``c4_kv`` may have destinations of its own),
then each state component through its :data:`SENDERS` entry. An index-length mismatch, an
out-of-range index, a state type with no sender or a TP split the state cannot take fails the room
here, with nothing written. A plan is pure data: rows of ``(src, dst, nbytes)`` per memory-kind
pair (:mod:`.transfer_plan`), cut into engine batches by :func:`plan_batches`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.kv_args import KVArgs, StateType
from sparsekv.srt.disaggregation.manifest import TP_SHARDED_STATES, Manifest, Region
from sparsekv.srt.disaggregation.transfer_plan import check_index_pairs, plan_transfer

#: A plan: (source memory kind, destination memory kind) -> write rows (uint64 ``[N, 3]``).
Plan = dict[tuple[str, str], list[np.ndarray]]


class RegionPairs(NamedTuple):
    """Local regions matched to the remote regions of the same label, for one memory-kind pair."""

    kinds: tuple[str, str]
    src_ptrs: np.ndarray
    dst_ptrs: np.ndarray
    item_lens: np.ndarray
    src_lens: np.ndarray
    dst_lens: np.ndarray


def pair_regions(local: list[Region], remote: dict[str, Region]) -> list[RegionPairs]:
    """Each ``local`` region with the ``remote`` region of its label, grouped by memory-kind pair.

    Raises
    ------
    ValueError
        A local region without a remote one, or with another item size.
    """
    by_kind: dict[tuple[str, str], list[tuple[Region, Region]]] = {}
    for region in local:
        other = remote.get(region.label)
        if other is None or other.item_len != region.item_len:
            raise ValueError(f"sparsekv: no matching destination region for {region.label!r}")
        by_kind.setdefault((region.mem_kind, other.mem_kind), []).append((region, other))

    def column(pairs, get) -> np.ndarray:
        return np.array([get(a, b) for a, b in pairs], dtype=np.uint64)

    return [RegionPairs(kinds, column(pairs, lambda a, b: a.ptr), column(pairs, lambda a, b: b.ptr),
                        column(pairs, lambda a, b: a.item_len), column(pairs, lambda a, b: a.nbytes),
                        column(pairs, lambda a, b: b.nbytes)) for kinds, pairs in by_kind.items()]


def plan_pairs(plan: Plan, pairs: list[RegionPairs], src_indices, dst_indices, *, coalesce: bool) -> None:
    """Add the writes of ``src_indices -> dst_indices`` over every region pair to ``plan``.

    Raises
    ------
    ValueError
        Index lists of different lengths, or a negative index.
    IndexError
        An index outside a region.
    """
    check_index_pairs(src_indices, dst_indices)
    for p in pairs:
        plan.setdefault(p.kinds, []).append(plan_transfer(p.src_ptrs, p.dst_ptrs, p.item_lens, src_indices,
                                                          dst_indices, src_lens=p.src_lens, dst_lens=p.dst_lens,
                                                          coalesce=coalesce))


@dataclass
class SendContext:
    """What a state sender needs: both manifests, the component's region pairs, the plan to extend."""

    local: Manifest
    remote: Manifest
    pairs: list[RegionPairs]
    plan: Plan
    coalesce: bool

    def generic(self, src_indices, dst_indices) -> None:
        """The generic send of this component (lengths checked first)."""
        plan_pairs(self.plan, self.pairs, src_indices, dst_indices, coalesce=self.coalesce)


def _send_tp_sharded(ctx: SendContext, state_type: StateType, src_indices, dst_indices) -> None:
    if (not ctx.local.is_mla or not ctx.remote.is_mla) and ctx.local.attn_tp_size != ctx.remote.attn_tp_size:
        raise TransferError(f"sparsekv: PD transfer does not support different attention TP sizes (prefill "
                            f"{ctx.local.attn_tp_size}, decode {ctx.remote.attn_tp_size}) for non-MLA "
                            f"{state_type.value.upper()} hybrid models")
    ctx.generic(src_indices, dst_indices)


def _send_replicated(ctx: SendContext, state_type: StateType, src_indices, dst_indices) -> None:
    ctx.generic(src_indices, dst_indices)


def _send_same_tp(ctx: SendContext, state_type: StateType, src_indices, dst_indices) -> None:
    if ctx.local.attn_tp_size != ctx.remote.attn_tp_size:
        raise TransferError(f"sparsekv: PD transfer does not split {state_type.value.upper()} state across "
                            f"attention TP sizes {ctx.local.attn_tp_size} -> {ctx.remote.attn_tp_size}")
    ctx.generic(src_indices, dst_indices)


#: The sender of each state type. SWA (DSV4 included: SWA pages plus the C4 rings on the same
#: SWA page ids) and DSA use the generic send with the TP rule; the request-scoped C128 rings
#: are the same on every TP rank; MAMBA state is sent whole, so TP sizes must match.
SENDERS: dict[StateType, Callable[[SendContext, StateType, object, object], None]] = {
    StateType.SWA: _send_tp_sharded,
    StateType.DSA: _send_tp_sharded,
    StateType.C128_STATE: _send_replicated,
    StateType.MAMBA: _send_same_tp,
}
_UNSENT = (set(StateType) | set(TP_SHARDED_STATES)) - set(SENDERS)
if _UNSENT:  # dispatch must be exhaustive: a state type without a sender would silently stay behind
    raise ImportError(f"sparsekv: state types without a PD sender: {sorted(t.value for t in _UNSENT)}")


class RoomPlanner:
    """Plans rooms from this side's regions into one decode's; pairs regions once per connection.

    A short request's plan is a few numpy calls per region group, so pairing the regions by label
    on every room would cost more than its writes.

    Parameters
    ----------
    local, remote : Manifest
        This (prefill) side's and the decode side's manifests.
    kv_args : KVArgs
        This side's state types (parallel to the state components).
    """

    def __init__(self, local: Manifest, remote: Manifest, kv_args: KVArgs) -> None:
        self.local = local
        self.remote = remote
        self.state_types = [StateType(t) for t in kv_args.state_types]
        # Frozen set of region groups with their own destination indices -> (group or None, pairs).
        self._kv_pairs: dict[frozenset, list[tuple[str | None, list[RegionPairs]]]] = {}
        self._state_pairs: dict[int, list[RegionPairs]] = {}

    def _kv(self, overridden: frozenset) -> list[tuple[str | None, list[RegionPairs]]]:
        if overridden not in self._kv_pairs:
            # The groups without their own list are planned in one go.
            groups: dict[str | None, list[Region]] = {}
            for region in self.local.components[0][1]:
                group = region.label.split(":", 1)[0]
                groups.setdefault(group if group in overridden else None, []).append(region)
            remote_kv = self.remote.region_map(0)
            self._kv_pairs[overridden] = [(g, pair_regions(regions, remote_kv)) for g, regions in groups.items()]
        return self._kv_pairs[overridden]

    def _state(self, component: int) -> list[RegionPairs]:
        if component not in self._state_pairs:
            self._state_pairs[component] = pair_regions(self.local.components[component][1],
                                                         self.remote.region_map(component))
        return self._state_pairs[component]

    def plan(self, src_kv, src_states: list, request: dict, *, coalesce: bool = True) -> Plan:
        """Every write of one room, planned and checked before any is issued.

        Parameters
        ----------
        src_kv, src_states
            The room's source KV pages and per-component state indices.
        request : dict
            The decode's ``transfer`` message: ``kv_indices``, optional ``kv_group_indices`` (a
            region group's own destination indices, e.g. host pages for ``c4_kv`` under HiSparse),
            ``state_indices`` (one list per component).

        Raises
        ------
        ValueError, IndexError
            Index lists of different lengths or out of range; a wrong number of state lists; a
            region without a matching destination region.
        TransferError
            A state type without a sender, or a TP split its sender refuses.
        """
        plan: Plan = {}
        overrides = request.get("kv_group_indices") or {}
        for group, pairs in self._kv(frozenset(overrides)):
            dst = request["kv_indices"] if group is None else overrides[group]
            plan_pairs(plan, pairs, src_kv, dst, coalesce=coalesce)
        dst_states = request.get("state_indices") or []
        if len(dst_states) != len(self.state_types) or len(src_states) != len(self.state_types):
            raise ValueError(f"sparsekv: {len(self.state_types)} state components, but {len(src_states)} source and "
                             f"{len(dst_states)} destination index lists")
        for c, state_type in enumerate(self.state_types):
            sender = SENDERS.get(state_type)
            if sender is None:
                raise TransferError(f"sparsekv: no sender for state type {state_type.value!r}: refusing to "
                                    "transfer a request whose state would be left behind")
            sender(SendContext(self.local, self.remote, self._state(c + 1), plan, coalesce), state_type,
                   src_states[c], dst_states[c])
        return plan


def plan_room(local: Manifest, remote: Manifest, kv_args: KVArgs, src_kv, src_states: list, request: dict, *,
              coalesce: bool = True) -> Plan:
    """One room's plan (:meth:`RoomPlanner.plan` of a planner made for this one room)."""
    return RoomPlanner(local, remote, kv_args).plan(src_kv, src_states, request, coalesce=coalesce)


def plan_batches(plan: Plan, max_batch_rows: int) -> list[tuple[str, str, np.ndarray]]:
    """The plan's rows as batches of at most ``max_batch_rows``, one memory-kind pair each."""
    batches = []
    for (src_kind, dst_kind), parts in plan.items():
        rows = np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.uint64)
        for start in range(0, rows.shape[0], max_batch_rows):
            batches.append((src_kind, dst_kind, rows[start : start + max_batch_rows]))
    return batches


"""The HiSparse hot-buffer policy as plain Python: the model the swap-in kernel is tested against.

One :class:`HotBuffer` is one request's hot buffer in one layer: ``H`` slots, the token each holds
and the LRU order of the slots. :func:`swap_in_step` applies one decode step's top-k to it with
lists and sets only, the way the contract at the top of ``csrc/hisparse.cuh`` states it:

* ``seq_len <= H``: every position sits in its own slot; nothing changes.
* otherwise the newest token has the reserved slot ``H``; a requested token already held by a slot
  is a hit; the m-th distinct missing token (in top-k order) takes the m-th least-recently-used slot
  that is not a hit; the LRU order becomes ``[unused non-hits | misses | hits]``.

It knows nothing about bytes or device locations; :mod:`sparsekv.testing.reference.hisparse` maps
slots to locations and moves the bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class HotBuffer:
    """One request's hot buffer in one layer.

    Attributes
    ----------
    tokens : list[int]
        ``H`` entries: the token position each slot holds, -1 when empty.
    lru : list[int]
        The ``H`` slot ids, least recently used first.
    """

    tokens: list[int]
    lru: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.lru:
            self.lru = list(range(len(self.tokens)))

    @property
    def hot(self) -> int:
        """``H``, the number of hot slots."""
        return len(self.tokens)

    @classmethod
    def resident_prefix(cls, hot: int) -> HotBuffer:
        """Slot ``i`` holds position ``i`` (a prefill already on the device), LRU ``0..H-1``."""
        return cls(tokens=list(range(hot)))

    @classmethod
    def empty(cls, hot: int) -> HotBuffer:
        """No slot holds a token (every lookup misses), LRU ``0..H-1``."""
        return cls(tokens=[-1] * hot)


@dataclass
class StepResult:
    """What one step did.

    Attributes
    ----------
    slots : list[int]
        Per top-k entry: the hot slot serving it (``0..H-1``; ``H`` = the newest-token slot; on the
        fast path the position itself), or -1 for "no token".
    misses : list[tuple[int, int]]
        ``(token, slot)`` of each loaded token, in miss order.
    hits : int
        Entries served without a load this step (repeats of a hit token count each time).
    """

    slots: list[int]
    misses: list[tuple[int, int]]
    hits: int


def swap_in_step(buffer: HotBuffer, top_k: Sequence[int], seq_len: int, *, protect_recent: int = 0,
                 protect_near: int = 0) -> StepResult:
    """Apply one step's top-k to ``buffer`` (updated in place) and say which slot serves each entry.

    ``protect_recent > 0`` or ``protect_near > 0`` select a protected LRU (simulated in
    ``tools/hisparse_sim.py``; the scanning kernel's ``policy=``): a slot is protected when its
    token lies in the last ``protect_recent`` positions (``token >= seq_len - 1 - protect_recent``) or within
    ``protect_near`` positions of a token this step asks for; the misses evict, in LRU order, first
    the unprotected slots, then the protected ones; the LRU order is updated as for LRU. Both 0
    (default) is LRU, the kernels' default.

    Parameters
    ----------
    buffer : HotBuffer
        The request's hot buffer; its ``lru`` must be a permutation of ``0..H-1``.
    top_k : Sequence[int]
        Token positions; entries outside ``[0, seq_len)`` mean "no token".
    seq_len : int
        The request's length; ``seq_len - 1`` is the newest token.

    Returns
    -------
    StepResult
    """
    hot = buffer.hot
    if seq_len <= hot:
        used = min(seq_len, len(top_k))
        slots = [t if i < used and 0 <= t < seq_len else -1 for i, t in enumerate(top_k)]
        return StepResult(slots=slots, misses=[], hits=sum(s >= 0 for s in slots))

    newest = seq_len - 1
    wanted = {t for t in top_k if 0 <= t < newest}
    hit_slots = [s for s in buffer.lru if buffer.tokens[s] in wanted]
    holder = {buffer.tokens[s]: s for s in hit_slots}
    hit_tokens = set(holder)
    hit_slot_set = set(hit_slots)
    evictable = [s for s in buffer.lru if s not in hit_slot_set]
    victims = evictable
    if protect_recent > 0 or protect_near > 0:
        recent = newest - protect_recent if protect_recent > 0 else newest
        asked = sorted(wanted)

        def protected(token: int) -> bool:
            if token < 0:
                return False
            near = bisect.bisect_right(asked, token + protect_near) > bisect.bisect_left(asked, token - protect_near)
            return token >= recent or (protect_near > 0 and near)

        victims = ([s for s in evictable if not protected(buffer.tokens[s])]
                   + [s for s in evictable if protected(buffer.tokens[s])])

    # Distinct missing tokens in first-occurrence order (dict keys keep insertion order).
    missing = list(dict.fromkeys(t for t in top_k if t in wanted and t not in hit_tokens))
    if len(missing) > len(evictable):
        raise ValueError(f"hisparse model: {len(missing)} misses but only {len(evictable)} evictable slots "
                         "(a hot buffer smaller than the top-k?)")
    misses = []
    for t, s in zip(missing, victims):
        buffer.tokens[s] = t
        holder[t] = s
        misses.append((t, s))
    taken = {s for _, s in misses}
    buffer.lru = [s for s in evictable if s not in taken] + [s for _, s in misses] + hit_slots

    slots = [hot if t == newest else holder[t] if t in wanted else -1 for t in top_k]
    hits = sum(1 for t in top_k if t == newest or t in hit_tokens)
    return StepResult(slots=slots, misses=misses, hits=hits)

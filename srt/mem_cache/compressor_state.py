"""Per-request progress of the DSV4 compressors over the pool's state rings: :class:`CompressorState`.

Scheduler state, not kernel code: which tokens each request's ring holds (its accepted length and
the furthest a draft wrote), whether a rollback to an earlier position is still possible, and the
plan of each step that the compressor kernels (:mod:`sparsekv.jit_kernel.dsv4_compress`) and the
fused compress-store (:mod:`sparsekv.jit_kernel.dsv4_compress_store`) run on: the raw ring's event
sources and ring writes, planned on the device from a few numbers per request (no loop over events
or tokens, no copy from pageable memory: they go through a pinned buffer the state owns, which a
step captured in a CUDA graph reads at every replay), and the online C128 fold's segments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sparsekv.checks import as_int, int_in
from sparsekv.jit_kernel.dsv4_compress import (
    check_ratio,
    compress_extend,
    compress_online_c128,
    plan_raw_step,
    window,
)
from sparsekv.jit_kernel.dsv4_compress_store import compress_store_step
from sparsekv.jit_kernel.dsv4_store import StoreTarget
from sparsekv.srt.mem_cache.host_staging import HostStaging


def first_needed(length: int, ratio: int) -> int:
    """The first position the next entry of a sequence of ``length`` tokens still needs."""
    return max(0, (length // ratio) * ratio - (4 if ratio == 4 else 0))



@dataclass
class RawStepPlan:
    """The tables of one raw-ring step (:meth:`CompressorState.plan_raw`), int64 on the step's device.

    ``sources [E, W]`` (W = 8 for C4, 128 for C128; ``s >= 0`` input row, ``-1`` masked, ``s <= -2``
    ring row ``-s - 2``), ``anchors [E]`` (each entry's RoPE position), ``event_requests [E]`` (each
    entry's request, its index in the batch), ``writes [M, 2]`` (input row, ring row), and
    ``host_anchors``: the anchors again, on the host.
    """

    sources: torch.Tensor
    anchors: torch.Tensor
    event_requests: torch.Tensor
    writes: torch.Tensor
    host_anchors: torch.Tensor


@dataclass
class _Progress:
    valid: int = 0  # tokens of the current branch held (positions < valid)
    high: int = 0  # the largest length ever written (drafts included)


class CompressorState:
    """Streaming compressor over the state rings of ``DeepSeekV4TokenToKVPool`` (no copy of its own).

    Feed each request's new tokens in chunks of any length (a prefill chunk, one decode token, an
    MTP block); :meth:`extend` returns exactly the entries a one-shot
    :func:`~sparsekv.jit_kernel.dsv4_compress.compress_pool` over the whole sequence would have
    produced at those positions. Rejected draft tokens are undone by
    starting the next chunk at an earlier position (the accepted length).

    Parameters
    ----------
    state : torch.Tensor
        float32 or bfloat16 ``[rows, 2 * coff * d]`` ring buffer, e.g.
        ``pool.get_compress_state(layer_id)`` or ``pool.get_indexer_state(layer_id)``. With a
        bfloat16 ring every pooled kv and score is rounded to bf16 first (input rows too), so the
        entries equal ``compress_pool`` of the bf16-rounded sequence, whatever the chunking.
    ape : torch.Tensor
        float32 ``[ratio, coff * d]``.
    ratio : int
        4 or 128.
    ring_size : int
        Rows per ring (the pool's ``ring_sizes[ratio]``); at least the window (8 / 128) for the raw
        ring, an even number for ``online``.
    online : bool
        C128 only: keep a running (max, sum, accumulator) per request instead of raw rows.
        Snapshot after length ``L`` lives in rows ``2 (L % (ring_size // 2))`` and ``+1`` of the ring.

    Raises
    ------
    ValueError
        ``ratio`` not 4 or 128, ``online`` with ratio 4, ``ring_size`` too small or larger than
        ``state``, a ``state`` that is not 2-D or not twice as wide as ``ape``, an ``ape`` that is
        not ``[ratio, W]``,.
    TypeError
        ``ape`` not float32, ``state`` neither float32 nor bfloat16 (float32 only for ``online``),
        or an int argument that is not an int.

    Raw ring: token at position ``p`` of a request lives in ring row ``ring_of(p) * ring_size +
    p % ring_size`` where ``ring_of(p) = rings[p // ring_span]`` (``ring_span=None``: one ring per
    request, ``rings[0]``). For the pool's C4 rings pass the request's SWA page ids and
    ``ring_span = page_size``; for C128 rings the request slot and ``None``.

    Examples
    --------
    >>> import torch
    >>> from sparsekv.jit_kernel.dsv4 import compress_pool
    >>> from sparsekv.srt.mem_cache import CompressorState
    >>> d, ratio = 32, 4
    >>> kv, score = torch.randn(10, 2 * d), torch.randn(10, 2 * d)
    >>> ape = torch.randn(ratio, 2 * d)
    >>> state = torch.zeros(3 * 16, 4 * d)           # three rings of 16 rows (speculative size)
    >>> comp = CompressorState(state, ape, ratio, ring_size=16)
    >>> a, pos_a = comp.extend([7], [[2]], [0], kv[:6], score[:6])     # request 7, ring 2, prefill 6
    >>> b, pos_b = comp.extend([7], [[2]], [6], kv[6:9], score[6:9])   # 3 MTP drafts at 6, 7, 8
    >>> c, pos_c = comp.extend([7], [[2]], [7], kv[7:10], score[7:10]) # 1 accepted: restart at 7
    >>> pos_a.tolist(), pos_b.tolist(), pos_c.tolist()
    ([0], [4], [4])
    >>> torch.equal(torch.cat([a, c]), compress_pool(kv[:8], score[:8], ape, ratio))
    True
    """

    def __init__(self, state: torch.Tensor, ape: torch.Tensor, ratio: int, ring_size: int, online: bool = False):
        self.ratio = ratio = check_ratio(ratio)
        ring_size = as_int(ring_size, "ring_size")
        if online and ratio != 128:
            raise ValueError(f"sparsekv: argument `online` is for ratio 128 only, got ratio {ratio}")
        need = 2 if online else window(ratio)
        if ring_size < need or (online and ring_size % 2):
            raise ValueError(f"sparsekv: argument `ring_size` must be >= {need}{' and even' if online else ''}, "
                             f"got {ring_size}")
        if ape.dtype != torch.float32:
            raise TypeError(f"sparsekv: argument `ape` must have dtype float32, got {ape.dtype}")
        allowed = (torch.float32,) if online else (torch.float32, torch.bfloat16)
        if state.dtype not in allowed:
            raise TypeError(f"sparsekv: argument `state` must have dtype {' or '.join(map(str, allowed))}"
                            f"{' (online C128 keeps float32 snapshots)' if online else ''}, got {state.dtype}")
        if state.dim() != 2 or ape.dim() != 2 or ape.shape[0] != ratio or state.shape[1] != 2 * ape.shape[1]:
            raise ValueError(f"sparsekv: arguments `state` [rows, 2 W] and `ape` [ratio={ratio}, W] disagree: got "
                             f"state {list(state.shape)}, ape {list(ape.shape)}")
        if ring_size > state.shape[0]:
            raise ValueError(f"sparsekv: argument `ring_size` ({ring_size}) is larger than `state` "
                             f"({state.shape[0]} rows)")
        self.state, self.ape, self.ring_size, self.online = state, ape, ring_size, bool(online)
        self.snapshots = ring_size // 2
        self.coff = 2 if ratio == 4 else 1
        self._progress: dict[int, _Progress] = {}
        #: The pinned buffer each step's per-request numbers go to the device through, owned here so
        #: that a step captured in a CUDA graph reads it at every replay (:class:`HostStaging`).
        self.staging = HostStaging(state.device)

    def resume(self, request_id: int, length: int) -> None:
        """Continue a request whose rings already hold its first ``length`` tokens, written by another
        instance (a PD prefill sent them with the SWA pages or request slot); its next chunk starts at
        ``length``.

        Raises
        ------
        ValueError
            ``length`` is negative, or the request is already tracked here.
        """
        length, request_id = int_in(length, "length", 0), as_int(request_id, "request_id")
        if request_id in self._progress:
            raise ValueError(f"sparsekv: argument `request_id`: request {request_id} is already tracked; release it "
                             f"first")
        self._progress[request_id] = _Progress(valid=length, high=length)

    def release(self, request_id: int) -> None:
        """Forget a finished request (its rings may be reused)."""
        self._progress.pop(request_id, None)

    def _check_start(self, rid: int, start: int) -> _Progress:
        prog = self._progress.setdefault(rid, _Progress())
        if start < 0 or start > prog.valid:
            raise ValueError(f"sparsekv: argument `starts`: request {rid} holds {prog.valid} tokens, cannot start "
                             f"at {start}")
        if self.online:
            ok = start % 128 == 0 or start > prog.high - self.snapshots
        else:
            needed = first_needed(start, self.ratio)
            ok = needed >= prog.high - self.ring_size or needed >= start
        if not ok:
            raise ValueError(f"sparsekv: argument `starts`: request {rid} cannot roll back to {start}: its ring "
                             f"has since been overwritten up to length {prog.high}")
        return prog

    def extend(self, request_ids: Sequence[int], rings: Sequence[Sequence[int]], starts: Sequence[int],
               kv: torch.Tensor, score: torch.Tensor, ring_span: int | None = None,
               lengths: Sequence[int] | None = None, store: StoreTarget | None = None,
               entry_slots: Callable[[int, int], int] | None = None,
               impl: str = "auto") -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed a ragged batch of chunks; return the entries they complete.

        Parameters
        ----------
        request_ids : sequence of int
            A key per request (progress is tracked per key).
        rings : sequence of sequences of int
            Per request, its ring ids (see the class docstring).
        starts : sequence of int
            Position of each chunk's first token: the request's accepted length (equal to what it
            holds, or less to drop rejected draft tokens).
        kv, score : torch.Tensor
            float32 ``[N, coff * d]``: the chunks, request after request.
        ring_span : int or None
            Positions per ring id (None: one ring per request).
        lengths : sequence of int or None
            Tokens of each chunk (None: one request with all N rows).
        store : StoreTarget or None
            Raw ring only: pool, normalize, rotate, quantize and store each entry into
            ``store.cache`` in the same pass (no float entry is written); ``entries`` is then None.
        entry_slots : callable or None
            With ``store``: ``entry_slots(b, anchor)`` returns the cache slots of the step's entries,
            int64 ``[E]`` on kv's device, given int64 ``[E]`` tensors on kv's device of each entry's
            request (its index in the batch) and anchor (for a pool: ``full_loc(position anchor + m -
            1) // m``, a gather on the device; ``lambda b, anchor: anchor // m`` for one request
            whose slots follow its positions). It is called once per step, with torch tensors.
        impl : {"auto", "header", "triton"}
            With ``store``: the implementation of the fused kernel
            (:func:`~sparsekv.jit_kernel.dsv4_compress_store.compress_store_step`).

        Returns
        -------
        entries : torch.Tensor or None
            float32 ``[E, d]``, request after request, position ascending (None with ``store``).
        anchors : torch.Tensor
            int64 ``[E]``: each entry's RoPE position ``m * i``.

        Raises
        ------
        ValueError
            A start beyond what the request holds, a rollback past what its ring keeps (the ring was
            overwritten since), lengths that do not add up to N, a request id named twice in one
            batch, or a tensor sharing memory with the ring, ``ape`` or ``store.cache``.
        TypeError
            An id, start, length or ``ring_span`` that is not an int (``1.7`` is not truncated).
        IndexError
            A ring id outside ``state`` or missing from ``rings`` (named ``rings``), or, with
            ``store``, a slot outside the cache. Nothing is written when anything is raised.
        """
        lengths = [kv.shape[0]] if lengths is None else [as_int(n, "lengths") for n in lengths]
        request_ids = [as_int(r, "request_ids") for r in request_ids]
        starts = [as_int(s, "starts") for s in starts]
        if ring_span is not None:
            ring_span = int_in(ring_span, "ring_span", 1)
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"sparsekv: argument `request_ids` names a request twice in one batch: {request_ids}")
        if not (len(request_ids) == len(rings) == len(starts) == len(lengths)):
            raise ValueError("sparsekv: arguments `request_ids`, `rings`, `starts`, `lengths` must have one entry "
                             "per request")
        if sum(lengths) != kv.shape[0] or any(n < 0 for n in lengths):
            raise ValueError(f"sparsekv: argument `lengths` must be non-negative and add up to the rows of kv "
                             f"({kv.shape[0]}), got {lengths}")
        if store is not None and (self.online or entry_slots is None):
            raise ValueError("sparsekv: argument `store` needs `entry_slots` and the raw ring (online=False)")
        progress = [self._check_start(r, s) for r, s in zip(request_ids, starts)]
        if self.online:
            entries, anchors = self._plan_online(rings, starts, lengths, kv, score, ring_span)
        else:
            plan = self.plan_raw(rings, starts, lengths, ring_span, kv.device)
            entries, anchors = self._run_raw(plan, kv, score, store, entry_slots, impl)
        for prog, s, n in zip(progress, starts, lengths):
            prog.valid = s + n
            prog.high = max(prog.high, prog.valid)
        return entries, anchors

    def _row(self, ring_ids: Sequence[int], pos: int, span: int | None) -> int:
        index = 0 if span is None else pos // span
        if index >= len(ring_ids):
            raise IndexError(f"sparsekv: argument `rings` has {len(ring_ids)} ring ids, position {pos} needs "
                             f"id {index} (ring_span {span})")
        ring = as_int(ring_ids[index], "rings")
        if ring < 0 or (ring + 1) * self.ring_size > self.state.shape[0]:
            raise IndexError(f"sparsekv: argument `rings`: ring {ring} is outside state "
                             f"({self.state.shape[0] // self.ring_size} rings of {self.ring_size} rows)")
        return ring * self.ring_size + pos % self.ring_size

    def _ring_ids(self, ring_ids: Sequence[int], lo: int, hi: int, span: int | None) -> tuple[int, list[int]]:
        """The ring index of position ``lo`` and the checked ring ids of positions ``[lo, hi)`` (none if empty)."""
        if lo >= hi:
            return 0, []
        if span is None:
            self._row(ring_ids, lo, None)
            return 0, [as_int(ring_ids[0], "rings")]
        first, last = lo // span, (hi - 1) // span
        for index in range(first, last + 1):  # O(ring_size / span) ids, whatever the chunk's length
            self._row(ring_ids, max(lo, index * span), span)
        return first, [int(r) for r in ring_ids[first : last + 1]]

    def plan_raw(self, rings: Sequence[Sequence[int]], starts: Sequence[int], lengths: Sequence[int],
                 ring_span: int | None, device: torch.device) -> RawStepPlan:
        """The tables of one raw-ring step, planned on ``device`` (what :meth:`extend` runs; progress is
        neither checked nor changed).

        Per request the host derives a few ints (its ring reads are the window before its start, its
        writes the last ``ring_size`` positions) and checks the ring ids they touch; one small kernel
        (:func:`~sparsekv.jit_kernel.dsv4_compress.plan_raw_step`) writes the tables. The host work is
        O(requests + ring_size / ring_span) whatever the chunks' lengths, and nothing is read back.

        Parameters
        ----------
        rings, starts, lengths, ring_span
            As :meth:`extend` (ints already checked; ``lengths`` given).
        device : torch.device
            Where the tables go (kv's device).

        Raises
        ------
        IndexError
            A ring id outside ``state`` or missing from ``rings`` (named ``rings``).
        """
        m, win, rs = self.ratio, window(self.ratio), self.ring_size
        lead = 4 if m == 4 else 0
        requests, ring_table, first_entries, counts = [], [], [], []
        row0 = events = writes = 0
        for ring_ids, s, n in zip(rings, starts, lengths):
            e = s + n
            count = e // m - s // m  # entries whose last token is in [s, e)
            read_from = max(0, m * (s // m) - lead) if count else s
            write_from = max(s, e - rs)
            read_lo, read_ids = self._ring_ids(ring_ids, read_from, s, ring_span)
            write_lo, write_ids = self._ring_ids(ring_ids, write_from, e, ring_span)
            requests += [s, row0, events, writes, write_from, len(ring_table), read_lo, len(read_ids), write_lo]
            ring_table += read_ids + write_ids
            first_entries.append(s // m)
            counts.append(count)
            row0, events, writes = row0 + n, events + count, writes + e - write_from
        meta = self._staging(device).upload(torch.tensor(requests + ring_table, dtype=torch.int64))
        plan = torch.empty(events * (win + 2) + 2 * writes, dtype=torch.int64, device=device)
        plan_raw_step(meta, len(counts), m, rs, ring_span or 0, events, writes, plan)
        sources, anchors, event_requests, writes_flat = plan.split([events * win, events, events, 2 * writes])
        # The anchors once more on the host, from the same ints: entry i of a request is anchored at m i.
        counts = np.asarray(counts, dtype=np.int64)
        offsets = np.repeat(np.asarray(first_entries, dtype=np.int64) - (np.cumsum(counts) - counts), counts)
        host_anchors = torch.from_numpy(m * (offsets + np.arange(events, dtype=np.int64)))
        return RawStepPlan(sources=sources.view(events, win), anchors=anchors, event_requests=event_requests,
                           writes=writes_flat.view(writes, 2), host_anchors=host_anchors)

    def _staging(self, device: torch.device) -> HostStaging:
        """The owned staging buffer, for ``device`` (the ring's, unless a caller plans elsewhere)."""
        device, own = torch.device(device), self.staging.device
        if device.type != own.type or None not in (device.index, own.index) and device.index != own.index:
            self.staging = HostStaging(device)
        return self.staging

    def _run_raw(self, plan: RawStepPlan, kv, score, store, entry_slots, impl):
        if store is not None:
            slots = entry_slots(plan.event_requests, plan.anchors)
            compress_store_step(kv, score, self.ape, self.ratio, self.state, plan.sources, plan.writes, plan.anchors,
                                slots, store, impl=impl)
            return None, plan.host_anchors
        out = torch.empty(plan.sources.shape[0], kv.shape[-1] // self.coff, dtype=torch.float32, device=kv.device)
        compress_extend(kv, score, self.ape, self.ratio, self.state, plan.sources, plan.writes, out)
        return out, plan.host_anchors

    def _plan_online(self, rings, starts, lengths, kv, score, span):
        # The segments (each a request's tokens within one 128-window) by numpy over all of them at
        # once: no Python loop per segment, one pinned copy to the device.
        k_snap = self.snapshots
        base = np.asarray([self._row(ring_ids, 0, None) for ring_ids in rings], dtype=np.int64)
        s, n = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        e, row0 = s + n, np.cumsum(n) - n
        count = np.where(n > 0, (e - 1) // 128 - s // 128 + 1, 0)
        req = np.repeat(np.arange(len(s)), count)
        j = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)  # segment j of its request
        first, last = s[req], e[req]
        window_start = 128 * (first // 128 + j)
        pos, end = np.maximum(first, window_start), np.minimum(last, window_start + 128)
        read = np.where((j == 0) & (first % 128 != 0), base[req] + 2 * (first % k_snap), -1)
        closes = end % 128 == 0
        out_row = np.where(closes, np.cumsum(closes) - 1, -1)
        keep_from = np.maximum(first + 1, last - k_snap + 1)
        segs = np.stack([row0[req] + pos - first, pos, end - pos, read, out_row, base[req], keep_from], axis=1)
        # Segments that read a snapshot run first: a later segment may store into the same slot.
        readers = int((read >= 0).sum())
        table = self._staging(kv.device).upload(torch.from_numpy(segs[np.argsort(read < 0, kind="stable")]
                                                                 .reshape(-1, 7)))
        anchors = torch.from_numpy(end[closes] - 128)
        out = torch.empty(anchors.shape[0], kv.shape[-1], dtype=torch.float32, device=kv.device)
        for group in (table[:readers], table[readers:]):
            compress_online_c128(kv, score, self.ape, self.state, k_snap, group, out)
        return out, anchors

"""Triton twins of ``compress_store`` and ``compress_decode_store`` (``csrc/dsv4_compress_store.cuh``):
a step of the compressor's raw ring fused with the store, for the main cache (``V4``, 584-byte
``fp8_ds_mla``) and the indexer caches (``INDEXER_FP8`` 132 B, ``INDEXER_FP4`` 68 B, after the
128-point Walsh-Hadamard rotation).

Same contracts as the header entries behind
:func:`sparsekv.jit_kernel.dsv4_compress_store.compress_store_step` and
:func:`~sparsekv.jit_kernel.dsv4_compress_store.compress_decode_step` (which call :func:`compress_store`
and :func:`compress_decode_store` here for ``impl="triton"``), and the same stored bytes: one program
per event pools its window from the input rows and the ring (the planned sources, as
``compress_extend``, or for a decode step the state rows and positions read on the device, as
``compress_decode``), rounds the entry to bf16, then RMSNorm, RoPE (the indexer kinds: Hadamard)
and the quantizer, and stores the token as 64-bit words (bytes when the cache's pages are not
8-byte aligned); a second launch writes the new ring rows after every event has read the ring as it was.

Exactness. The pooled floats follow :mod:`sparsekv.jit_kernel.triton.dsv4_compress` (the header's
order of explicitly rounded steps; its exponential is libdevice's ``expf`` on a GPU, numpy's under
the interpreter). Everything after pooling is rounded as the header writes it and reproduced
exactly: the mean square in the team order of ``lane_reduce.h`` (each of 32 virtual lanes folds
channels ``l + 32 k`` in ``k`` order, then an xor butterfly 16, 8, 4, 2, 1, here as pairwise sums of
halves), ``1 / sqrt(ms + eps)`` as an IEEE square root then division, the bf16 roundings, RoPE's
products and sums (FMA contraction off), the Hadamard butterflies, the indexer FP8 scale and codes as
IEEE divisions, and the encoders of :mod:`~sparsekv.jit_kernel.triton.dsv4_quant` (integer arithmetic
on the bits). So the stored bytes equal the header's whenever the pooled entry
does: always on a GPU (same ``expf``), and under the interpreter for every entry whose pooled floats
agree (the tests compare the twin's bytes with the header's store of the twin's own entries, and
with the header's bytes where the pooled entries agree).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from sparsekv.jit_kernel.triton import interpreting
from sparsekv.jit_kernel.triton.checks import check, check_disjoint, read, row_stride, written
from sparsekv.jit_kernel.triton.dsv4_compress import LAUNCH_OPTIONS, _exp, check_inputs
from sparsekv.jit_kernel.triton.dsv4_quant import (
    check_unique_slots,
    float_to_bf16,
    hardware_fp8,
    store_v4_token,
    word_aligned,
)
from sparsekv.jit_kernel.triton.dsv4_store import (
    KINDS,
    apply_rope,
    check_store,
    hadamard_128,
    round_bf16,
    store_indexer_fp4_token,
    store_indexer_fp8_token,
    team_sum,
)

__all__ = ["AOT_KERNELS", "compress_decode_store", "compress_store"]

NUM_WARPS = 4


@triton.jit
def _bf16_to_float(bits):
    """bf16 bits (any int type, low 16 bits) -> float32, exactly."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _slot_rows(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ring_ptr, num_ring_rows, src, half, c, d,
               COFF: tl.constexpr, RING_BF16: tl.constexpr):
    """kv and score of channels ``half + c`` of the row a slot names (``src >= 0``: input row ``src``;
    ``src <= -2``: ring row ``-src - 2``), and whether it names one (``slot_rows`` of the header). A bf16
    ring rounds input rows to bf16 too."""
    is_input = (src >= 0) & (src < num_inputs)
    ring_row = -src - 2
    is_ring = (src <= -2) & (ring_row < num_ring_rows)
    # Masks as bounds times a 0/1 flag: the interpreter's `&` of a scalar and a block is no mask.
    from_input = c < d * tl.where(is_input, 1, 0)
    from_ring = c < d * tl.where(is_ring, 1, 0)
    row = tl.where(is_input, src, 0)
    kv = tl.load(kv_ptr + row * kv_stride + half + c, mask=from_input, other=0.0)
    score = tl.load(score_ptr + row * score_stride + half + c, mask=from_input, other=0.0)
    at = tl.where(is_ring, ring_row, 0) * (2 * COFF * d) + half + c
    if RING_BF16:
        kv = tl.where(is_input, round_bf16(kv), _bf16_to_float(tl.load(ring_ptr + at, mask=from_ring, other=0)))
        score = tl.where(is_input, round_bf16(score),
                         _bf16_to_float(tl.load(ring_ptr + at + COFF * d, mask=from_ring, other=0)))
    else:
        kv = tl.where(is_input, kv, tl.load(ring_ptr + at, mask=from_ring, other=0.0))
        score = tl.where(is_input, score, tl.load(ring_ptr + at + COFF * d, mask=from_ring, other=0.0))
    return kv, score, is_input | is_ring


@triton.jit
def _slot_half(j, d, RATIO: tl.constexpr):
    """Channel offset of slot ``j``'s half (C4: ``d`` for slots 4-7) and its row of ``ape``."""
    if RATIO == 4:
        return tl.where(j >= 4, d, 0), j & 3
    else:
        return j * 0, j


@triton.jit
def _source(sources_ptr, rows_ptr, rows_stride, e, pos, j, WINDOW: tl.constexpr, DECODE: tl.constexpr):
    """The row slot ``j`` of event ``e`` reads (``>= 0``: an input row, ``-1``: none, ``<= -2``: ring row
    ``-src - 2``): from the planned table, or for a decode step (``DecodeRows``) the new token (input row
    ``e``) in the last slot, ring row ``rows[e, j]`` before it, nothing before position 0."""
    if DECODE:
        ring = tl.load(rows_ptr + e * rows_stride + j).to(tl.int64)
        src = tl.where(j == WINDOW - 1, e, tl.where(ring >= 0, -2 - ring, -1))
        return tl.where(pos - (WINDOW - 1) + j < 0, -1, src)
    else:
        return tl.load(sources_ptr + e * WINDOW + j)


@triton.jit
def _slot(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ape_ptr, ring_ptr, num_ring_rows, sources_ptr,
          rows_ptr, rows_stride, e, pos, j, c, d, RATIO: tl.constexpr, RING_BF16: tl.constexpr,
          DECODE: tl.constexpr):
    """Slot ``j`` of event ``e`` on channels ``c``: its kv, its logit ``score + ape`` and whether the event
    reads a row for it."""
    WINDOW: tl.constexpr = 8 if RATIO == 4 else RATIO
    COFF: tl.constexpr = 2 if RATIO == 4 else 1
    src = _source(sources_ptr, rows_ptr, rows_stride, e, pos, j, WINDOW, DECODE)
    half, ape_row = _slot_half(j, d, RATIO)
    kv, score, ok = _slot_rows(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ring_ptr, num_ring_rows, src,
                               half, c, d, COFF, RING_BF16)
    return kv, score + tl.load(ape_ptr + ape_row * (COFF * d) + half + c), ok


@triton.jit
def _pool_event(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ape_ptr, ring_ptr, num_ring_rows,
                sources_ptr, rows_ptr, rows_stride, e, pos, c, d, RATIO: tl.constexpr, RING_BF16: tl.constexpr,
                DECODE: tl.constexpr, NATIVE: tl.constexpr):
    """Event ``e``'s entry on channels ``c`` (any shape): the header's ``pool_tile`` over the slots it
    reads (:func:`_source`), in slot order, every step rounded as written."""
    WINDOW: tl.constexpr = 8 if RATIO == 4 else RATIO
    m = tl.full(c.shape, float("-inf"), tl.float32)
    for j in range(WINDOW):
        _, logit, ok = _slot(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ape_ptr, ring_ptr,
                             num_ring_rows, sources_ptr, rows_ptr, rows_stride, e, pos, j, c, d, RATIO, RING_BF16,
                             DECODE)
        m = tl.where(ok & (logit > m), logit, m)
    total = tl.zeros(c.shape, tl.float32)
    acc = tl.zeros(c.shape, tl.float32)
    for j in range(WINDOW):
        kv, logit, ok = _slot(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ape_ptr, ring_ptr,
                              num_ring_rows, sources_ptr, rows_ptr, rows_stride, e, pos, j, c, d, RATIO, RING_BF16,
                              DECODE)
        w = tl.where(ok, _exp(logit - m, NATIVE), 0.0)  # a masked slot adds +0.0: the header skips it
        total = total + w
        acc = acc + w * kv
    return tl.where(total > 0.0, tl.div_rn(acc, tl.where(total > 0.0, total, 1.0)), 0.0)


@triton.jit
def _row_of(tile, k, ROWS: tl.constexpr):
    """Row ``k`` of a 2-D tile, exactly (sign of zero included: -0.0 is the additive identity)."""
    return tl.sum(tl.where(tl.arange(0, ROWS)[:, None] == k, tile, -0.0), 0)


@triton.jit
def _store_entry(x, weight_ptr, eps, cos_ptr, sin_ptr, rope_positions, pos, slot, stores, cache_ptr, page_stride,
                 page_shift, num_slots, KIND: tl.constexpr, PACKED: tl.constexpr, FP8_HW: tl.constexpr):
    """The header's ``NormRopeStore<Kind>::finish`` of a pooled ``[ROWS, 64]`` entry: bf16, RMSNorm, RoPE
    at ``pos`` on the last 64 dims, (the indexer kinds: Hadamard,) quantize and store into ``slot``;
    nothing is stored unless ``stores`` and the slot and the position lie in the cache and the RoPE
    table (the work is then done on slot 0, position 0)."""
    ROWS: tl.constexpr = 8 if KIND == 0 else 2
    valid = stores & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < rope_positions)
    slot = tl.where(valid, slot, 0)
    pos = tl.where(valid, pos, 0)
    c = tl.arange(0, ROWS)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = round_bf16(x)
    ms = tl.div_rn(team_sum(tl.reshape(x * x, (ROWS * 2, 32)), ROWS * 2), tl.full((), ROWS * 64, tl.float32))
    inv = tl.div_rn(tl.full((), 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    y = round_bf16((x * inv) * tl.load(weight_ptr + c))
    pair = pos * 32 + tl.arange(0, 32)  # the table's row of 32 pairs
    rope = apply_rope(_row_of(y, ROWS - 1, ROWS), tl.load(cos_ptr + pair), tl.load(sin_ptr + pair))
    page_base = (slot >> page_shift) * page_stride
    in_page = slot & ((1 << page_shift) - 1)
    if KIND == 0:
        value_off = page_base + in_page * 576
        scale_off = page_base + (1 << page_shift) * 576 + in_page * 8
        store_v4_token(cache_ptr, value_off, scale_off, y, rope, valid, PACKED, FP8_HW)
    else:  # the 128-wide row: its first 64 dims, then the rotated 64
        z = hadamard_128(_row_of(y, 0, ROWS), rope)
        value_bytes: tl.constexpr = 64 if KIND == 2 else 128
        value_off = page_base + in_page * value_bytes
        scale_off = page_base + (1 << page_shift) * value_bytes + in_page * 4
        if KIND == 2:
            store_indexer_fp4_token(cache_ptr, value_off, scale_off, z, valid, PACKED)
        else:
            store_indexer_fp8_token(cache_ptr, value_off, scale_off, z, valid, PACKED, FP8_HW)


@triton.jit
def compress_store_kernel(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ape_ptr, ring_ptr, num_ring_rows,
                          sources_ptr, weight_ptr, eps, positions_ptr, cos_ptr, sin_ptr, rope_positions, slots_ptr,
                          cache_ptr, page_stride, page_shift, num_slots, RATIO: tl.constexpr,
                          RING_BF16: tl.constexpr, KIND: tl.constexpr, PACKED: tl.constexpr, NATIVE: tl.constexpr,
                          FP8_HW: tl.constexpr):
    """Event ``e``: pool, then store into ``slots[e]`` at RoPE position ``positions[e]`` (``CompressStore<Kind>``)."""
    ROWS: tl.constexpr = 8 if KIND == 0 else 2
    e = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, ROWS)[:, None] * 64 + tl.arange(0, 64)[None, :]  # [ROWS, 64]: channel 64 r + q
    x = _pool_event(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ape_ptr, ring_ptr, num_ring_rows,
                    sources_ptr, sources_ptr, 0, e, 0, c, ROWS * 64, RATIO, RING_BF16, False, NATIVE)
    _store_entry(x, weight_ptr, eps, cos_ptr, sin_ptr, rope_positions, tl.load(positions_ptr + e),
                    tl.load(slots_ptr + e), True, cache_ptr, page_stride, page_shift, num_slots, KIND, PACKED, FP8_HW)


@triton.jit
def compress_decode_store_kernel(kv_ptr, score_ptr, kv_stride, score_stride, batch, ape_ptr, ring_ptr, num_ring_rows,
                                 rows_ptr, rows_stride, positions_ptr, out_ptr, emitted_ptr, weight_ptr, eps, cos_ptr,
                                 sin_ptr, rope_positions, slots_ptr, cache_ptr, page_stride, page_shift, num_slots,
                                 RATIO: tl.constexpr, RING_BF16: tl.constexpr, KIND: tl.constexpr,
                                 PACKED: tl.constexpr, NATIVE: tl.constexpr, FP8_HW: tl.constexpr):
    """Batch row ``b`` of a decode step: its entry (zeros unless its token completes one) into ``out``,
    the flag into ``emitted``, and a completed entry stored into ``slots[b]`` at its anchor
    ``positions[b] - ratio + 1`` (``CompressStore<Kind>`` with ``DecodeRows``)."""
    ROWS: tl.constexpr = 8 if KIND == 0 else 2
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + b)
    emits = (pos >= 0) & ((pos + 1) % RATIO == 0)
    c = tl.arange(0, ROWS)[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = _pool_event(kv_ptr, score_ptr, kv_stride, score_stride, batch, ape_ptr, ring_ptr, num_ring_rows, rows_ptr,
                    rows_ptr, rows_stride, b, pos, c, ROWS * 64, RATIO, RING_BF16, True, NATIVE)
    x = tl.where(emits, x, 0.0)
    tl.store(out_ptr + b * (ROWS * 64) + c, x)
    tl.store(emitted_ptr + b, emits)
    _store_entry(x, weight_ptr, eps, cos_ptr, sin_ptr, rope_positions, pos - (RATIO - 1), tl.load(slots_ptr + b),
                    emits, cache_ptr, page_stride, page_shift, num_slots, KIND, PACKED, FP8_HW)


@triton.jit
def ring_write_kernel(kv_ptr, score_ptr, kv_stride, score_stride, num_inputs, ring_ptr, num_ring_rows, writes_ptr,
                      rows_stride, width, RING_BF16: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                      DECODE: tl.constexpr):
    """Write ``i``: input row ``writes[i, 0]`` into ring row ``writes[i, 1]`` as ``[kv | score]``; for a
    decode step (``writes`` the state rows) row ``i`` into ring row ``writes[i, WINDOW - 1]`` (``RingWrite``)."""
    i = tl.program_id(0).to(tl.int64)
    if DECODE:
        src = i
        dst = tl.load(writes_ptr + i * rows_stride + WINDOW - 1).to(tl.int64)
    else:
        src = tl.load(writes_ptr + 2 * i)
        dst = tl.load(writes_ptr + 2 * i + 1)
    ok = (src >= 0) & (src < num_inputs) & (dst >= 0) & (dst < num_ring_rows)
    src = tl.where(ok, src, 0)
    dst = tl.where(ok, dst, 0)
    on = tl.where(ok, 1, 0)  # a bound times `on`: the interpreter's `&` of a scalar and a block is no mask
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        mask = c < width * on
        kv = tl.load(kv_ptr + src * kv_stride + c, mask=mask, other=0.0)
        score = tl.load(score_ptr + src * score_stride + c, mask=mask, other=0.0)
        row = ring_ptr + dst * 2 * width
        if RING_BF16:
            tl.store(row + c, float_to_bf16(kv).to(tl.int16), mask=mask)
            tl.store(row + width + c, float_to_bf16(score).to(tl.int16), mask=mask)
        else:
            tl.store(row + c, kv, mask=mask)
            tl.store(row + width + c, score, mask=mask)


def _check_extend(kv, score, ape, ratio, state, sources, writes):
    """``check_extend`` of ``dsv4_compress.cuh``: returns ``(d, ring_bf16)``."""
    d = check_inputs(kv, score, ape, ratio)
    width = kv.shape[1]
    ring_bf16 = state.dtype == torch.bfloat16
    if not ring_bf16:
        check(state, "state").dtype(torch.float32)
    check(state, "state").ndim(2).contiguous().same_device(kv, "kv").size(1, 2 * width, "2 x width of kv")
    check(sources, "sources").dtype(torch.int64).ndim(2).contiguous().same_device(kv, "kv")
    check(sources, "sources").size(1, 8 if ratio == 4 else ratio, "window slots")
    check(writes, "writes").dtype(torch.int64).ndim(2).contiguous().same_device(kv, "kv").size(1, 2, "pairs")
    ring_rows = state.shape[0]
    if kv.device.type != "cuda":  # host-readable: the interpreter would read outside the tensors
        # One vectorized pass over each table (numpy views, no copy), then the first bad entry in
        # row-major order, the one the header's loop names.
        src = sources.numpy().ravel()
        bad = np.flatnonzero((src >= kv.shape[0]) | ((src <= -2) & (-src - 2 >= ring_rows)))
        if bad.size:
            raise IndexError(f"sparsekv: argument `sources` entry {bad[0]} = {src[bad[0]]} names a row outside kv "
                             f"({kv.shape[0]}) or state ({ring_rows})")
        pairs = writes.numpy()
        bad = np.flatnonzero(((pairs < 0) | (pairs >= (kv.shape[0], ring_rows))).any(axis=1))
        if bad.size:
            a, b = pairs[bad[0]]
            raise IndexError(f"sparsekv: argument `writes` pair {bad[0]} = ({a}, {b}) is outside kv or state")
    return d, ring_bf16


def _check_rope_position(pos, n, rope_positions):
    if pos < 0 or pos >= rope_positions:
        raise IndexError(f"sparsekv: argument `positions`[{n}] gives RoPE position {pos}, outside the RoPE table "
                         f"[0, {rope_positions})")


def check_compress_store_arguments(kv, score, ape, ratio, state, sources, writes, weight, eps, positions, cache,
                                   slots, page_slots, rope_cos, rope_sin, cache_kind):
    """The header entry ``compress_store<Kind>``'s checks, in its order (same exceptions and messages);
    returns ``(d, ring_bf16, page_shift, num_slots)``."""
    check_disjoint(read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                   read(sources, "sources"), read(writes, "writes"), read(weight, "weight"),
                   read(positions, "positions"), written(cache, "cache"), read(slots, "slots"),
                   read(rope_cos, "rope_cos"), read(rope_sin, "rope_sin"))
    d, ring_bf16 = _check_extend(kv, score, ape, ratio, state, sources, writes)
    _, dim, _ = KINDS[cache_kind]
    if d != dim:
        raise ValueError(f"sparsekv: argument `kv` gives entries of width {d}, but this cache stores {dim}")
    shift, num_slots = check_store(sources.shape[0], cache_kind, weight, eps, positions, cache, slots, page_slots,
                                   rope_cos, rope_sin)
    check(cache, "cache").same_device(kv, "kv")
    return d, ring_bf16, shift, num_slots


def compress_store(kv, score, ape, ratio, state, sources, writes, weight, eps, positions, cache, slots, page_slots,
                   rope_cos, rope_sin, cache_kind):
    """Check (:func:`check_compress_store_arguments`), pool + store every event, then write the ring rows.

    The body of the ``sparsekv::compress_store`` op for ``impl="triton"``.

    Raises
    ------
    TypeError, ValueError, IndexError
        The header's refusals, same types and messages; nothing is written.
    """
    d, ring_bf16, shift, num_slots = check_compress_store_arguments(
        kv, score, ape, ratio, state, sources, writes, weight, eps, positions, cache, slots, page_slots, rope_cos,
        rope_sin, cache_kind)
    ring = state.view(torch.int16) if ring_bf16 else state
    stride = row_stride(cache)
    if sources.shape[0] > 0:
        compress_store_kernel[(sources.shape[0],)](
            kv, score, row_stride(kv), row_stride(score), kv.shape[0], ape, ring, state.shape[0], sources, weight,
            float(eps), positions, rope_cos, rope_sin, rope_cos.shape[0], slots, cache, stride, shift, num_slots,
            RATIO=ratio, RING_BF16=ring_bf16, KIND=KINDS[cache_kind][0],
            PACKED=word_aligned(cache), NATIVE=not interpreting(), FP8_HW=hardware_fp8(cache),
            num_warps=NUM_WARPS,
            **LAUNCH_OPTIONS)
    if writes.shape[0] > 0:
        _write_ring(kv, score, ring, state.shape[0], writes, 0, writes.shape[0], ring_bf16, 0, False)


def _check_decode(kv, score, ape, ratio, state, state_rows, positions, emitted):
    """``check_decode`` of ``dsv4_compress.cuh``: returns ``(d, ring_bf16)``."""
    d = check_inputs(kv, score, ape, ratio)
    width, batch, window = kv.shape[1], kv.shape[0], 8 if ratio == 4 else ratio
    ring_bf16 = state.dtype == torch.bfloat16
    if not ring_bf16:
        check(state, "state").dtype(torch.float32)
    check(state, "state").ndim(2).contiguous().same_device(kv, "kv").size(1, 2 * width, "2 x width of kv")
    check(state_rows, "state_rows").dtype(torch.int32, torch.int64)
    check(state_rows, "state_rows").ndim(2).rows_dense().same_device(kv, "kv").size(0, batch, "rows of kv")
    check(state_rows, "state_rows").size(1, window, "the window (8 for ratio 4, 128 for ratio 128)")
    check(positions, "positions").dtype(torch.int64).ndim(1).contiguous().same_device(kv, "kv")
    check(positions, "positions").size(0, batch, "rows of kv")
    check(emitted, "emitted").dtype(torch.bool).ndim(1).contiguous().same_device(kv, "kv").size(0, batch, "rows of kv")
    ring_rows = state.shape[0]
    if kv.device.type != "cuda":  # host-readable: one vectorized pass, then the header's first refusal
        rows, pos = state_rows.numpy(), positions.numpy()
        # Column 0: a negative position; column 1 + j: slot j is read (its position pos - (W - 1) + j
        # is not before 0) and its row lies outside the ring.
        bad = np.concatenate([(pos < 0)[:, None], (np.arange(window) >= window - 1 - pos[:, None])
                              & ((rows < 0) | (rows >= ring_rows)) & (pos >= 0)[:, None]], axis=1)
        first = np.flatnonzero(bad)
        if first.size:
            b, j = divmod(int(first[0]), window + 1)
            if j == 0:
                raise IndexError(f"sparsekv: argument `positions`[{b}] = {pos[b]} is negative")
            raise IndexError(f"sparsekv: argument `state_rows`[{b}, {j - 1}] = {rows[b, j - 1]} is outside state "
                             f"[0, {ring_rows})")
        written_rows = np.sort(rows[:, window - 1])
        twice = np.flatnonzero(written_rows[1:] == written_rows[:-1])
        if twice.size:
            raise ValueError(f"sparsekv: argument `state_rows` gives ring row {written_rows[twice[0]]} to the new "
                             f"token of two batch rows")
    return d, ring_bf16


def check_compress_decode_store_arguments(kv, score, ape, ratio, state, state_rows, positions, out, emitted, weight,
                                          eps, cache, slots, page_slots, rope_cos, rope_sin, cache_kind):
    """The header entry ``compress_decode_store<Kind>``'s checks, in its order (same exceptions and
    messages); returns ``(ring_bf16, page_shift, num_slots)``."""
    check_disjoint(read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(state, "state"),
                   read(state_rows, "state_rows"), read(positions, "positions"), written(out, "out"),
                   written(emitted, "emitted"), read(weight, "weight"), written(cache, "cache"), read(slots, "slots"),
                   read(rope_cos, "rope_cos"), read(rope_sin, "rope_sin"))
    check(out, "out").dtype(torch.float32).ndim(2).contiguous().same_device(kv, "kv")
    d, ring_bf16 = _check_decode(kv, score, ape, ratio, state, state_rows, positions, emitted)
    _, dim, _ = KINDS[cache_kind]
    if d != dim:
        raise ValueError(f"sparsekv: argument `kv` gives entries of width {d}, but this cache stores {dim}")
    check(out, "out").size(0, kv.shape[0], "rows of kv").size(1, dim, "d")
    check(cache, "cache").same_device(kv, "kv")
    shift, num_slots = check_store(kv.shape[0], cache_kind, weight, eps, positions, cache, slots, page_slots,
                                   rope_cos, rope_sin, read_slots=False)
    if cache.device.type != "cuda":  # host-readable: the rows that complete an entry store it
        pos = positions.numpy()
        emits = (pos >= 0) & ((pos + 1) % ratio == 0)
        anchors = pos - (ratio - 1)
        bad = np.flatnonzero(emits & ((anchors < 0) | (anchors >= rope_cos.shape[0])))
        if bad.size:
            _check_rope_position(int(anchors[bad[0]]), int(bad[0]), rope_cos.shape[0])
        check_unique_slots(slots.numpy()[emits], num_slots)
    return ring_bf16, shift, num_slots


def compress_decode_store(kv, score, ape, ratio, state, state_rows, positions, out, emitted, weight, eps, cache,
                          slots, page_slots, rope_cos, rope_sin, cache_kind):
    """Check (:func:`check_compress_decode_store_arguments`), pool every row's window (and store the
    entries that complete), then write each row's new token into its ring row.

    The body of the ``sparsekv::compress_decode_store`` op for ``impl="triton"``.
    """
    ring_bf16, shift, num_slots = check_compress_decode_store_arguments(
        kv, score, ape, ratio, state, state_rows, positions, out, emitted, weight, eps, cache, slots, page_slots,
        rope_cos, rope_sin, cache_kind)
    batch = kv.shape[0]
    if batch == 0:
        return
    ring = state.view(torch.int16) if ring_bf16 else state
    stride = row_stride(cache)
    rows_stride = row_stride(state_rows)
    compress_decode_store_kernel[(batch,)](
        kv, score, row_stride(kv), row_stride(score), batch, ape, ring, state.shape[0], state_rows, rows_stride,
        positions, out, emitted, weight, float(eps), rope_cos, rope_sin, rope_cos.shape[0], slots, cache, stride,
        shift, num_slots, RATIO=ratio, RING_BF16=ring_bf16, KIND=KINDS[cache_kind][0],
        PACKED=word_aligned(cache), NATIVE=not interpreting(), FP8_HW=hardware_fp8(cache),
            num_warps=NUM_WARPS,
        **LAUNCH_OPTIONS)
    _write_ring(kv, score, ring, state.shape[0], state_rows, rows_stride, batch, ring_bf16,
                8 if ratio == 4 else ratio, True)


def _write_ring(kv, score, ring, ring_rows, writes, rows_stride, count, ring_bf16, window, decode):
    """Launch :func:`ring_write_kernel` over ``count`` writes (``writes``: the pairs, or the state rows)."""
    width = kv.shape[1]
    ring_write_kernel[(count,)](kv, score, row_stride(kv), row_stride(score), kv.shape[0], ring, ring_rows, writes,
                                rows_stride, width, RING_BF16=ring_bf16, BLOCK=min(1024, triton.next_power_of_2(width)),
                                WINDOW=window, DECODE=decode, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)


def _aot_kernels():
    from sparsekv.jit_kernel.triton.aot import AotKernel, Constexpr, Float, Int, Pointer

    def rows(kv_width: int, ring_bf16: bool, ring_rows: int) -> dict:
        """Contiguous fp32 [T, coff * d] kv and score, and a float32 or bf16 ring of ``ring_rows`` rows."""
        return {"kv_ptr": Pointer("fp32"), "score_ptr": Pointer("fp32"), "kv_stride": Int(kv_width),
                "score_stride": Int(kv_width), "ring_ptr": Pointer("i16" if ring_bf16 else "fp32"),
                "num_ring_rows": Int(ring_rows)}

    def store(kind: str) -> dict:
        """The store's arguments: a 64k-position RoPE table, 64-slot pages of 1024 pages."""
        return {"weight_ptr": Pointer("fp32"), "eps": Float(), "cos_ptr": Pointer("fp32", aligned=False),
                "sin_ptr": Pointer("fp32", aligned=False), "rope_positions": Int(65536),
                "slots_ptr": Pointer("i64", aligned=False), "cache_ptr": Pointer("u8"),
                "page_stride": Int(KINDS[kind][2].page_bytes(64)), "page_shift": Int(6), "num_slots": Int(65536),
                "positions_ptr": Pointer("i64", aligned=False)}

    # V4 at both ratios, float32 and bf16 rings (the decode's state rows int64 and int32 alike); the
    # indexer caches at C4 with a float32 ring.
    configs = [("V4", ratio, ring_bf16) for ratio in (4, 128) for ring_bf16 in (False, True)]
    configs += [(kind, 4, False) for kind in ("INDEXER_FP8", "INDEXER_FP4")]
    # The integer arguments at the benchmark's serving shape: a 4k-token prefill chunk (a decode step of
    # batch 64), a ring of 2 * window rows per request.
    kernels = []
    for kind, ratio, ring_bf16 in configs:
        constexprs = {"RATIO": Constexpr(ratio), "RING_BF16": Constexpr(ring_bf16), "KIND": Constexpr(KINDS[kind][0]),
                      "PACKED": Constexpr(True), "NATIVE": Constexpr(True), "FP8_HW": Constexpr(True)}
        width = (2 if ratio == 4 else 1) * (512 if kind == "V4" else 128)
        ring_rows = 2 * (8 if ratio == 4 else 128)
        what = f"{kind},C{ratio},{'bf16' if ring_bf16 else 'fp32'} ring"
        kernels.append(AotKernel(f"dsv4_compress_store.prefill[{what}]", compress_store_kernel,
                                 {**rows(width, ring_bf16, ring_rows), "num_inputs": Int(4096),
                                  "ape_ptr": Pointer("fp32"), "sources_ptr": Pointer("i64"), **store(kind),
                                  **constexprs},
                                 NUM_WARPS, LAUNCH_OPTIONS))
        kernels.append(AotKernel(f"dsv4_compress_store.decode[{what}]", compress_decode_store_kernel,
                                 {**rows(width, ring_bf16, 64 * ring_rows), "batch": Int(64),
                                  "ape_ptr": Pointer("fp32"), "rows_ptr": Pointer("i32" if ring_bf16 else "i64"),
                                  "rows_stride": Int(2 * ring_rows), "out_ptr": Pointer("fp32"),
                                  "emitted_ptr": Pointer("u1", aligned=False), **store(kind), **constexprs},
                                 NUM_WARPS, LAUNCH_OPTIONS))
    for ring_bf16 in (False, True):
        for decode in (False, True):
            name = f"dsv4_compress_store.ring_write[{'bf16' if ring_bf16 else 'fp32'}{',decode' if decode else ''}]"
            kernels.append(AotKernel(name, ring_write_kernel,
                                     {**rows(1024, ring_bf16, 64 * 16), "num_inputs": Int(64 if decode else 4096),
                                      "writes_ptr": Pointer("i32" if decode and ring_bf16 else "i64"),
                                      "rows_stride": Int(2 * 16 if decode else 16), "width": Int(2048),
                                      "RING_BF16": Constexpr(ring_bf16), "BLOCK": Constexpr(1024),
                                      "WINDOW": Constexpr(8 if decode else 0), "DECODE": Constexpr(decode)},
                                     NUM_WARPS, LAUNCH_OPTIONS))
    return kernels


#: The launch configurations :mod:`sparsekv.jit_kernel.triton.aot` compiles ahead of time.
AOT_KERNELS = _aot_kernels()

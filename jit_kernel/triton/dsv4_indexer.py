"""Triton twins of ``csrc/dsv4_indexer.cuh``: lightning-indexer scores on tensor cores, and the top-k.

Same contracts as :func:`sparsekv.jit_kernel.dsv4_indexer.indexer_scores` and
:func:`~sparsekv.jit_kernel.dsv4_indexer.indexer_topk` (which call these for ``impl="triton"``).

Scores. A persistent grid (two programs per SM) over chunks of ``ENTRIES`` consecutive entries of
one row: a program loads the row's query ``[heads, 128]`` (padded to 16 heads for ``tl.dot``) and
weights once per chunk and sweeps the chunk in tiles of ``BLOCK_E`` keys. Each key is one
contiguous 128-byte (FP8) or 64-byte (FP4) record, streamed into shared memory by ``cp.async``
(FP8: 16-byte copies on sm_100a, 8-byte on sm_90a, where triton picks that width for the register
operand; FP4: 16-byte on both), and its scale is one 4-byte word (FP8: the fp32 scale; FP4: the 4
UE8M0 bytes, split by shifts), so ``k_cache`` and its rows must start 4-byte aligned, as
torch's allocations do (a view that does not is refused, naming it).
A tile's logits are one ``tl.dot`` ``[BLOCK_E, 128] x [128, heads]`` with float32
accumulation, keys on the M side, so ``relu * weight`` and the sum over heads, the epilogue, run
along each thread's own accumulator columns (a few shuffles, not a reduction across warps).
FP8: the e4m3 codes go to float16 by the hardware convert (``F2FP``; e4m3 is exact in float16),
and the query is scaled per head by a power of two putting its largest element in float16's top
binade, so a bf16 query is exact in float16 (a float32 one is split into float16 high and low
parts, 22 bits); ``1/s`` and the key's fp32 scale are applied to the dot's result. FP4: e2m1 times
its power-of-two block scale is exact in bf16, and the query is bf16 (float32: high and low bf16
parts); an e2m1 code becomes float32 by shifts and one exact multiply (:func:`_e2m1_pairs_to_float`). The
products are exact, so the scores keep the header's tolerance, ``|s - ref| <= 1e-5 sum_h |w_h|
|q_h| |k|`` (2e-5 from the header's own scores; under the interpreter the property cases measure
at most 5.2e-7).

Why float16 operands and not ``tl.dot`` on e4m3 (``QGMMA``): an e4m3 dot needs the query in e4m3
too. One e4m3 term rounds the query by up to 2^-4, moving the scores by about 1e-2 of the bound
above and the top-k they feed away from the header's; two terms (high and low e4m3, which hold a
bf16 query's 8 significant bits exactly) cost two QGMMA passes, the tensor time of one float16
HGMMA pass, so nothing is gained; and Hopper's fp8 MMA accumulates at reduced precision, which
would break the tolerance on the GPU. Both designs are bound by HBM (below), not the tensor cores:
the float16 dot of 64k keys x 64 heads is 1.1 GFLOP, 1.1 us at an H200's 989 TFLOPS, under the
1.9 us of its bytes; the keys' convert is 32 ``F2FP`` per thread per tile, 5% of the loop.

Design note (bound, shape). HBM-bound: one row of 64 heads over 64k FP8 entries reads 8.9 MB (1.9 us
at 4.8 TB/s, H200). Its 256 chunks of 256 entries are two programs on each of 128 SMs. Larger
batches keep 2 programs per SM, each looping over its chunks; the query, 16 KB bf16, is read (from
L2) once per 4 tiles, 1/2 of the keys' bytes, the price of spreading one row over the GPU.
Instruction budget (triton 3.9, the AOT build, which is the JIT's; :data:`SCORES_OPTIONS`): the tile
loop is 577 SASS instructions per warp on sm_90a (8 ``HGMMA.64x64x16``, 32 ``F2FP.F16.E4M3``, 8
``LDGSTS.E.64`` of the keys, the rest addresses, masks and the epilogue; its entry indices are
int32) and 417 on sm_100a (8 ``UTCHMMA``); 1,024 tiles x 4 warps x 577 over 132 SMs x 4 schedulers
x 1.98 GHz = 2.3 us, 1.2x the H200 roofline (B200: 1.5 us against 1.1 us, 1.3x;
``tools/bench/bench_sass_budget.py``), so the target of 3x the roofline is within reach of issue
alone. Before (software e4m3 decode, heads summed across warps): 2,653 per tile, 10.7 us, 5.8x; with
int64 entry indices and no register cap, 606 and 457. FP4 (68-byte records, a roofline of 0.99 us
at 64k on the H200) is bound by the issue of its e2m1 decode, 64 codes per thread per tile at about
5 instructions each (two shifts, a masked merge, two multiplies, half a pack to bf16): the tile loop
is 719 instructions on sm_90a (2.8 us, 2.85x) and 622 on sm_100a (2.2 us against 0.59, 3.7x);
before (scales loaded a byte per 8 dims, ``LDG.E.U8``, keys by 4-byte ``cp.async`` on sm_90a, a
decode by int-to-float converts and selects) 2,114 and 2,096, 8.4x and 12.5x.

Top-k, in one read of the scores with the selection on chip (:func:`indexer_topk`). A level splits
each row into chunks of at least 4096 items (``4 k`` when that is more), one program per chunk, so a
64k-entry row at batch 1 runs on 16 programs: a program loads its chunk once into registers, finds its
``k``-th largest 32-bit key by a bisection on the key bits (32 block-wide counts, no memory traffic),
and writes the chunk's ``k`` best (keys and positions, in position order; -1 padding) to a scratch
list at most a quarter of the input's length. When the list fits one program (8192 items), the
finish selects the row's ``k`` best from it the same way and writes them in ascending position with
prefix sums, -1 after them. The best ``k`` of a row, ordered by (key descending, position
ascending), are among the best ``k`` of each chunk under the same order, so the output is identical
to the header's (same keys, equal keys at the threshold taken lowest position first). A ``k`` above
4096 on a row longer than 8192 entries cannot stay on chip: that call takes the radix kernel (three
histogram passes of 11, 11 and 10 bits over the row, then a pass writing the selection).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparsekv.jit_kernel.triton import interpreting
from sparsekv.jit_kernel.triton.checks import (
    check,
    check_disjoint,
    optional_arg,
    page_shift,
    read,
    row_stride,
    visible_entries,
    written,
)
from sparsekv.jit_kernel.triton.dsv4_attention import _mma, _round_bf16, _ue8m0_to_float
from sparsekv.kv_layout import INDEXER_FP4, INDEXER_FP8

__all__ = ["AOT_KERNELS", "indexer_scores", "indexer_topk", "topk_workspace_ints"]

DIM = 128
MAX_HEADS = 64
BLOCK_E = 64
ENTRIES = 256  # per chunk: the query is loaded (and scaled) once per 4 tiles
PROGRAMS_PER_SM = 2  # the scores' persistent grid
TOPK_BLOCK = 1024  # per step of the radix kernel
TOPK_CHUNK = 4096  # items per program of a top-k level (at least; 4 k when that is more)
TOPK_FINAL = 8192  # the longest list the finish selects from in one program
NUM_WARPS = 4
#: Compile options of the scores' launches: a register cap that still fits PROGRAMS_PER_SM programs of
#: NUM_WARPS warps in an SM's 64K registers (at most 255, the ISA's). Without a cap ptxas sized the
#: FP4 kernel for 3 programs on sm_100a (168 registers) and spilled; with it no variant spills.
SCORES_OPTIONS = {"maxnreg": min(255, 65536 // (PROGRAMS_PER_SM * NUM_WARPS * 32))}
_LAYOUTS = {"fp8": INDEXER_FP8, "fp4": INDEXER_FP4}


@triton.jit
def _e2m1_pairs_to_float(packed, BLOCK_E: tl.constexpr):
    """``[BLOCK_E, 64]`` bytes of e2m1 pairs (int32 0..255, even element in the low nibble) -> the
    ``[BLOCK_E, 128]`` float32 values, as ``fp8::e2m1_to_float``.

    A code's magnitude bits placed at float32's exponent and mantissa top are its value times
    ``2^-126`` (e2m1's subnormal 0.5 is float32's, rebiased), so one multiply by ``2^126`` (exact)
    gives it, and its sign bit moves to bit 31: two shifts and one masked merge a code, taken from
    the byte where it lies. ``mul.f32`` keeps subnormals (no ``.ftz``), as the interpreter does."""
    low = ((packed << 22) & 0x01C00000) | ((packed << 28) & -0x80000000)
    high = ((packed << 18) & 0x01C00000) | ((packed << 24) & -0x80000000)
    bits = tl.reshape(tl.join(low, high), (BLOCK_E, 128))
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _f16_scale(q):
    """Per head of ``q`` (float32 ``[H, 128]``), a power of two ``s`` putting the head's largest
    ``|q|`` in ``[2^14, 2^15)`` (float16's top binade), and ``1 / s``: a bf16 element (8 significant
    bits) times ``s`` is then exact in float16 down to ``2^-31`` of the head's largest. ``s`` stays
    in ``[2^-126, 2^126]`` (a zero, subnormal or non-finite head keeps a finite scale)."""
    top = (tl.max(tl.abs(q), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.minimum(tl.maximum(268 - top, 1), 253)
    return (exponent << 23).to(tl.float32, bitcast=True), ((254 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _f16_operand(x, NATIVE_BF16: tl.constexpr):
    """``x`` rounded to float16 (nearest even) as a tensor-core operand (float32 under the interpreter,
    whose dot on float16 operands is the same products summed in float32)."""
    if NATIVE_BF16:
        return x.to(tl.float16)
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _mma_f16(a, b, acc, NATIVE_BF16: tl.constexpr):
    """``acc + a @ b``, float32 accumulation, of :func:`_f16_operand` operands."""
    if NATIVE_BF16:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def indexer_scores_kernel(q_ptr, q_stride_b, q_stride_h, w_ptr, w_stride, cache_ptr, page_stride, num_pages, page_shift,
                          table_ptr, table_stride, max_pages, positions_ptr, out_ptr, out_stride, width, heads, batch,
                          FP4: tl.constexpr, SPLIT: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_E: tl.constexpr,
                          ENTRIES: tl.constexpr, NATIVE_BF16: tl.constexpr):
    """Persistent: program ``p`` takes chunks ``p, p + programs, ...`` of the ``batch x cdiv(width,
    ENTRIES)`` chunks, a chunk being ``ENTRIES`` consecutive entries of one row."""
    chunks = tl.cdiv(width, ENTRIES)
    h = tl.arange(0, BLOCK_HI)
    d = tl.arange(0, 128)
    h_ok = h < heads
    page_slots = 1 << page_shift
    for c in range(tl.program_id(0), batch * chunks, tl.num_programs(0)):
        b = (c // chunks).to(tl.int64)
        # Entry indices are int32 (width < 2^31, checked; a chunk starts at most at 2^31 - ENTRIES), so the
        # tile loop's index arithmetic and compares are 32-bit; cache and row offsets stay int64.
        first = (c % chunks) * ENTRIES
        t = tl.load(positions_ptr + b).to(tl.int64)
        n = tl.minimum(tl.maximum(t + 1, 0) // 4, width).to(tl.int32)
        q = tl.load(q_ptr + b * q_stride_b + h[:, None] * q_stride_h + d[None, :], mask=h_ok[:, None],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + b * w_stride + h, mask=h_ok, other=0.0)
        if FP4:  # bf16 operands: q split into high and low bf16 parts when float32
            q_hi = _round_bf16(q, NATIVE_BF16)
            q_lo = _round_bf16(q - q_hi, NATIVE_BF16)
            unscale = tl.full((BLOCK_HI,), 1.0, tl.float32)
        else:  # float16 operands: q scaled per head by a power of two (exact), split likewise when float32
            scale_q, unscale = _f16_scale(q)
            q = q * scale_q[:, None]
            q_hi = _f16_operand(q, NATIVE_BF16)
            q_lo = _f16_operand(q - q_hi.to(tl.float32), NATIVE_BF16)
        for e0 in range(first, first + (ENTRIES - BLOCK_E + 1), BLOCK_E):  # the bound below 2^31 too
            i = e0 + tl.arange(0, BLOCK_E)
            in_row = i < width
            page_index = i >> page_shift
            page = tl.load(table_ptr + b * table_stride + page_index,
                           mask=in_row & (i < n) & (page_index < max_pages), other=-1).to(tl.int64)
            valid = (page >= 0) & (page < num_pages)
            in_page = i & (page_slots - 1)
            base = tl.where(valid, page, 0) * page_stride
            # Logits transposed, [entries, heads]: the keys are the dot's M side, so the sum over heads
            # is along each thread's own accumulator columns (a few shuffles), not across warps.
            if FP4:  # 64 bytes of e2m1 pairs (even element in the low nibble), 4 UE8M0 scales per 32 dims
                packed = tl.load(cache_ptr + (base + in_page * 64)[:, None] + tl.arange(0, 64)[None, :],
                                 mask=valid[:, None], other=0).to(tl.int32)
                scale_ptr = (cache_ptr + page_slots * 64).to(tl.pointer_type(tl.int32))
                scale_word = tl.load(scale_ptr + base // 4 + in_page, mask=valid, other=0x7F7F7F7F)
                block_scale = (scale_word[:, None] >> (8 * (d // 32))[None, :]) & 0xFF
                keys = _e2m1_pairs_to_float(packed, BLOCK_E) * _ue8m0_to_float(block_scale)  # exact in bf16
                logits = _mma(keys, tl.trans(q_hi), tl.zeros((BLOCK_E, BLOCK_HI), tl.float32), NATIVE_BF16)
                if SPLIT:
                    logits = _mma(keys, tl.trans(q_lo), logits, NATIVE_BF16)
                key_scale = tl.full((BLOCK_E,), 1.0, tl.float32)
            else:  # 128 e4m3 codes (to float16 by the hardware convert, exact), one fp32 scale per entry
                codes = tl.load(cache_ptr + (base + in_page * 128)[:, None] + d[None, :], mask=valid[:, None],
                                other=0).to(tl.float8e4nv, bitcast=True)
                scale_ptr = (cache_ptr + page_slots * 128).to(tl.pointer_type(tl.float32))
                key_scale = tl.load(scale_ptr + base // 4 + in_page, mask=valid, other=0.0)
                keys = _f16_operand(codes, NATIVE_BF16)
                logits = _mma_f16(keys, tl.trans(q_hi), tl.zeros((BLOCK_E, BLOCK_HI), tl.float32), NATIVE_BF16)
                if SPLIT:
                    logits = _mma_f16(keys, tl.trans(q_lo), logits, NATIVE_BF16)
            logits = logits * unscale[None, :] * key_scale[:, None]
            score = tl.sum(w[None, :] * tl.maximum(logits, 0.0), 1)
            tl.store(out_ptr + b * out_stride + i, tl.where(valid, score, float("-inf")), mask=in_row)


@triton.jit
def _order_key(x):
    """Monotone uint32 key of a float32 (larger float, larger key), as ``order_key`` of the header."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u & 0x80000000) != 0, ~u, u | 0x80000000)


@triton.jit
def _load_list(scores_ptr, keys_ptr, index_ptr, row_offset, start, length, n, FIRST: tl.constexpr,
               BLOCK: tl.constexpr):
    """Items ``[start, start + BLOCK)`` of a row's list: (key, position, valid). ``FIRST``: the list is
    the score row itself (position = item, valid below ``n``); else a candidate list of a previous
    level (keys and positions stored, -1 positions are padding)."""
    item = start + tl.arange(0, BLOCK)
    if FIRST:
        valid = item < n
        key = _order_key(tl.load(scores_ptr + row_offset + item, mask=valid, other=0.0))
        position = item.to(tl.int32)
    else:
        in_list = item < length
        position = tl.load(index_ptr + row_offset + item, mask=in_list, other=-1)
        key = tl.load(keys_ptr + row_offset + item, mask=in_list, other=0).to(tl.uint32, bitcast=True)
        valid = position >= 0
    return key, position, valid


@triton.jit
def _select(key, valid, keep):
    """The ``keep`` best of a block held on chip: (chosen, place, count). A 32-step bisection on the
    key bits finds the ``keep``-th largest key with one block-wide count per bit (no memory traffic);
    every key above it is chosen, and of the keys equal to it the first ``keep - above`` in list order
    (ascending position). ``place`` is each chosen item's rank in list order."""
    threshold = tl.zeros((), tl.uint32)
    bit = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):
        trial = threshold | bit
        count = tl.sum((valid & (key >= trial)).to(tl.int32), 0)
        threshold = tl.where(count >= keep, trial, threshold)
        bit = bit >> 1
    above = valid & (key > threshold)
    equal = valid & (key == threshold)
    remaining = keep - tl.sum(above.to(tl.int32), 0)
    chosen = above | (equal & (tl.cumsum(equal.to(tl.int32), 0) <= remaining))
    chosen_i32 = chosen.to(tl.int32)
    return chosen, tl.cumsum(chosen_i32, 0) - 1, tl.sum(chosen_i32, 0)


@triton.jit
def _entry_slot(table_row, max_pages, page_shift, position, mask):
    """Cache slot of each position through a page-table row, -1 for a missing or negative page or a slot
    past int32 (``entry_slot`` of the header)."""
    page_index = position >> page_shift
    page = tl.load(table_row + page_index, mask=mask & (page_index < max_pages), other=-1).to(tl.int64)
    slot = (page << page_shift) | (position & ((1 << page_shift) - 1))
    return tl.where((page >= 0) & (slot <= 2147483647), slot, -1).to(tl.int32)


@triton.jit
def _pad_tail(tokens_row, slots_row, written, k, HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """-1 in places ``[written, k)`` of a row's tokens (and slots)."""
    for c in range(0, k, BLOCK):
        j = c + tl.arange(0, BLOCK)
        pad = (j < k) & (j >= written)
        tl.store(tokens_row + j, tl.full((BLOCK,), -1, tl.int32), mask=pad)
        if HAS_SLOTS:
            tl.store(slots_row + j, tl.full((BLOCK,), -1, tl.int32), mask=pad)


@triton.jit
def topk_chunk_kernel(scores_ptr, keys_ptr, index_ptr, src_stride, length, positions_ptr, width, keep, chunks,
                      out_keys_ptr, out_index_ptr, out_stride, FIRST: tl.constexpr, CHUNK: tl.constexpr):
    """One level: program ``b * chunks + c`` keeps the ``keep`` best of items ``[c * CHUNK, (c + 1) * CHUNK)``
    of row ``b``'s list, in list order, at ``[c * keep, (c + 1) * keep)`` of the next list (-1 positions
    after them). A flat grid: neither rows nor chunks meet the 65,535 limit of grid dims 1 and 2."""
    program = tl.program_id(0).to(tl.int64)
    b = program // chunks
    c = program % chunks
    t = tl.load(positions_ptr + b).to(tl.int64)
    n = tl.minimum(tl.maximum(t + 1, 0) // 4, width)
    key, position, valid = _load_list(scores_ptr, keys_ptr, index_ptr, b * src_stride, c * CHUNK, length, n, FIRST,
                                      CHUNK)
    chosen, place, count = _select(key, valid, keep)
    at = b * out_stride + c * keep + place
    tl.store(out_keys_ptr + at, key.to(tl.int32, bitcast=True), mask=chosen)
    tl.store(out_index_ptr + at, position, mask=chosen)
    j = tl.arange(0, CHUNK)
    pad = (j >= count) & (j < keep)
    tl.store(out_index_ptr + b * out_stride + c * keep + j, tl.full((CHUNK,), -1, tl.int32), mask=pad)


@triton.jit
def topk_finish_kernel(scores_ptr, keys_ptr, index_ptr, src_stride, length, positions_ptr, width, k, tokens_ptr,
                       tokens_stride, slots_ptr, slots_stride, table_ptr, table_stride, max_pages, page_shift,
                       FIRST: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``b``'s whole list (``length <= BLOCK`` items) on chip: its k best, ascending positions, then -1."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(positions_ptr + b).to(tl.int64)
    n = tl.minimum(tl.maximum(t + 1, 0) // 4, width)
    key, position, valid = _load_list(scores_ptr, keys_ptr, index_ptr, b * src_stride, 0, length, n, FIRST, BLOCK)
    chosen, place, count = _select(key, valid, k)
    tl.store(tokens_ptr + b * tokens_stride + place, position, mask=chosen)
    if HAS_SLOTS:
        slot = _entry_slot(table_ptr + b * table_stride, max_pages, page_shift, position, chosen)
        tl.store(slots_ptr + b * slots_stride + place, slot, mask=chosen)
    _pad_tail(tokens_ptr + b * tokens_stride, slots_ptr + b * slots_stride, count, k, HAS_SLOTS, BLOCK)


@triton.jit
def _radix_step(row, n, prefix, known, remaining, SHIFT: tl.constexpr, DIGITS: tl.constexpr, BLOCK: tl.constexpr):
    """One digit of the threshold: histogram the digit at ``SHIFT`` of the keys that share ``prefix``
    (on the bits in ``known``), take the highest digit whose bin, with those above, reaches ``remaining``."""
    hist = tl.zeros((DIGITS,), tl.int32)
    for c in range(0, n, BLOCK):
        i = c + tl.arange(0, BLOCK)
        key = _order_key(tl.load(row + i, mask=i < n, other=0.0))
        match = (i < n) & ((key & known) == prefix)
        hist += tl.histogram(((key >> SHIFT) & (DIGITS - 1)).to(tl.int32), DIGITS, mask=match)
    bins = tl.arange(0, DIGITS)
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= remaining, bins, 0), 0)
    remaining -= tl.sum(tl.where(bins == digit, at_or_above - hist, 0), 0)
    return prefix | (digit.to(tl.uint32) << SHIFT), known | (tl.full((), DIGITS - 1, tl.uint32) << SHIFT), remaining


@triton.jit
def topk_radix_kernel(scores_ptr, scores_stride, width, positions_ptr, k, tokens_ptr, tokens_stride, slots_ptr,
                        slots_stride, table_ptr, table_stride, max_pages, page_shift,
                        HAS_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``b``: the k largest of its visible scores, ascending positions, then -1, in five passes over the
    row (the path for a k too large to keep on chip: see :func:`indexer_topk`)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(positions_ptr + b).to(tl.int64)
    n = tl.minimum(tl.maximum(t + 1, 0) // 4, width)
    row = scores_ptr + b * scores_stride
    # 1. The threshold key, 11 + 11 + 10 bits; `remaining` = keys equal to it still to take.
    prefix = (n * 0).to(tl.uint32)
    known = prefix
    remaining = tl.minimum(k, n)
    prefix, known, remaining = _radix_step(row, n, prefix, known, remaining, 21, 2048, BLOCK)
    prefix, known, remaining = _radix_step(row, n, prefix, known, remaining, 10, 2048, BLOCK)
    prefix, known, remaining = _radix_step(row, n, prefix, known, remaining, 0, 1024, BLOCK)
    # 2. Ascending positions: every key above the threshold, and the first `remaining` equal to it.
    written = n * 0
    equal_seen = (n * 0).to(tl.int32)
    take_all = n <= k
    for c in range(0, n, BLOCK):
        i = c + tl.arange(0, BLOCK)
        in_row = i < n
        key = _order_key(tl.load(row + i, mask=in_row, other=0.0))
        equal = in_row & (key == prefix)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0)
        chosen = tl.where(take_all, in_row, in_row & ((key > prefix) | (equal & (equal_rank <= remaining))))
        at = written + tl.cumsum(chosen.to(tl.int64), 0) - 1
        chosen = chosen & (at < k)  # never past the row, whatever the scores hold
        tl.store(tokens_ptr + b * tokens_stride + at, i.to(tl.int32), mask=chosen)
        if HAS_SLOTS:
            slot = _entry_slot(table_ptr + b * table_stride, max_pages, page_shift, i.to(tl.int32), chosen)
            tl.store(slots_ptr + b * slots_stride + at, slot, mask=chosen)
        written += tl.sum(chosen.to(tl.int64), 0)
        equal_seen += tl.sum(equal.to(tl.int32), 0)
    # 3. -1 after them.
    _pad_tail(tokens_ptr + b * tokens_stride, slots_ptr + b * slots_stride, written, k, HAS_SLOTS, BLOCK)


def _check_positions(positions, batch, like):
    check(positions, "positions").dtype(torch.int32, torch.int64)
    check(positions, "positions").ndim(1).contiguous().same_device(like, "scores")
    check(positions, "positions").size(0, batch, "batch")


def _check_page_table(page_table, batch, like):
    check(page_table, "page_table").dtype(torch.int32).ndim(2).rows_dense().same_device(like, "scores")
    check(page_table, "page_table").size(0, batch, "batch")


def _check_pages_in_use(page_table, positions, width, page_slots, num_pages, pages_are):
    """The header entry's host-table check (``check_pages_in_use`` of ``dsv4_indexer.cuh``), same messages."""
    n_all = visible_entries(positions.to(torch.int64))  # the header's visible(): no wrap at t = 2**63 - 1
    pages_seen = -(-n_all // page_slots)
    for b in range(page_table.shape[0]):
        if int(pages_seen[b]) > page_table.shape[1]:
            raise ValueError(f"sparsekv: argument `page_table` has {page_table.shape[1]} pages per row, but row {b} "
                             f"sees {int(n_all[b])} entries ({int(pages_seen[b])} pages)")
        pages = page_table[b, :-(-min(int(n_all[b]), width) // page_slots)].to(torch.int64)
        bad = (pages < 0) | (pages >= num_pages)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise IndexError(f"sparsekv: argument `page_table`[{b}, {i}] = {int(pages[i])} is outside [0, {num_pages}) "
                             f"({pages_are}) but holds visible entries")


def check_scores_arguments(q, weights, k_cache, page_table, positions, page_slots, layout, scores):
    """The header entry ``indexer_scores``'s checks, in its order."""
    check_disjoint(read(q, "q"), read(weights, "weights"), read(k_cache, "k_cache"), read(page_table, "page_table"),
                   read(positions, "positions"), written(scores, "out"))
    check(scores, "scores").dtype(torch.float32).ndim(2).rows_dense()
    batch, width = scores.shape
    check(q, "q").dtype(torch.float32 if q.dtype == torch.float32 else torch.bfloat16).ndim(3).rows_dense()
    check(q, "q").same_device(scores, "scores").size(0, batch, "batch of scores").size(2, DIM, "index head dim")
    heads = q.shape[1]
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"sparsekv: argument `q` has {heads} heads; the indexer supports 1 to {MAX_HEADS}")
    check(weights, "weights").dtype(torch.float32).ndim(2).rows_dense().same_device(scores, "scores")
    check(weights, "weights").size(0, batch, "batch").size(1, heads, "heads of q")
    shift = page_shift(page_slots, "page_slots")
    check(k_cache, "k_cache").dtype(torch.uint8).ndim(2).rows_dense().same_device(scores, "scores").word_aligned(4)
    check(k_cache, "k_cache").size(1, _LAYOUTS[layout].page_bytes(page_slots),
                                   "page_bytes(page_slots) of the indexer layout")
    _check_page_table(page_table, batch, scores)
    _check_positions(positions, batch, scores)
    if width > 2**31 - 1:
        raise ValueError("sparsekv: argument `scores` is wider than 2^31 - 1 entries")
    if scores.device.type != "cuda":
        _check_pages_in_use(page_table, positions, width, page_slots, k_cache.shape[0], "the pages of `k_cache`")
    return shift


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """SMs of a CUDA device (memoised: the property query costs microseconds); 1 elsewhere (the
    interpreter runs programs one after another)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def indexer_scores(q, weights, k_cache, page_table, positions, page_slots, layout, out):
    """Check (:func:`check_scores_arguments`), then write the scores of every row into ``out``.

    The body of the ``sparsekv::indexer_scores`` op for ``impl="triton"``.
    """
    shift = check_scores_arguments(q, weights, k_cache, page_table, positions, page_slots, layout, out)
    batch, width = out.shape
    if batch == 0 or width == 0:
        return
    chunks = batch * triton.cdiv(width, ENTRIES)
    grid = (min(chunks, PROGRAMS_PER_SM * _multiprocessors(out.device)),)
    indexer_scores_kernel[grid](
        q, q.stride(0), q.stride(1), weights, weights.stride(0), k_cache, row_stride(k_cache), k_cache.shape[0],
        shift, page_table, page_table.stride(0), page_table.shape[1], positions, out, out.stride(0), width, q.shape[1],
        batch,
        FP4=layout == "fp4", SPLIT=q.dtype == torch.float32, BLOCK_HI=max(16, triton.next_power_of_2(q.shape[1])),
        BLOCK_E=BLOCK_E, ENTRIES=ENTRIES, NATIVE_BF16=not interpreting(), num_warps=NUM_WARPS, **SCORES_OPTIONS)


def check_topk_arguments(scores, positions, out, page_table, out_slots, page_slots, *, read_tables=True):
    """The header entry ``indexer_topk``'s checks, in its order; the page shift (0 without a table).

    ``read_tables=False`` leaves out the one check that reads values (the host tables' pages), which
    allocates: what a caller checking ahead on the decode path runs."""
    check_disjoint(read(scores, "scores"), read(positions, "positions"), written(out, "out"),
                   read(optional_arg(page_table, "page_table"), "page_table"),
                   written(optional_arg(out_slots, "out_slots"), "out_slots"))
    check(scores, "scores").dtype(torch.float32).ndim(2).rows_dense()
    batch, width = scores.shape
    if width > 2**31 - 1:
        raise ValueError("sparsekv: argument `scores` is wider than 2^31 - 1 entries")
    _check_positions(positions, batch, scores)
    check(out, "out").dtype(torch.int32).ndim(2).rows_dense().same_device(scores, "scores")
    check(out, "out").size(0, batch, "batch")
    if out.shape[1] < 1:
        raise ValueError(f"sparsekv: argument `num_top_k` must be at least 1, got {out.shape[1]}")
    if (page_table is None) != (out_slots is None):
        raise ValueError("sparsekv: arguments `page_table` and `out_slots` go together")
    if page_table is None:
        return 0
    shift = page_shift(page_slots, "page_slots")
    _check_page_table(page_table, batch, scores)
    check(out_slots, "out_slots").dtype(torch.int32).ndim(2).rows_dense().same_device(scores, "scores")
    check(out_slots, "out_slots").size(0, batch, "batch").size(1, out.shape[1], "num_top_k")
    if scores.device.type != "cuda" and read_tables:
        _check_pages_in_use(page_table, positions, width, page_slots, 1 << (31 - shift), "pages whose slots fit int32")
    return shift


def _warps(block: int) -> int:
    """Warps for a program holding ``block`` items on chip: 16 items a thread, 4 to 16 warps."""
    return max(4, min(16, block // 512))


def topk_plan(width: int, k: int, chunk: int = TOPK_CHUNK, final: int = TOPK_FINAL) -> list[tuple[int, int]] | None:
    """The levels of the on-chip top-k of ``width``-wide rows: ``(list length, chunk)`` of each level
    before the finish (which takes a list of at most ``final`` items in one program); ``None`` when
    ``k`` is too large to keep on chip (above ``chunk``), for rows the finish cannot take whole.

    A level's chunk holds at least ``4 k`` items, so each level shrinks the list at least fourfold.
    """
    if width <= final:
        return []
    level_chunk = triton.next_power_of_2(max(chunk, 4 * k))
    if level_chunk > 4 * chunk:
        return None
    levels, length = [], width
    while length > final:
        levels.append((length, level_chunk))
        length = triton.cdiv(length, level_chunk) * k
    return levels


def topk_workspace_ints(batch: int, width: int, k: int, chunk: int = TOPK_CHUNK, final: int = TOPK_FINAL) -> int:
    """int32 elements of the scratch lists of :func:`indexer_topk` for ``[batch, width]`` scores and top ``k``:
    each level of :func:`topk_plan` writes ``2 x batch x chunks x k`` (keys and positions); 0 when the
    rows are selected in one program (or by the radix kernel)."""
    levels = topk_plan(width, k, chunk, final) or []
    return sum(2 * batch * triton.cdiv(length, level_chunk) * k for length, level_chunk in levels)


def indexer_topk(scores, positions, out, page_table, out_slots, page_slots, workspace=None, *, chunk=TOPK_CHUNK,
                 final=TOPK_FINAL):
    """Check (:func:`check_topk_arguments`), then write each row's top ``out.shape[1]`` into ``out`` (and slots).

    The body of the ``sparsekv::indexer_topk`` op for ``impl="triton"``. Each level of
    :func:`topk_plan` reads its list once (the first, the scores) and writes each chunk's ``k`` best
    to a scratch list; the finish selects from the last list on chip. The scratch lists are cut from
    ``workspace`` (int32, 1-D, contiguous, at least :func:`topk_workspace_ints` elements, checked by
    the caller) when given, else allocated (the caching allocator's, a graph pool's under capture).
    ``chunk`` and ``final`` are the plan's sizes (tests shrink them to reach several levels at small widths).
    """
    shift = check_topk_arguments(scores, positions, out, page_table, out_slots, page_slots)
    batch, width = scores.shape
    k = out.shape[1]
    if batch == 0:
        return
    slots = (out_slots, out_slots.stride(0), page_table, page_table.stride(0), page_table.shape[1], shift) \
        if page_table is not None else (out, 0, out, 0, 0, 0)
    levels = topk_plan(width, k, chunk, final)
    if levels is None:
        topk_radix_kernel[(batch,)](scores, scores.stride(0), width, positions, k, out, out.stride(0), *slots,
                                    HAS_SLOTS=page_table is not None, BLOCK=TOPK_BLOCK, num_warps=NUM_WARPS)
        return
    if workspace is None:
        workspace = torch.empty(topk_workspace_ints(batch, width, k, chunk, final), dtype=torch.int32,
                                device=scores.device)
    keys, index, stride, length = scores, out, scores.stride(0), width  # the first list: the scores
    used = 0
    for level, (length, level_chunk) in enumerate(levels):
        chunks = triton.cdiv(length, level_chunk)
        scratch = workspace[used:used + 2 * batch * chunks * k].view(2, batch, chunks * k)
        used += scratch.numel()
        topk_chunk_kernel[(batch * chunks,)](scores, keys, index, stride, length, positions, width, k, chunks,
                                             scratch[0], scratch[1], chunks * k, FIRST=level == 0,
                                             CHUNK=level_chunk, num_warps=_warps(level_chunk))
        keys, index, stride, length = scratch[0], scratch[1], chunks * k, chunks * k
    block = max(16, triton.next_power_of_2(length))
    topk_finish_kernel[(batch,)](scores, keys, index, stride, length, positions, width, k, out, out.stride(0), *slots,
                                 FIRST=not levels, HAS_SLOTS=page_table is not None, BLOCK=block,
                                 num_warps=_warps(block))


def _aot_kernels():
    from sparsekv.jit_kernel.triton.aot import AotKernel, Constexpr, Int, Pointer

    kernels = []
    for layout in ("fp8", "fp4"):
        for q_type, split in (("bf16", False), ("fp32", True)):
            # The benchmark's serving shape: one row of 64 heads over 64k entries in 1024 pages of 64.
            kernels.append(AotKernel(
                f"dsv4_indexer.scores[{layout},{q_type}]", indexer_scores_kernel,
                {"q_ptr": Pointer(q_type), "q_stride_b": Int(64 * 128), "q_stride_h": Int(128),
                 "w_ptr": Pointer("fp32"), "w_stride": Int(64), "cache_ptr": Pointer("u8"),
                 "page_stride": Int(_LAYOUTS[layout].page_bytes(64)), "num_pages": Int(1024), "page_shift": Int(6),
                 "table_ptr": Pointer("i32"), "table_stride": Int(1024), "max_pages": Int(1024),
                 "positions_ptr": Pointer("i64", aligned=False), "out_ptr": Pointer("fp32"), "out_stride": Int(65536),
                 "width": Int(65536), "heads": Int(64), "batch": Int(1), "FP4": Constexpr(layout == "fp4"),
                 "SPLIT": Constexpr(split),
                 "BLOCK_HI": Constexpr(MAX_HEADS), "BLOCK_E": Constexpr(BLOCK_E), "ENTRIES": Constexpr(ENTRIES),
                 "NATIVE_BF16": Constexpr(True)},
                NUM_WARPS, SCORES_OPTIONS))

    def slots(k: int) -> dict:
        """The top-k's outputs for k columns: tokens and, through a 1024-page table of 64, slots."""
        return {"k": Int(k), "tokens_ptr": Pointer("i32"), "tokens_stride": Int(k), "slots_ptr": Pointer("i32"),
                "slots_stride": Int(k), "table_ptr": Pointer("i32"), "table_stride": Int(1024),
                "max_pages": Int(1024), "page_shift": Int(6), "HAS_SLOTS": Constexpr(True)}

    # Top-k of one 64k-score row (1024 pages of 64), k = 2048 for the radix kernel, k = 512 for the levels.
    kernels.append(AotKernel("dsv4_indexer.topk_radix", topk_radix_kernel,
                             {"scores_ptr": Pointer("fp32"), "scores_stride": Int(65536), "width": Int(65536),
                              "positions_ptr": Pointer("i64", aligned=False), **slots(2048),
                              "BLOCK": Constexpr(TOPK_BLOCK)},
                             NUM_WARPS))

    # The plan of a 64k-entry row, k = 512: one level of 4096-item chunks from the scores, the finish of 8192.
    def lists(length: int, scores_aligned: bool) -> dict:
        """A level's input: the scores (or the previous level's keys and indices), rows of ``length``."""
        return {"scores_ptr": Pointer("fp32", aligned=scores_aligned), "keys_ptr": Pointer("i32"),
                "index_ptr": Pointer("i32"), "src_stride": Int(length), "length": Int(length),
                "positions_ptr": Pointer("i64", aligned=False), "width": Int(65536)}

    chunks = 65536 // TOPK_CHUNK
    kernels.append(AotKernel("dsv4_indexer.topk_chunk", topk_chunk_kernel,
                             {**lists(65536, True), "keep": Int(512), "chunks": Int(chunks),
                              "out_keys_ptr": Pointer("i32"), "out_index_ptr": Pointer("i32"),
                              "out_stride": Int(chunks * 512), "FIRST": Constexpr(True),
                              "CHUNK": Constexpr(TOPK_CHUNK)},
                             _warps(TOPK_CHUNK)))
    kernels.append(AotKernel("dsv4_indexer.topk_finish", topk_finish_kernel,
                             {**lists(chunks * 512, False), **slots(512), "FIRST": Constexpr(False),
                              "BLOCK": Constexpr(TOPK_FINAL)},
                             _warps(TOPK_FINAL)))
    return kernels


#: The launch configurations :mod:`sparsekv.jit_kernel.triton.aot` compiles ahead of time.
AOT_KERNELS = _aot_kernels()

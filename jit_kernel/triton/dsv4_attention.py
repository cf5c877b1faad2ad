"""Triton twin of ``csrc/dsv4_attention.cuh``: sparse MQA decode attention with a sink, on tensor cores.

Same contract as :func:`sparsekv.jit_kernel.dsv4_attention.sparse_decode_attention` (which calls
:func:`sparse_decode_attention` here for ``impl="triton"``). FlashMLA's design:

* one program holds every head of a row (up to ``BLOCK_H = 64``, padded to 16 for ``tl.dot``;
  128 heads are two programs; 16 heads at small batch, below), so each selected KV row is gathered
  and dequantized once per 64 heads, not once per 8 as in the header's CUDA path;
* a tile of ``BLOCK_N = 32`` rows is gathered once per 64 heads: a row's 448 e4m3 bytes and 64 bf16
  rope values are contiguous masked loads (16-byte vectors, ``cp.async`` when pipelined), its 8 UE8M0
  scale bytes one 8-byte word; e4m3 goes to bf16 through the hardware convert and is multiplied in
  bf16 by its power-of-two scale (exact: the scale only moves the exponent);
* ``q . kv^T`` and ``p . kv`` run as ``tl.dot`` with float32 accumulation. The logits are computed as
  ``(kv . q^T)^T``: the dequantized rows are the A operand and ``q^T`` the B operand (``q`` sits in
  shared memory for the loop); with ``M = BLOCK_N = 32`` rows, below wgmma's 64, this is the warp
  MMA (``mma.sync`` m16n8k16, ``HMMA.16816``), whose fragments are registers loaded from shared
  memory each k-step (``ldmatrix``, by address: no descriptors; see :func:`_as_loaded_bf16`).
  ``p . kv`` is wgmma ``64x256x16`` per warp group on sm_90a, the ``64 x 512`` accumulator split over
  the two warp groups of 8 warps (128 registers each thread); tcgen05 on sm_100a;
* an online softmax in base 2 with the per-head sink folded into the final normalization;
* split-KV: ``[indices | extra_indices]`` is cut into ``num_splits`` ranges; each program stores its
  range's (lse, normalized output), and the last program of its (row, head group) to arrive (an
  acq_rel atomic on the group's ticket in the workspace, ``part_arrivals``, which it zeroes again)
  merges them exactly as the header's ``Combine``, 16 heads at a time, in the same launch: no second
  launch, and a CUDA graph replays it as is. On a GPU a row is split until the programs fill the 132
  SMs (:func:`default_splits`);
* at small batch, programs of 16 heads (:func:`launch_shape`): where 64-head programs of one 32-row
  tile each would leave more than half of the SMs idle (batch 1 to 3 at top-k 512 + a 128-entry
  window), a row's heads go to 4 programs of 16 heads, each over splits of 16-row tiles, on 4 warps
  (173 registers, 44 KB of shared memory: 2 programs per SM), as the header's CTAs of 16 heads. At
  batch 1, 64 heads, top-k 512 + 128: 40 splits x 4 = 160 programs, one tile each (was 20 of 64
  heads); top-k 512 alone: 128 (was 16). Each repeats its tile's gather and dequantization for its
  16 heads and runs both products on the warp MMA (M = 16 is below wgmma's 64): 648 loop
  instructions a warp per 16-row tile on sm_90a, against 832 for a 64-head 32-row tile on twice the
  warps, about 3x the issue per head and row, which costs nothing while the SMs would idle. At
  batch 4 and up (and at batch 1, top-k 2048 + 128: 68 programs of one 32-row tile) programs hold
  64 heads, so each selected row is gathered once per 64 heads; batch 64 is 2 splits x 64 rows =
  128 programs, as before.

Precision. ``q`` enters the tensor cores in bf16: the model's bf16 ``q`` as is, a float32 ``q``
rounded to nearest bf16 once, in the program's prologue (not per tile; FlashMLA takes only bf16
``q``). The weights ``p`` are rounded to bf16 once for ``p . kv``. Against the fp64 reference of the
bf16-rounded ``q``: ``|out - ref| <= 1e-2 max(1, max|ref|)``, ``lse`` within 1e-2 relative. With a
bf16 ``out`` and more than one split, each split's normalized output is rounded to bf16 once before
the combine (:func:`_partials`), within that bound. The KV
values are exact (bf16 holds e4m3 times a power of two, and the bf16 rope values), except that a
scale of 2^-127 (UE8M0 byte 0) makes bf16 subnormals, which the GPU may flush.

Compiled (triton 3.9, the AOT build at the benchmark's arguments, which specializes as the JIT does;
checked by ``tests/jit/test_sass.py`` with the wheel's ``cuobjdump``): no local memory on sm_90a or
sm_100a (64-head programs, bf16 ``q``: 253 / 224 registers; 16-head programs, float32 ``q``: 175 /
162; stack 0); the gathers are ``LDGSTS.E.BYPASS.128`` / ``LDG.E.128`` for the value bytes and
``LDGSTS.E.64`` for the scale words, no ``LDG.U8``; the convert is ``F2FP.F16.E4M3.UNPACK_B`` then
``F2F.BF16.F16`` (sm_100a: the direct ``F2FP.BF16.E4M3.UNPACK_B``); the products are
``HMMA.16816.F32.BF16`` (QK^T) and ``HGMMA.64x256x16.F32.BF16`` (PV; ``UTCHMMA`` on sm_100a;
``HMMA.16816`` for 16-head programs), the QK^T fragments loaded with ``LDSM.16.M88.4``.

Registers. The previous form, ``q . kv^T`` on wgmma with both operands in shared memory, spilled
(255 registers, a 504-byte stack on sm_90a): wgmma addresses shared memory through a 64-bit
descriptor per k-step and N block, and LLVM hoists every one of them out of the tile loop, 96 for
QK^T at ``K = 512`` (both warp groups computing the same 64x32 logits at N = 16), each then held in a
register across the loop; every ``LDL`` in the loop fed an ``R2UR`` of a descriptor. On the warp MMA the
fragments are loaded from shared memory by address (a base plus an immediate per k-step), so only
PV's two descriptors remain.

What bounds it. At batch 64, top-k 512 (+ a 128-entry window), 64 heads, the loop body is 852 SASS
instructions per warp per 32-row tile on sm_90a (776 on sm_100a; ``tools/bench/bench_sass_budget.py``
counts them): 64 ``HMMA`` and 64 ``LDSM`` (QK^T), 2 ``HGMMA`` (PV), 136 ``FMUL`` (128 of them the
accumulator's rescale), about 250 for the dequantization (``F2FP``, ``F2F``, ``HMUL2``, ``PRMT``,
``SEL``) and about 150 for the softmax (``SHFL``, ``FADD``, ``FMNMX``, ``MUFU``). With the GPU's
default of 2 splits there (128 programs of 64 heads, one per SM, 10 tiles each, 8 warps, 4
instructions issued per SM cycle at 1.98 GHz): ``10 x 852 x 8 / 4 / 1.98e9 = 8.6 us`` of issue against
the H200 roofline of those 640 entries, 6.8 us (5.7 us for the top-k 512 alone): 1.27x (B200: 7.9 us
against 4.1 us, 1.94x). End to end the split costs bytes after the loop, which one wave of programs
cannot hide: the partials written as every program ends and read back by the last of its row, which
writes the output. bf16 partials for a bf16 output (:func:`_partials`) make that 16.8 MB through L2
(2.0 us at an assumed 8.4 TB/s) and 4.2 MB of output to HBM (0.9 us): 11.5 us end to end, 1.70x the
roofline (``bench_sass_budget``'s ``end_to_end_us``; B200 10.2 us, 2.52x); top-k 512 alone 9.8 us,
1.70x its 5.77 us. With the combine as a second launch (its partials counted at HBM, 21.1 MB) it was
12.8 us (1.89x) with the window and 11.1 us (1.93x) without, from a loop of 832 instructions: the
last program's combine, after the loop, costs the loop 20 instructions on sm_90a (17 on sm_100a) of
register allocation, and its 16 heads at a time keep it without spills. The loop was 1,407
instructions before ``kWidth = 2`` fragments (:func:`_as_loaded_bf16`: about 350 register moves and
100 ``LDS`` fewer) and the tile-major gather (about 150 fewer). At prefill (each of 4k query tokens a
row, 128 heads, top-k 2048: 8,192 programs of 64 tiles) the same loop is ``8192 x 64 x 852 x 8 / (132
x 4 x 1.98e9) = 3.4 ms`` of issue against a math-bound roofline of 2.2 ms (2.2 TFLOP at 989 TFLOPS):
1.54x. At batch 1 the kernel is latency-bound: 160 programs of one 16-row tile, ``654 x 160 x 4 /
(132 x 4 x 1.98e9) = 0.4 us`` of issue, then the 40 splits' float32 partials (10.5 MB through L2;
5.3 MB as bf16 for a bf16 output): 1.7 us end to end, under what a launch costs (a realistic floor
of 5-8 us on an H200). A GPU session times it against FlashMLA (``bench_dsv4_attention --peer``).

Versions: every configuration compiles for sm_90a and sm_100a on triton 3.9 with tensor-core
instructions; the AOT test checks each kernel's PTX for wgmma / tcgen05 (``mma.sync`` for the
16-head programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparsekv.jit_kernel.triton import interpreting
from sparsekv.kv_layout import V4

__all__ = ["AOT_KERNELS", "sparse_decode_attention"]

HEAD_DIM = 512
NOPE = 448
VALUE_BYTES = 576
SCALE_BYTES = 8
MAX_BLOCK_H = 64
#: Rows per tile and warps of a program of up to 64 heads; the interpreter runs the same tiles.
BLOCK_N = 32
NUM_WARPS = 8
#: A program of 16 heads (:func:`launch_shape`, at small batch): rows per tile, warps, and how many
#: such programs one SM holds (173 registers x 128 threads on sm_90a, 156 on sm_100a; 44 KB of shared memory).
SMALL_BLOCK_H = 16
SMALL_BLOCK_N = 16
SMALL_NUM_WARPS = 4
SMALL_PER_SM = 2
#: SMs of an H100 / H200: one 64-head program per SM (253 registers x 256 threads fill its register file).
_GPU_SMS = 132
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _ue8m0_to_float(byte):
    """UE8M0 scale byte (int32) -> 2^(byte - 127) (2^-127 is a float32 subnormal)."""
    return tl.where(byte == 0, 0x00400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_to_bf16(byte):
    """UE8M0 scale byte (int32) -> 2^(byte - 127) as bf16: the byte is bf16's exponent field (2^-127 is
    the subnormal 0x0040)."""
    return tl.where(byte == 0, 0x0040, byte << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _gather_rows(cache_ptr, page_stride, page_shift, num_slots, slots, valid_in, BLOCK_N: tl.constexpr,
                 NATIVE_BF16: tl.constexpr):
    """The dequantized ``[BLOCK_N, 512]`` rows of ``slots`` (zero rows where not valid) and their validity.

    Each row is read once: its 448 e4m3 bytes and its 64 bf16 rope values as contiguous masked loads
    (16-byte vectors), its 8 scale bytes as one 8-byte word. Compiled, the e4m3 bytes go to bf16
    through the hardware convert and are multiplied in bf16 by their power-of-two scale (exact); under
    the interpreter (no bf16 arithmetic) the same values are made in float32."""
    valid = valid_in & (slots >= 0) & (slots < num_slots)
    slot = tl.where(valid, slots, 0).to(tl.int64)
    page = slot >> page_shift
    in_page = slot & ((1 << page_shift) - 1)
    page_base = page * page_stride
    value_off = page_base + in_page * 576
    scale_off = page_base + (1 << page_shift) * 576 + in_page * 8
    # A row as 8 tiles of 64 dims: tiles 0-6 are e4m3 times their scale, tile 7 the bf16 rope values (its
    # e4m3 reading of the rope bytes is converted and dropped). The tile is the leading axis so that it is
    # mostly a register index, whose select between the two folds away when compiled (with the tile
    # spread over the threads, the per-element select cost about 150 instructions a tile).
    tile = tl.arange(0, 8)
    col = tl.arange(0, 64)
    e4m3_bits = tl.load(cache_ptr + value_off[None, :, None] + (tile * 64)[:, None, None] + col[None, None, :],
                        mask=valid[None, :, None], other=0)
    e4m3 = e4m3_bits.to(tl.float8e4nv, bitcast=True)
    rope_ptr = (cache_ptr + 448).to(tl.pointer_type(tl.uint16))
    rope_bits = tl.load(rope_ptr + (value_off // 2)[:, None] + col[None, :], mask=valid[:, None], other=0)
    scale_word = tl.load((cache_ptr + scale_off).to(tl.pointer_type(tl.int64)), mask=valid, other=0)
    scale_byte = ((scale_word[None, :] >> (tile * 8).to(tl.int64)[:, None]) & 0xFF).to(tl.int32)
    if NATIVE_BF16:
        nope, scale, rope = e4m3.to(tl.bfloat16), _ue8m0_to_bf16(scale_byte), rope_bits.to(tl.bfloat16, bitcast=True)
    else:
        # The interpreter (triton 3.9) reads e4m3's NaN, S.1111.111, as +-480; the hardware convert gives NaN.
        nope = tl.where((e4m3_bits & 0x7F) == 0x7F, float("nan"), e4m3.to(tl.float32))
        scale = _ue8m0_to_float(scale_byte)
        rope = (rope_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    rows = tl.permute(tl.where((tile < 7)[:, None, None], nope * scale[:, :, None], rope[None, :, :]), (1, 0, 2))
    rows = tl.reshape(rows, (BLOCK_N, 512))
    return _as_loaded_bf16(rows) if NATIVE_BF16 else rows, valid


@triton.jit
def _as_loaded_bf16(rows):
    """``rows`` (bf16) unchanged, through an identity ``mov`` the compiler does not look behind.

    Triton sizes a warp-MMA operand's register fragments by the narrowest load behind the operand: behind
    the dequantized rows it finds the e4m3 bytes and gives each thread 4 consecutive k values
    (``kWidth = 4``), which for a bf16 operand means ``LDS.64`` fragment loads and about 350 register
    moves per tile assembling each ``HMMA``'s operands. Behind the ``mov`` it sees bf16 (``kWidth = 2``)
    and loads the fragments of the rows and of ``q^T`` with ``ldmatrix`` (``LDSM.16.M88.4``), in the
    registers the ``HMMA`` takes. Not pure, or the compiler would look through it."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [rows], dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def _mma(a, b, acc, NATIVE_BF16: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation: bf16 operands on the tensor cores when ``NATIVE_BF16``
    (compiled; the indexer passes float32 operands holding bf16 values); float32 operands under the
    interpreter, whose bf16 ``tl.dot`` multiplies the bit patterns (triton 3.9): the same products,
    the same result up to summation order."""
    if NATIVE_BF16:  # operands already bf16 are kept; float32 ones holding bf16 values are narrowed exactly
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _round_bf16(x, NATIVE_BF16: tl.constexpr):
    """``x`` rounded to the nearest bf16 (ties to even), kept as float32. The interpreter's float32 -> bf16
    cast truncates, so there the rounding is done on the bits (finite ``x``)."""
    if NATIVE_BF16:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_operand(x, NATIVE_BF16: tl.constexpr):
    """``x`` rounded to bf16 (nearest even) as a tensor-core operand: bf16 compiled, float32 interpreted."""
    if NATIVE_BF16:
        return x.to(tl.bfloat16)
    else:
        return _round_bf16(x, NATIVE_BF16)


@triton.jit
def _max_with_nan(a, b):
    """``max(a, b)``, NaN when either is: the combine of the logits' row maximum (``max.NaN.f32``)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_max_with_nan(s, NATIVE_BF16: tl.constexpr):
    """The maximum of each row of ``s``, NaN for a row holding a NaN. Compiled: one reduce whose combine
    keeps NaN. Interpreted: the interpreter runs a reduce with a combine of ours element by element in
    Python (about 40% of the Triton demo's time), and its own ``tl.max`` and ``tl.sum`` are numpy's
    (``tl.max`` is ``nanmax``, which skips NaN), so the rows holding a NaN are found apart."""
    if NATIVE_BF16:
        return tl.reduce(s, 1, _max_with_nan)
    else:
        has_nan = tl.sum((s != s).to(tl.int32), 1) > 0
        return tl.where(has_nan, float("nan"), tl.max(tl.where(s != s, float("-inf"), s), 1))


@triton.jit
def _store_out(ptr, x, mask, NATIVE_BF16: tl.constexpr):
    """Store float32 ``x`` into a float32 or bfloat16 output (round to nearest even)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr, _round_bf16(x, NATIVE_BF16).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _partials(part_out_ptr, out_ptr):
    """Where the splits' normalized outputs go: bf16 (rounded to nearest once) for a bf16 ``out``, in the
    first half of the float32 workspace, which halves the bytes written after the loop and read back by
    the combine; float32 for a float32 ``out``."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        return part_out_ptr.to(tl.pointer_type(tl.bfloat16))
    else:
        return part_out_ptr


@triton.jit
def _attend(m, denom, acc, q, cache_ptr, page_stride, page_shift, num_slots, idx_row_ptr, lo, hi, scale_log2,
            BLOCK_N: tl.constexpr, NATIVE_BF16: tl.constexpr):
    """Online-softmax update of ``(m, denom, acc)`` (base 2) over entries ``[lo, hi)`` of one source."""
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        in_range = j < hi
        slots = tl.load(idx_row_ptr + j, mask=in_range, other=-1)
        kv, valid = _gather_rows(cache_ptr, page_stride, page_shift, num_slots, slots, in_range, BLOCK_N,
                                 NATIVE_BF16)
        # Logits as (kv q^T)^T: 32 rows on M make it the warp MMA, whose fragments need no wgmma
        # descriptor held across the loop (see "Registers" above).
        s = tl.trans(_mma(kv, tl.trans(q), tl.zeros((BLOCK_N, q.shape[0]), tl.float32), NATIVE_BF16))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        # A NaN logit makes the head's output and lse NaN, as in the header. The GPU's plain max drops NaN
        # (max.f32), so the maximum propagates it (max.NaN.f32): once m is NaN, every later p, alpha and
        # sum is NaN.
        m_new = tl.maximum(m, _row_max_with_nan(s, NATIVE_BF16), propagate_nan=tl.PropagateNan.ALL)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        acc = _mma(_bf16_operand(p, NATIVE_BF16), kv, acc * alpha[:, None], NATIVE_BF16)
        m = m_new
    return m, denom, acc


@triton.jit
def attention_partial_kernel(
        q_ptr, q_stride_b, q_stride_h,
        cache_ptr, page_stride, page_shift, num_slots, idx_ptr, idx_stride, count,
        x_cache_ptr, x_page_stride, x_page_shift, x_num_slots, x_idx_ptr, x_idx_stride, x_count,
        sink_ptr, scale_log2, heads, num_splits, split_len, lengths_ptr,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, arrivals_ptr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_EXTRA: tl.constexpr,
        HAS_LENGTHS: tl.constexpr,
        NATIVE_BF16: tl.constexpr):
    """One (row b, split s, group of BLOCK_H heads): the online softmax over the split's entries."""
    pid = tl.program_id(0)
    b = pid // num_splits
    s = pid - b * num_splits
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < heads
    # bf16 q as is; a float32 q rounded to bf16 once, here, not per tile. Its rows are addressed from the
    # program's first head, not from h: otherwise the compiler keeps h of the q load's layout alive
    # through the loops for the epilogue, and spills it.
    q = tl.load(q_ptr + b.to(tl.int64) * q_stride_b + (tl.program_id(1) * BLOCK_H * q_stride_h).to(tl.int64)
                + (tl.arange(0, BLOCK_H) * q_stride_h)[:, None] + tl.arange(0, 512)[None, :], mask=h_ok[:, None],
                other=0.0)
    q = _bf16_operand(q.to(tl.float32), NATIVE_BF16) if q.dtype == tl.float32 or not NATIVE_BF16 else q
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    first = s * split_len
    last = tl.minimum(first + split_len, count + x_count)
    main_end = tl.minimum(last, count)
    if HAS_LENGTHS:  # only the first topk_length[b] entries of indices[b] (clamped to [0, K])
        main_end = tl.minimum(main_end, tl.maximum(tl.load(lengths_ptr + b), 0))
    m, denom, acc = _attend(m, denom, acc, q, cache_ptr, page_stride, page_shift, num_slots,
                            idx_ptr + b.to(tl.int64) * idx_stride, first, main_end, scale_log2, BLOCK_N, NATIVE_BF16)
    if HAS_EXTRA:
        m, denom, acc = _attend(m, denom, acc, q, x_cache_ptr, x_page_stride, x_page_shift, x_num_slots,
                                x_idx_ptr + b.to(tl.int64) * x_idx_stride - count, tl.maximum(first, count), last,
                                scale_log2, BLOCK_N, NATIVE_BF16)
    has = (denom > 0.0) | (denom != denom)  # a NaN head is not an empty one: out = lse = NaN
    log2_l = tl.log2(tl.where(has, denom, 1.0))
    if num_splits == 1:
        sink2 = tl.load(sink_ptr + h, mask=h_ok, other=0.0) * 1.4426950408889634
        factor = tl.where(has, 1.0 / tl.where(has, denom + tl.exp2(sink2 - tl.where(has, m, 0.0)), 1.0), 0.0)
        row = b.to(tl.int64) * heads + h
        _store_out(out_ptr + row[:, None] * 512 + tl.arange(0, 512)[None, :], acc * factor[:, None], h_ok[:, None],
                   NATIVE_BF16)
        tl.store(lse_ptr + row, tl.where(has, (m + log2_l) * 0.6931471805599453, float("inf")), mask=h_ok)
    else:
        factor = tl.where(has, 1.0 / tl.where(has, denom, 1.0), 0.0)
        row = (b.to(tl.int64) * num_splits + s) * heads + h
        _store_out(_partials(part_out_ptr, out_ptr) + row[:, None] * 512 + tl.arange(0, 512)[None, :],
                   acc * factor[:, None], h_ok[:, None], NATIVE_BF16)
        tl.store(part_lse_ptr + row, tl.where(has, (m + log2_l) * 0.6931471805599453, float("-inf")), mask=h_ok)
        # The last program of the (row, head group) to arrive combines every split. Its arrival is one
        # acq_rel atomic after a barrier: every thread's partial stores happen before it, and the last
        # program's reads of the others' partials after theirs. It zeroes the counter for the next call.
        tl.debug_barrier()
        # The group's ticket: the first of its 2 ints in the header's [B, ceil(H / 16), 2] counters.
        counter = arrivals_ptr + 2 * (b.to(tl.int64) * ((heads + 15) // 16) + tl.program_id(1) * (BLOCK_H // 16))
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)
            for h0 in tl.static_range(0, BLOCK_H, 16):  # 16 heads at a time: a 64 x 512 float32 sum would spill
                _combine(part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, b,
                         tl.program_id(1) * BLOCK_H + h0 + tl.arange(0, 16), heads, num_splits, NATIVE_BF16)


@triton.jit
def _combine(part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, b, h, heads, num_splits,
             NATIVE_BF16: tl.constexpr):
    """Merge the splits' (lse_s, o_s) of row ``b``, heads ``h``, with the sink, as the header's ``Combine``:
    ``M = max_s lse_s``, ``out = sum_s exp(lse_s - M) o_s / (sum_s exp(lse_s - M) + exp(sink - M))``,
    ``lse = M + log sum_s exp(lse_s - M)``, one split at a time in split order (a NaN ``lse_s`` makes
    the head's out and lse NaN). The partials are read from L2 (``.cg``), past the SM's L1."""
    h_ok = h < heads
    base = b.to(tl.int64) * num_splits * heads + h
    big = tl.full(h.shape, float("-inf"), tl.float32)
    for s in range(0, num_splits):
        lse_s = tl.load(part_lse_ptr + base + s * heads, mask=h_ok, other=float("-inf"), cache_modifier=".cg")
        big = tl.maximum(big, lse_s, propagate_nan=tl.PropagateNan.ALL)
    has = big != float("-inf")
    big_safe = tl.where(has, big, 0.0)
    d = tl.arange(0, 512)
    total = tl.zeros(h.shape, tl.float32)
    weighted = tl.zeros((h.shape[0], 512), tl.float32)
    for s in range(0, num_splits):
        lse_s = tl.load(part_lse_ptr + base + s * heads, mask=h_ok, other=float("-inf"), cache_modifier=".cg")
        w = tl.where(lse_s != float("-inf"), tl.exp(lse_s - big_safe), 0.0)
        o = tl.load(_partials(part_out_ptr, out_ptr) + (base + s * heads)[:, None] * 512 + d[None, :],
                    mask=(h_ok & (w > 0.0))[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
        total += w
        weighted += w[:, None] * o
    denominator = total + tl.exp(tl.load(sink_ptr + h, mask=h_ok, other=0.0) - big_safe)
    out = tl.where(has[:, None], weighted / tl.where(has, denominator, 1.0)[:, None], 0.0)
    row = b.to(tl.int64) * heads + h
    _store_out(out_ptr + row[:, None] * 512 + d[None, :], out, h_ok[:, None], NATIVE_BF16)
    tl.store(lse_ptr + row, tl.where(has, big_safe + tl.log(tl.where(has, total, 1.0)), float("inf")), mask=h_ok)


def default_splits(device: torch.device, batch: int, heads: int, entries: int) -> int:
    """Split-KV ranges per row: 1 on CPU (the interpreter).

    On a GPU, where programs of 64 heads and one 32-row tile each would fill at least half of the 132
    SMs: 1 whenever the rows alone give half a wave (each split costs a ``[B, H, 512]`` partial
    written and read back, more bytes than the KV rows at batch 64), else enough splits for one
    program per SM. Below that (batch 1 to 3 at top-k 512 + a 128-entry window), the most splits of
    whole 16-row tiles whose 16-head programs fit one wave (:func:`launch_shape`): at batch 1, 64
    heads, 640 entries, 40 splits x 4 head groups = 160 programs (2 per SM); 128 at top-k 512."""
    if device.type != "cuda":
        return 1
    wide = max(1, batch * -(-heads // MAX_BLOCK_H))
    if 2 * wide * (entries // BLOCK_N) >= _GPU_SMS:
        return 1 if 2 * wide >= _GPU_SMS else min(_GPU_SMS // wide, entries // BLOCK_N)
    small = max(1, batch * -(-heads // SMALL_BLOCK_H))
    most = max(1, min((_GPU_SMS - 1) // (2 * wide), SMALL_PER_SM * _GPU_SMS // small))
    tiles = max(1, -(-entries // SMALL_BLOCK_N))
    return -(-tiles // -(-tiles // most))  # the fewest splits of whole tiles, at most `most`


def launch_shape(batch: int, heads: int, num_splits: int) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_N, num_warps)`` of the partial kernel's programs for ``num_splits`` splits per row.

    16 heads and 16-row tiles on 4 warps when programs of 64 heads would leave more than half of the
    132 SMs idle and the 16-head programs all fit in one wave (2 per SM): batch 1 at top-k 512 (+ a
    window) gets 128 (160) programs instead of 32 (40). Each such program repeats the gather and
    dequantization of its rows (a quarter of the products per tile: 649 loop instructions a warp on
    sm_90a against 832 for a 64-head 32-row tile on twice the warps), which is cheap only while the
    SMs would idle otherwise. Else a program holds up to 64 heads (padded to 16 for ``tl.dot``) and
    32-row tiles on 8 warps, so each selected row is gathered once per 64 heads."""
    if 2 * batch * -(-heads // MAX_BLOCK_H) * num_splits < _GPU_SMS \
            and batch * -(-heads // SMALL_BLOCK_H) * num_splits <= SMALL_PER_SM * _GPU_SMS:
        return SMALL_BLOCK_H, SMALL_BLOCK_N, SMALL_NUM_WARPS
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(heads))), BLOCK_N, NUM_WARPS


def sparse_decode_attention(q, main, extra, split_len, sink, softmax_scale, num_splits, out, lse, part_out, part_lse,
                            part_arrivals, topk_length=None):
    """Launch on arguments the op has checked: ``main`` / ``extra`` are each cache's kernel arguments and
    ``split_len`` the entries per split (what :func:`sparsekv.jit_kernel.dsv4_attention.check_attention_arguments`
    returns, ``extra`` None without an extra cache); ``out`` (float32 or bfloat16) and ``lse`` are written,
    ``part_out`` / ``part_lse`` are the split partials and ``part_arrivals`` the int32 ``[B, ceil(H / 16), 2]``
    arrival counters (the twin uses the first of each pair), zero before the call and after it (None for
    one split); ``topk_length`` (int32
    ``[B]`` or None) bounds the entries of ``indices`` taken per row. The programs' shape is
    :func:`launch_shape`'s; split, the last program of each (row, head group) combines (one launch).

    The body of the ``sparsekv::sparse_decode_attention`` op for ``impl="triton"``; see the public
    :func:`sparsekv.jit_kernel.dsv4_attention.sparse_decode_attention` for the contract.
    """
    batch, heads = q.shape[0], q.shape[1]
    if batch == 0 or heads == 0:
        return
    block_h, block_n, num_warps = launch_shape(batch, heads, num_splits)
    x = extra if extra is not None else main[:6] + (0,)
    grid = (batch * num_splits, triton.cdiv(heads, block_h))
    attention_partial_kernel[grid](
        q, q.stride(0), q.stride(1), *main, *x, sink, float(softmax_scale) * LOG2E, heads, num_splits, split_len,
        topk_length if topk_length is not None else lse, out, lse,
        *(part if part is not None else lse for part in (part_out, part_lse, part_arrivals)),
        BLOCK_H=block_h, BLOCK_N=block_n, HAS_EXTRA=extra is not None,
        HAS_LENGTHS=topk_length is not None, NATIVE_BF16=not interpreting(), num_warps=num_warps)


def _aot_kernels():
    from sparsekv.jit_kernel.triton.aot import AotKernel, Constexpr, Float, Int, Pointer

    def source(prefix: str, num_slots: int, count: int) -> dict:
        """A paged V4 cache of 64-slot pages and its index table of ``count`` entries per row."""
        return {f"{prefix}cache_ptr": Pointer("u8"), f"{prefix}page_stride": Int(V4.page_bytes(64)),
                f"{prefix}page_shift": Int(6), f"{prefix}num_slots": Int(num_slots), f"{prefix}idx_ptr": Pointer("i32"),
                f"{prefix}idx_stride": Int(count), f"{prefix}count": Int(count)}

    kernels = []
    # The model's bf16 q and bf16 output, and the float32 q (rounded to bf16 once) with float32 output. The
    # integer arguments at the benchmark's serving shapes: 64 heads, top-k 512 over 64-slot C4 pages
    # plus a 128-entry window (the extra cache), batch 64 for bf16 q (2 splits, 64-head programs) and
    # batch 1 for float32 q (40 splits, 16-head programs: launch_shape), with the GPU's default splits.
    for q_type, batch in (("bf16", 64), ("fp32", 1)):
        splits = default_splits(torch.device("cuda"), batch, 64, 512 + 128)
        block_h, block_n, num_warps = launch_shape(batch, 64, splits)
        partials = {"part_out_ptr": Pointer("fp32"), "part_lse_ptr": Pointer("fp32"), "arrivals_ptr": Pointer("i32"),
                    "sink_ptr": Pointer("fp32"), "out_ptr": Pointer(q_type), "lse_ptr": Pointer("fp32"),
                    "heads": Int(64), "num_splits": Int(splits), "NATIVE_BF16": Constexpr(True)}
        config = q_type if block_h == MAX_BLOCK_H else f"{q_type},{block_h} heads"
        kernels.append(AotKernel(f"dsv4_attention.partial[{config}]", attention_partial_kernel,
                                 {"q_ptr": Pointer(q_type), "q_stride_b": Int(64 * 512), "q_stride_h": Int(512),
                                  **source("", batch * 512, 512), **source("x_", batch * 128, 128),
                                  "scale_log2": Float(), "split_len": Int(-(-(512 + 128) // splits)),
                                  "lengths_ptr": Pointer("i32"), **partials, "BLOCK_H": Constexpr(block_h),
                                  "BLOCK_N": Constexpr(block_n), "HAS_EXTRA": Constexpr(True),
                                  "HAS_LENGTHS": Constexpr(True)},
                                 num_warps))
    return kernels


#: The launch configurations :mod:`sparsekv.jit_kernel.triton.aot` compiles ahead of time.
AOT_KERNELS = _aot_kernels()

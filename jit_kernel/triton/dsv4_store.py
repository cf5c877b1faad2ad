"""Triton twin of ``csrc/dsv4_store.cuh``'s ``norm_rope_store``: RMSNorm, RoPE, (Walsh-Hadamard,)
quantize and paged store of DSV4 entries, bit-exact with the header, with packed stores; and its
reusable ``@triton.jit`` pieces.

Same contract as :func:`sparsekv.jit_kernel.dsv4_store.norm_rope_store` (which calls
:func:`norm_rope_store` here for ``impl="triton"``), and the same bytes for every cache kind: each
float32 step is one IEEE operation rounded as the header writes it, in the header's order:

* the sum of squares in the team order of ``csrc/include/sparsekv/lane_reduce.h`` (:func:`team_sum`:
  virtual lane ``l`` folds channels ``l, l + 32, ...`` in order, then a butterfly of offsets 16 .. 1);
* ``1 / sqrt(ms + eps)`` as ``tl.div_rn(1, tl.sqrt_rn(.))`` (correctly rounded, not an rsqrt);
* the FP8 indexer scale and codes as ``tl.div_rn`` (true divisions);
* no FMA contraction: the launches and the AOT compile pass ``enable_fp_fusion=False``, so
  ``a * b - c * d`` is two rounded products and a rounded difference, as on the cpu backend.

One program per entry: the row is loaded in the shapes each step needs (``[D / 32, 32]`` for the
norm's order, the 64 RoPE dims as pairs, the rest as ``[8, 64]`` blocks or a 64-wide half), every
element going through the same rounded operations, so no step has to pick elements out of another's
layout. The record leaves as 64-bit words, an indexer scale as one 32-bit word
(:func:`~sparsekv.jit_kernel.triton.dsv4_quant.store_words`).

Reusable pieces (the fused compress -> norm -> RoPE -> quantize -> store kernels build on them):
:func:`entry_target`, :func:`round_bf16`, :func:`team_sum`, :func:`apply_rope`, :func:`hadamard_128`,
:func:`float_to_e2m1`, :func:`store_indexer_fp8_token` and :func:`store_indexer_fp4_token`, beside
:func:`~sparsekv.jit_kernel.triton.dsv4_quant.store_v4_token`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from sparsekv.jit_kernel.triton.checks import check, check_disjoint, read, row_stride, written
from sparsekv.jit_kernel.triton.dsv4_quant import (
    ceil_scale_exponent,
    check_paged_cache,
    encode_e4m3,
    exp2_int,
    float_to_bf16,
    hardware_fp8,
    pack_words,
    store_v4_token,
    store_words,
    word_aligned,
)
from sparsekv.kv_layout import INDEXER_FP4, INDEXER_FP8, V4

__all__ = ["AOT_KERNELS", "check_store_arguments", "norm_rope_store"]

#: Cache kind -> (the kernel's KIND, the row width, the layout).
KINDS = {"V4": (0, 512, V4), "INDEXER_FP8": (1, 128, INDEXER_FP8), "INDEXER_FP4": (2, 128, INDEXER_FP4)}
ROPE_PAIRS = 32
NUM_WARPS = 2
#: Compile options of every launch: each product and sum rounded on its own (no FMA contraction).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def round_bf16(x):
    """``x`` rounded to the nearest bf16 (ties to even, NaN quiet), as float32 (``round_bf16`` of the header)."""
    return (float_to_bf16(x) << 16).to(tl.float32, bitcast=True)


@triton.jit
def team_sum(values, K: tl.constexpr):
    """The sum of ``values`` (float32 ``[K, 32]``, channel ``32 k + l`` at ``[k, l]``), non-negative, in
    the order of ``team::sum`` over a row's per-lane folds: lane ``l`` adds ``values[0, l]``,
    ``values[1, l]``, ... to 0 in order, then the 32 partials meet in a butterfly of offsets 16, 8, 4,
    2, 1. Each row is picked out by a sum with zeros (exact), and each butterfly level is a sum over
    an axis of two (one rounded addition), so the order is the header's on every device."""
    rows = tl.arange(0, K)[:, None]
    partial = tl.zeros((32,), tl.float32)
    for k in tl.static_range(K):
        partial = partial + tl.sum(tl.where(rows == k, values, 0.0), 0)
    partial = tl.sum(tl.reshape(partial, (2, 16)), 0)
    partial = tl.sum(tl.reshape(partial, (2, 8)), 0)
    partial = tl.sum(tl.reshape(partial, (2, 4)), 0)
    partial = tl.sum(tl.reshape(partial, (2, 2)), 0)
    return tl.sum(partial, 0)


@triton.jit
def apply_rope(rope, cos, sin):
    """Interleaved pairs ``(2i, 2i + 1)`` of the 64 RoPE dims (float32 ``[64]``) rotated by ``cos[i]``,
    ``sin[i]`` (``[32]``): ``(bf16(a c - b s), bf16(a s + b c))``, each product and sum rounded."""
    even, odd = tl.split(tl.reshape(rope, (32, 2)))
    rotated_even = round_bf16(even * cos - odd * sin)
    rotated_odd = round_bf16(even * sin + odd * cos)
    return tl.reshape(tl.join(rotated_even, rotated_odd), (64,))


@triton.jit
def _butterfly(x, H: tl.constexpr):
    """One Walsh-Hadamard stage of stride ``H`` on ``[128]``: ``(a, b) -> (a + b, a - b)`` for the pairs
    ``(c, c + H)``, ``c & H == 0``."""
    pairs = tl.permute(tl.reshape(x, (64 // H, 2, H)), (0, 2, 1))
    low, high = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(low + high, low - high), (0, 2, 1)), (128,))


@triton.jit
def hadamard_128(first, second):
    """``H [first | second] / sqrt(128)`` of a 128-wide row given as two 64-wide halves: butterflies of
    stride 1, 2, ..., 64, then one multiply by the float32 ``1 / sqrt(128)`` (the header's order)."""
    x = tl.reshape(tl.permute(tl.join(first, second), (1, 0)), (128,))
    x = _butterfly(x, 1)
    x = _butterfly(x, 2)
    x = _butterfly(x, 4)
    x = _butterfly(x, 8)
    x = _butterfly(x, 16)
    x = _butterfly(x, 32)
    x = _butterfly(x, 64)
    return x * 0.08838834764831845


@triton.jit
def float_to_e2m1(x):
    """float32 -> e2m1 code (int32 0..15, sign in bit 3): round to nearest even, saturating at +-6, NaN
    to 7 (``fp8::float_to_e2m1``): the count of midpoints at or above ``|x|`` (``<=`` where the lower
    neighbour's code is even, ``<`` where it is odd)."""
    a = tl.abs(x)
    below = ((a <= 5.0).to(tl.int32) + (a < 3.5).to(tl.int32) + (a <= 2.5).to(tl.int32) + (a < 1.75).to(tl.int32)
             + (a <= 1.25).to(tl.int32) + (a < 0.75).to(tl.int32) + (a <= 0.25).to(tl.int32))
    return ((x.to(tl.int32, bitcast=True) >> 28) & 8) | (7 - below)


@triton.jit
def store_indexer_fp8_token(cache_ptr, value_off, scale_off, z, valid, PACKED: tl.constexpr, FP8_HW: tl.constexpr):
    """A 128-wide row (float32 ``[128]``) into one ``INDEXER_FP8`` token: ``s = max(amax, 1e-4) / 448``
    and codes ``e4m3(z / s)``, both true divisions, then ``s``'s bits (``store_indexer_fp8``)."""
    amax = tl.maximum(tl.max(tl.abs(z), 0), 1e-4)
    scale = tl.div_rn(amax, 448.0)
    codes = encode_e4m3(tl.div_rn(z, scale), FP8_HW)
    on = tl.where(valid, 1, 0)
    store_words(cache_ptr + value_off, pack_words(codes, 16, 8, 64), tl.arange(0, 16) < 16 * on, PACKED)
    scale_bits = tl.zeros((1,), tl.int32) + scale.to(tl.int32, bitcast=True)
    store_words(cache_ptr + scale_off, scale_bits, tl.arange(0, 1) < on, PACKED)


@triton.jit
def store_indexer_fp4_token(cache_ptr, value_off, scale_off, z, valid, PACKED: tl.constexpr):
    """A 128-wide row (float32 ``[128]``) into one ``INDEXER_FP4`` token: per block of 32, ``e`` the
    smallest integer with ``6 * 2^e >= max(amax, 6 * 2^-126)``, codes ``e2m1(z * 2^-e)`` two per byte
    (even element in the low nibble), scale byte ``e + 127`` (``store_indexer_fp4``)."""
    blocks = tl.reshape(z, (4, 32))
    amax = tl.maximum(tl.max(tl.abs(blocks), 1), 7.052966104933725e-38)  # 6 * 2^-126
    e = ceil_scale_exponent(amax, 6.0)
    codes = float_to_e2m1(blocks * exp2_int(-e)[:, None])
    on = tl.where(valid, 1, 0)
    store_words(cache_ptr + value_off, pack_words(codes, 8, 16, 64), tl.arange(0, 8) < 8 * on, PACKED)
    store_words(cache_ptr + scale_off, pack_words(e + 127, 1, 4, 32), tl.arange(0, 1) < on, PACKED)


@triton.jit
def entry_target(slots_ptr, positions_ptr, n, num_slots, rope_positions):
    """Entry ``n``'s (slot, RoPE position, stored): an entry is stored only when its slot is in the cache
    and its position in the RoPE table (else it is worked on slot 0, position 0 and not written)."""
    slot = tl.load(slots_ptr + n)
    pos = tl.load(positions_ptr + n)
    valid = (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < rope_positions)
    return tl.where(valid, slot, 0), tl.where(valid, pos, 0), valid


@triton.jit
def _normalized(row_ptr, weight_ptr, offsets, inv, mask):
    """``bf16((bf16(x) * inv) * weight)`` of the channels at ``offsets`` (0 where not ``mask``)."""
    x = round_bf16(tl.load(row_ptr + offsets, mask=mask, other=0.0))
    return round_bf16(x * inv * tl.load(weight_ptr + offsets, mask=mask, other=0.0))


@triton.jit
def norm_rope_store_kernel(x_ptr, x_stride, weight_ptr, positions_ptr, slots_ptr, cache_ptr, page_stride, page_shift,
                           num_slots, eps, cos_ptr, sin_ptr, rope_positions, KIND: tl.constexpr,
                           PACKED: tl.constexpr, FP8_HW: tl.constexpr):
    """Entry ``n``: norm, RoPE at ``positions[n]``, (Hadamard,) quantize into token ``slots[n]`` (skipped
    for a slot outside the cache or a position outside the RoPE table). ``KIND``: 0 ``V4`` (512 wide),
    1 ``INDEXER_FP8``, 2 ``INDEXER_FP4`` (128 wide)."""
    D: tl.constexpr = 512 if KIND == 0 else 128
    n = tl.program_id(0).to(tl.int64)
    slot, pos, valid = entry_target(slots_ptr, positions_ptr, n, num_slots, rope_positions)
    row = x_ptr + n * x_stride
    # 1. inv = 1 / sqrt(mean(x^2) + eps) of the bf16-rounded row, in the team order.
    x = round_bf16(tl.load(row + tl.arange(0, D // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]))
    ms = tl.div_rn(team_sum(x * x, D // 32), D * 1.0)
    inv = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    # 2. The normalized RoPE dims, rotated.
    t = D - 64 + tl.arange(0, 64)
    pair = pos * 32 + tl.arange(0, 32)
    rope = apply_rope(_normalized(row, weight_ptr, t, inv, t < D), tl.load(cos_ptr + pair), tl.load(sin_ptr + pair))
    # 3. The rest, normalized, and the record.
    page = slot >> page_shift
    in_page = slot & ((1 << page_shift) - 1)
    if KIND == 0:
        block = tl.arange(0, 8)[:, None]
        c = block * 64 + tl.arange(0, 64)[None, :]
        nope = _normalized(row, weight_ptr, c, inv, block < 7)
        store_v4_token(cache_ptr, page * page_stride + in_page * 576,
                       page * page_stride + (1 << page_shift) * 576 + in_page * 8, nope, rope, valid, PACKED,
                       FP8_HW)
    else:
        c = tl.arange(0, 64)
        z = hadamard_128(_normalized(row, weight_ptr, c, inv, c < 64), rope)
        if KIND == 1:
            store_indexer_fp8_token(cache_ptr, page * page_stride + in_page * 128,
                                    page * page_stride + (1 << page_shift) * 128 + in_page * 4, z, valid, PACKED,
                                    FP8_HW)
        else:
            store_indexer_fp4_token(cache_ptr, page * page_stride + in_page * 64,
                                    page * page_stride + (1 << page_shift) * 64 + in_page * 4, z, valid, PACKED)


def check_store_arguments(x, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin, cache_kind):
    """The header entry ``norm_rope_store<Kind>``'s checks, in its order; returns (page_shift, num_slots)."""
    _, dim, layout = KINDS[cache_kind]
    check_disjoint(read(x, "x"), read(weight, "weight"), read(positions, "positions"), written(cache, "cache"),
                   read(slots, "slots"), read(rope_cos, "rope_cos"), read(rope_sin, "rope_sin"))
    check(x, "x").dtype(torch.float32).ndim(2).size(1, dim, "head dim").rows_dense().same_device(cache, "cache")
    return check_store(x.shape[0], cache_kind, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin)


def check_store(entries, cache_kind, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin,
                read_slots=True):
    """The header's ``check_store<Kind>`` for ``entries`` rows, in its order (the positions and slots are
    read when ``read_slots`` and host-readable); returns (page_shift, num_slots)."""
    _, dim, layout = KINDS[cache_kind]
    check(weight, "weight").dtype(torch.float32).ndim(1).size(0, dim, "head dim").contiguous()
    check(weight, "weight").same_device(cache, "cache")
    check(positions, "positions").dtype(torch.int64).ndim(1).contiguous().size(0, entries, "entries")
    check(positions, "positions").same_device(cache, "cache")
    check(slots, "slots").ndim(1).size(0, entries, "entries")
    for table in ("rope_cos", "rope_sin"):
        t = rope_cos if table == "rope_cos" else rope_sin
        check(t, table).dtype(torch.float32).ndim(2).contiguous().size(1, ROPE_PAIRS, "rope pairs (64 / 2)")
        check(t, table).same_device(cache, "cache")
    check(rope_sin, "rope_sin").size(0, rope_cos.shape[0], "max positions of rope_cos")
    if read_slots and positions.device.type != "cuda":
        pos = positions.numpy()
        bad = np.flatnonzero((pos < 0) | (pos >= rope_cos.shape[0]))
        if bad.size:
            raise IndexError(f"sparsekv: argument `positions`[{bad[0]}] gives RoPE position {pos[bad[0]]}, outside "
                             f"the RoPE table [0, {rope_cos.shape[0]})")
    if not eps >= 0.0:
        raise ValueError(f"sparsekv: argument `eps` must be >= 0, got {eps:g}")
    return check_paged_cache(cache, slots, page_slots, layout, read_slots)


def norm_rope_store(x, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin, cache_kind):
    """Check (:func:`check_store_arguments`), then store every entry.

    The body of the ``sparsekv::norm_rope_store`` op for ``impl="triton"``.
    """
    shift, num_slots = check_store_arguments(x, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin,
                                             cache_kind)
    if x.shape[0] == 0:
        return
    norm_rope_store_kernel[(x.shape[0],)](
        x, row_stride(x), weight, positions, slots, cache, row_stride(cache), shift, num_slots, float(eps), rope_cos,
        rope_sin, rope_cos.shape[0], KIND=KINDS[cache_kind][0], PACKED=word_aligned(cache), FP8_HW=hardware_fp8(cache),
        num_warps=NUM_WARPS,
        **LAUNCH_OPTIONS)


def _aot_kernels():
    from sparsekv.jit_kernel.triton.aot import AotKernel, Constexpr, Float, Int, Pointer

    # The benchmark's serving shape: contiguous [N, d] entries, 64-slot pages of 1024 pages, a
    # 64k-position RoPE table.
    return [AotKernel(f"dsv4_store.norm_rope_store[{kind}]", norm_rope_store_kernel,
                      {"x_ptr": Pointer("fp32"), "x_stride": Int(d), "weight_ptr": Pointer("fp32"),
                       "positions_ptr": Pointer("i64"), "slots_ptr": Pointer("i64"), "cache_ptr": Pointer("u8"),
                       "page_stride": Int(layout.page_bytes(64)), "page_shift": Int(6), "num_slots": Int(65536),
                       "eps": Float(), "cos_ptr": Pointer("fp32"), "sin_ptr": Pointer("fp32"),
                       "rope_positions": Int(65536), "KIND": Constexpr(code), "PACKED": Constexpr(True),
                       "FP8_HW": Constexpr(True)},
                      NUM_WARPS, LAUNCH_OPTIONS)
            for kind, (code, d, layout) in KINDS.items()]


#: The launch configurations :mod:`sparsekv.jit_kernel.triton.aot` compiles ahead of time.
AOT_KERNELS = _aot_kernels()

"""Triton twin of ``csrc/dsv4_quant.cuh``'s ``fp8_ds_mla`` quantizer, with packed stores, and its
reusable ``@triton.jit`` pieces.

Same contract as :func:`sparsekv.jit_kernel.dsv4_quant.quantize_fp8_ds_mla` (which calls
:func:`quantize_fp8_ds_mla` here for ``impl="triton"``), and the same bytes: every step is integer
arithmetic on the float32 bits (the header's ``fp8::`` encoders, written again on tensors) or a
multiply by an exact power of two, so the result does not depend on the device, the compiler's
float contraction or the interpreter. On sm_89+ the e4m3 codes come from the convert instruction
instead (:func:`encode_e4m3`, as the header's ``fp8::float_to_e4m3x2``), which gives the integer
encoder's bytes for every input.

One program per token (2 warps): the row is held as ``[8, 64]`` (the seven 64-wide e4m3 blocks
and a masked eighth) plus the 64 bf16 RoPE dims; the record leaves as 64-bit words, one per thread
(``STG.E.64``): 56 words of e4m3 codes, 16 of bf16 quadruples and the scale record (7 UE8M0 bytes
and the zero pad), not byte stores. Only when the cache's base address or page stride is not a
multiple of 8 bytes (a sliced view) does the launcher fall back to byte stores of the same bytes.

Reusable pieces (the fused compress -> norm -> RoPE -> quantize -> store kernels build on them):
:func:`float_to_e4m3`, :func:`encode_e4m3`, :func:`float_to_bf16`, :func:`ceil_scale_exponent`, :func:`exp2_int`,
:func:`pack_words`, :func:`store_words` and :func:`store_v4_token` (a 512-wide row held as
``[8, 64]`` + ``[64]`` into one token's value and scale records).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from sparsekv.jit_kernel.triton import interpreting
from sparsekv.jit_kernel.triton.checks import check, check_disjoint, page_shift, read, row_stride, written
from sparsekv.kv_layout import V4

__all__ = ["AOT_KERNELS", "check_paged_cache", "check_quantize_arguments", "hardware_fp8", "quantize_fp8_ds_mla",
           "word_aligned"]

DIM = 512
NUM_WARPS = 2


@triton.jit
def float_to_bf16(x):
    """float32 -> bf16 bits (int32 in [0, 65535]): round to nearest even, NaN kept quiet (``fp8::float_to_bf16``)."""
    u = x.to(tl.int32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, rounded) & 0xFFFF


@triton.jit
def float_to_e4m3(x):
    """float32 -> e4m3fn code (int32 in [0, 255]): round to nearest even, saturating at +-448, every NaN
    to 0x7F, the hardware convert's canonical NaN (``fp8::float_to_e4m3``)."""
    u = x.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    abs_bits = u & 0x7FFFFFFF
    a = abs_bits.to(tl.float32, bitcast=True)
    # Below 2^-6: the subnormal grid of 2^-9, round(a * 512) in [0, 8] (8 is the smallest normal's code).
    v = tl.minimum(a, 0.015625) * 512.0
    lower = v.to(tl.int32)  # v >= 0: truncation is floor
    diff = v - lower.to(tl.float32)  # exact: the fraction of a float is a float
    subnormal = lower + ((diff > 0.5) | ((diff == 0.5) & ((lower & 1) == 1))).to(tl.int32)
    # Normal: keep 3 mantissa bits, round the 20 below to nearest even; a carry out of the mantissa
    # adds to the exponent field, which is what the sum of the two fields does.
    mantissa = (abs_bits >> 20) & 7
    rest = abs_bits & 0xFFFFF
    up = ((rest > 0x80000) | ((rest == 0x80000) & ((mantissa & 1) == 1))).to(tl.int32)
    normal = ((((abs_bits >> 23) & 0xFF) - 120) << 3) + mantissa + up
    code = tl.where(a < 0.015625, subnormal, normal)
    code = tl.where(a >= 448.0, 0x7E, code)
    return tl.where(abs_bits > 0x7F800000, 0x7F, sign | code)


@triton.jit
def encode_e4m3(x, FP8_HW: tl.constexpr):
    """float32 -> e4m3fn code (int32 in [0, 255]), the bytes of :func:`float_to_e4m3`: with ``FP8_HW``
    (compiled for a GPU of compute capability 8.9 or later) the convert instruction, which Triton
    emits as ``cvt.rn.satfinite.e4m3x2.f32`` (SASS ``F2FP.SATFINITE.E4M3.F32.PACK_AB``: round to
    nearest even, finite values and infinities saturated at +-448, NaN to 0x7F); else the integer
    encoder (the interpreter, older GPUs)."""
    if FP8_HW:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        return float_to_e4m3(x)


@triton.jit
def ceil_scale_exponent(amax, MAX_FINITE: tl.constexpr):
    """The smallest integer ``e`` with ``MAX_FINITE * 2^e >= amax`` (int32), for positive normal floats,
    from their exponent and mantissa fields (``fp8::ceil_scale_exponent``: no division, no rounding)."""
    a = amax.to(tl.int32, bitcast=True)
    m = tl.full((), MAX_FINITE, tl.float32).to(tl.int32, bitcast=True)
    return ((a >> 23) & 0xFF) - ((m >> 23) & 0xFF) + ((a & 0x7FFFFF) > (m & 0x7FFFFF)).to(tl.int32)


@triton.jit
def exp2_int(e):
    """``2^e`` as float32 for int32 ``e`` in ``[-127, 127]`` (2^-127 is a subnormal; ``fp8::exp2_int``)."""
    return tl.where(e >= -126, (e + 127) << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def pack_words(values, WORDS: tl.constexpr, PER_WORD: tl.constexpr, BITS: tl.constexpr):
    """Little-endian ``BITS``-bit words (32 or 64) of ``values`` (a flat run of int32 fields of
    ``BITS // PER_WORD`` bits each, any shape of ``WORDS * PER_WORD`` elements in row-major order):
    ``[WORDS]`` int32 or int64."""
    fields = tl.reshape(values, (WORDS, PER_WORD))
    if BITS == 64:
        fields = fields.to(tl.int64)
    shift = tl.arange(0, PER_WORD) * (BITS // PER_WORD)
    return tl.reduce(fields << shift[None, :], 1, _bitwise_or)


@triton.jit
def store_words(ptr, words, mask, PACKED: tl.constexpr):
    """Store little-endian int32 or int64 ``words`` (``[W]``) at byte pointer ``ptr`` where ``mask``: as
    4- or 8-byte stores when ``PACKED`` (``ptr`` a multiple of the word's size), else as their bytes."""
    word = tl.arange(0, words.shape[0])
    if PACKED:
        tl.store(ptr.to(tl.pointer_type(words.dtype)) + word, words, mask=mask)
    else:
        byte = tl.arange(0, words.dtype.primitive_bitwidth // 8)
        tl.store(ptr + word[:, None] * (words.dtype.primitive_bitwidth // 8) + byte[None, :],
                 ((words[:, None] >> (byte * 8)[None, :]) & 0xFF).to(tl.uint8), mask=mask[:, None])


@triton.jit
def store_v4_token(cache_ptr, value_off, scale_off, nope, rope, valid, PACKED: tl.constexpr, FP8_HW: tl.constexpr):
    """Quantize one 512-wide row into the V4 (``fp8_ds_mla``) token whose value record is at byte
    ``value_off`` of ``cache_ptr`` and scale record at ``scale_off``; nothing is written unless ``valid``.

    ``nope``: float32 ``[8, 64]``, dims 0-447 as seven blocks (the eighth row is ignored); ``rope``:
    float32 ``[64]``, dims 448-511. Per block: ``e`` the smallest integer with ``448 * 2^e >=
    max(amax, 1e-4)``, codes ``e4m3(x * 2^-e)`` (exact: ``2^-e`` is a power of two), scale byte
    ``e + 127``; then the bf16 RoPE dims and the zero pad byte (``store_v4`` of the header).
    ``PACKED``: both offsets and the base are multiples of 8 bytes, so the record goes out as 64-bit
    words (56 of codes, 16 of bf16 quadruples, 1 of scales: ``STG.E.64``); else as bytes. ``FP8_HW``:
    the codes come from the convert instruction (:func:`encode_e4m3`).
    """
    block = tl.arange(0, 8)
    amax = tl.maximum(tl.max(tl.abs(nope), 1), 1e-4)
    e = ceil_scale_exponent(amax, 448.0)
    codes = encode_e4m3(nope * exp2_int(-e)[:, None], FP8_HW)
    scales = tl.where(block < 7, e + 127, 0)
    on = tl.where(valid, 1, 0)  # masks as bounds times `on`: the interpreter's `&` of a scalar and a block is no mask
    store_words(cache_ptr + value_off, pack_words(codes, 64, 8, 64), tl.arange(0, 64) < 56 * on, PACKED)
    store_words(cache_ptr + value_off + 448, pack_words(float_to_bf16(rope), 16, 4, 64), tl.arange(0, 16) < 16 * on,
                PACKED)
    store_words(cache_ptr + scale_off, pack_words(scales, 1, 8, 64), tl.arange(0, 1) < on, PACKED)


@triton.jit
def quantize_v4_kernel(x_ptr, x_stride, slots_ptr, cache_ptr, page_stride, page_shift, num_slots,
                       PACKED: tl.constexpr, FP8_HW: tl.constexpr):
    """Row ``i`` of ``x`` into token ``slots[i]`` (skipped outside ``[0, num_slots)``)."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = slot >> page_shift
    in_page = slot & ((1 << page_shift) - 1)
    value_off = page * page_stride + in_page * 576
    scale_off = page * page_stride + (1 << page_shift) * 576 + in_page * 8
    block = tl.arange(0, 8)
    d = tl.arange(0, 64)
    row = x_ptr + i * x_stride
    nope = tl.load(row + block[:, None] * 64 + d[None, :], mask=(block < 7)[:, None], other=0.0).to(tl.float32)
    rope = tl.load(row + 448 + d).to(tl.float32)
    store_v4_token(cache_ptr, value_off, scale_off, nope, rope, valid, PACKED, FP8_HW)


def check_unique_slots(slots, num_slots: int) -> None:
    """Host-readable slots (a tensor or a list): every one in range, then none twice, the header's order and
    messages (``check_unique_slots``)."""
    values = (slots.numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots, dtype=np.int64)).ravel()
    bad = np.flatnonzero((values < 0) | (values >= num_slots))
    if bad.size:
        raise IndexError(f"sparsekv: argument `slots`[{bad[0]}] = {values[bad[0]]} is out of range [0, {num_slots})")
    # The second time of a repeat: sorted stably, a slot's later positions follow its first; the
    # smallest of them is the one a left-to-right scan meets first.
    order = np.argsort(values, kind="stable")
    repeats = order[1:][values[order[1:]] == values[order[:-1]]]
    if repeats.size:
        i = int(repeats.min())
        raise ValueError(f"sparsekv: argument `slots` names slot {values[i]} twice (second time at position {i}); "
                         f"slots must be unique")


def check_quantize_arguments(x, cache, slots, page_slots, layout=V4, dim=DIM):
    """The header entry's ``check_quantize<L, D>``, in its order; returns (page_shift, num_slots)."""
    check_disjoint(read(x, "x"), written(cache, "cache"), read(slots, "slots"))
    check(x, "x").dtype(torch.float32, torch.bfloat16)
    check(x, "x").ndim(2).size(1, dim, "head dim").rows_dense().same_device(cache, "cache")
    check(slots, "slots").ndim(1).size(0, x.shape[0], "rows of x")
    return check_paged_cache(cache, slots, page_slots, layout)


def check_paged_cache(cache, slots, page_slots, layout, read_slots=True):
    """The header's ``check_paged_cache<L>`` with unique slots (checked when ``read_slots``), in its order;
    returns (page_shift, num_slots)."""
    shift = page_shift(page_slots, "page_slots")
    check(cache, "cache").dtype(torch.uint8).ndim(2).rows_dense()
    check(cache, "cache").size(1, layout.page_bytes(page_slots), "page bytes for page_slots")
    check(slots, "slots").dtype(torch.int64).ndim(1).contiguous().same_device(cache, "cache")
    num_slots = cache.shape[0] * page_slots
    if cache.device.type != "cuda" and read_slots:
        check_unique_slots(slots, num_slots)
    return shift, num_slots


def hardware_fp8(cache) -> bool:
    """Whether the kernels writing ``cache`` encode e4m3 with the convert instruction (``FP8_HW``): they
    are compiled (not interpreted) for a GPU of compute capability 8.9 or later."""
    return cache.is_cuda and not interpreting() and torch.cuda.get_device_capability(cache.device) >= (8, 9)


def word_aligned(cache) -> bool:
    """Whether every page of a paged cache starts on an 8-byte boundary, so every record on its word's
    (the ``PACKED`` stores: 8-byte words, and the indexer caches' 4-byte scales)."""
    return cache.data_ptr() % 8 == 0 and row_stride(cache) % 8 == 0


def quantize_fp8_ds_mla(x, cache, slots, page_slots):
    """Check (:func:`check_quantize_arguments`), then quantize each row of ``x`` into its slot.

    The body of the ``sparsekv::quantize_fp8_ds_mla`` op for ``impl="triton"``.
    """
    shift, num_slots = check_quantize_arguments(x, cache, slots, page_slots)
    if x.shape[0] == 0:
        return
    quantize_v4_kernel[(x.shape[0],)](x, row_stride(x), slots, cache, row_stride(cache), shift, num_slots,
                                      PACKED=word_aligned(cache), FP8_HW=hardware_fp8(cache), num_warps=NUM_WARPS)


def _aot_kernels():
    from sparsekv.jit_kernel.triton.aot import AotKernel, Constexpr, Int, Pointer

    # The benchmark's serving shape: contiguous [N, 512] rows into 64-slot pages of 1024 pages.
    return [AotKernel(f"dsv4_quant.fp8_ds_mla[{x_type}]", quantize_v4_kernel,
                      {"x_ptr": Pointer(x_type), "x_stride": Int(512), "slots_ptr": Pointer("i64"),
                       "cache_ptr": Pointer("u8"), "page_stride": Int(V4.page_bytes(64)), "page_shift": Int(6),
                       "num_slots": Int(65536), "PACKED": Constexpr(True),
                       "FP8_HW": Constexpr(True)}, NUM_WARPS)
            for x_type in ("bf16", "fp32")]


#: The launch configurations :mod:`sparsekv.jit_kernel.triton.aot` compiles ahead of time.
AOT_KERNELS = _aot_kernels()

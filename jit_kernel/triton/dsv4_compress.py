"""Triton twin of ``compress_pool`` (``csrc/dsv4_compress.cuh``): the C4 and C128 compressors.

Same contract as :func:`sparsekv.jit_kernel.dsv4_compress.compress_pool` (which calls
:func:`compress_pool` here for ``impl="triton"``): entry ``i`` pools, per channel, a softmax over its
window's slots of ``score + ape`` weighting ``kv`` (C4: slots 0-3 are tokens ``4(i-1) .. 4i-1`` on the
first ``d`` channels, none for ``i = 0``; slots 4-7 tokens ``4i .. 4i+3`` on the last ``d``; C128: slot
``j`` is token ``128 i + j``).

One program per (entry, ``BLOCK_D`` channels): ``BLOCK_D / (32 warps)`` channels a thread, so each
slot's row is one coalesced load of 16 bytes a thread. Two passes over the window in slot order, as
the header's ``pool_tile``: the maximum of ``logit = score + ape``, then ``w = exp(logit - max)``,
``sum += w`` and ``acc += w * kv``, each step a float32 operation rounded as written (the launch turns
FMA contraction off, ``enable_fp_fusion=False``), and ``acc / sum`` an IEEE division
(``tl.div_rn``). The sums run in the header's order, so the only operation that can round differently
is the exponential:

* on a GPU the kernel calls libdevice's ``expf`` (``__nv_expf``, what the header's ``expf`` compiles
  to under nvcc, with subnormals kept: ``enable_reflect_ftz=False``), so its entries are meant to equal
  the cuda header's bit for bit (not yet run on a GPU);
* under the interpreter ``tl.exp`` is numpy's float32 ``exp``, which differs from glibc's ``expf`` (the
  cpu header's) by an ulp in about a quarter of its arguments.

Documented tolerance (both implementations, against the fp64 reference, and between them): within
``1e-5 + 1e-5 |ref|`` (the tests' bound; an ulp of a weight moves an entry by about ``1e-7 max |kv|``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sparsekv.jit_kernel.triton import interpreting
from sparsekv.jit_kernel.triton.checks import check, check_disjoint, read, row_stride, written

__all__ = ["AOT_KERNELS", "LAUNCH_OPTIONS", "check_inputs", "compress_pool", "compress_pool_launch"]

#: Channels per program (at most; a narrower entry takes the next power of two above its width).
BLOCK_D = 256
#: Compile options of every compressor launch: the header's rounding (no FMA contraction, no flush of
#: subnormals in libdevice's ``expf``).
LAUNCH_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _exp(x, NATIVE: tl.constexpr):
    """``expf``: libdevice's on a GPU (the header's), numpy's float32 ``exp`` under the interpreter."""
    if NATIVE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _window_slot(i, j, d, RATIO: tl.constexpr):
    """Token and channel offset of slot ``j`` of entry ``i`` of one sequence (C4: the A half of slots
    0-3 starts at channel 0, the B half of slots 4-7 at ``d``), and its row of ``ape``."""
    if RATIO == 4:
        token = 4 * i - 4 + j
        half = tl.where(j >= 4, d, 0)
        ape_row = j & 3
    else:
        token = RATIO * i + j
        half = j * 0
        ape_row = j
    return token, half, ape_row


@triton.jit
def _pool_sequence(kv_ptr, score_ptr, kv_stride, score_stride, ape_ptr, ape_stride, i, c, d, RATIO: tl.constexpr,
                   NATIVE: tl.constexpr):
    """Entry ``i`` of one whole sequence on channels ``c`` (a block of them, ``c < d`` valid): the two
    passes of the header's ``pool_tile`` in slot order, every step rounded as written."""
    WINDOW: tl.constexpr = 8 if RATIO == 4 else RATIO
    first = tl.where((RATIO == 4) & (i == 0), 4, 0)  # C4's entry 0 has no A half
    ok = c < d
    m = tl.full(c.shape, float("-inf"), tl.float32)
    for j in range(first, WINDOW):
        token, half, ape_row = _window_slot(i, j, d, RATIO)
        score = tl.load(score_ptr + token.to(tl.int64) * score_stride + half + c, mask=ok, other=0.0)
        logit = score + tl.load(ape_ptr + ape_row * ape_stride + half + c, mask=ok, other=0.0)
        m = tl.where(logit > m, logit, m)
    total = tl.zeros(c.shape, tl.float32)
    acc = tl.zeros(c.shape, tl.float32)
    for j in range(first, WINDOW):
        token, half, ape_row = _window_slot(i, j, d, RATIO)
        score = tl.load(score_ptr + token.to(tl.int64) * score_stride + half + c, mask=ok, other=0.0)
        kv = tl.load(kv_ptr + token.to(tl.int64) * kv_stride + half + c, mask=ok, other=0.0)
        w = _exp((score + tl.load(ape_ptr + ape_row * ape_stride + half + c, mask=ok, other=0.0)) - m, NATIVE)
        total = total + w
        acc = acc + w * kv
    return tl.where(total > 0.0, tl.div_rn(acc, tl.where(total > 0.0, total, 1.0)), 0.0)


@triton.jit
def compress_pool_kernel(kv_ptr, score_ptr, kv_stride, score_stride, ape_ptr, out_ptr, d, RATIO: tl.constexpr,
                         BLOCK_D: tl.constexpr, NATIVE: tl.constexpr):
    """Channels ``[tile * BLOCK_D, (tile + 1) * BLOCK_D)`` of entry ``i``."""
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    coff: tl.constexpr = 2 if RATIO == 4 else 1
    pooled = _pool_sequence(kv_ptr, score_ptr, kv_stride, score_stride, ape_ptr, coff * d, i, c, d, RATIO, NATIVE)
    tl.store(out_ptr + i * d + c, pooled, mask=c < d)


def check_inputs(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int) -> int:
    """``check_inputs`` of ``dsv4_compress.cuh`` (same exceptions and messages): returns ``d``."""
    if ratio not in (4, 128):
        raise ValueError(f"sparsekv: argument `ratio` must be 4 or 128, got {ratio}")
    coff = 2 if ratio == 4 else 1
    check(kv, "kv").dtype(torch.float32).ndim(2).rows_dense()
    check(score, "score").dtype(torch.float32).ndim(2).rows_dense().same_device(kv, "kv")
    check(score, "score").size(0, kv.shape[0], "rows of kv").size(1, kv.shape[1], "width of kv")
    if kv.shape[1] == 0 or kv.shape[1] % coff:
        raise ValueError(f"sparsekv: argument `kv` must have a positive width divisible by {coff} for ratio {ratio}, "
                         f"got shape [{kv.shape[0]}, {kv.shape[1]}]")
    check(ape, "ape").dtype(torch.float32).ndim(2).contiguous().same_device(kv, "kv")
    check(ape, "ape").size(0, ratio, "ratio").size(1, kv.shape[1], "width of kv")
    return kv.shape[1] // coff


def check_pool_arguments(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int,
                         out: torch.Tensor) -> int:
    """The header entry ``compress_pool``'s checks, in its order (same exceptions and messages); ``d``."""
    check_disjoint(read(kv, "kv"), read(score, "score"), read(ape, "ape"), written(out, "out"))
    d = check_inputs(kv, score, ape, ratio)
    check(out, "out").dtype(torch.float32).ndim(2).contiguous().same_device(kv, "kv")
    check(out, "out").size(0, kv.shape[0] // ratio, "T // ratio").size(1, d, "d")
    return d


def compress_pool_launch(d: int) -> tuple[int, int]:
    """``(BLOCK_D, num_warps)`` of a ``d``-wide entry: at most :data:`BLOCK_D` channels, 4 a thread."""
    block = min(BLOCK_D, max(32, triton.next_power_of_2(d)))
    return block, max(1, block // 128)


def compress_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, out: torch.Tensor) -> None:
    """Check (:func:`check_pool_arguments`), then write every complete entry of the sequence into ``out``.

    The body of the ``sparsekv::compress_pool`` op for ``impl="triton"``.
    """
    d = check_pool_arguments(kv, score, ape, ratio, out)
    entries = out.shape[0]
    if entries == 0:
        return
    block, warps = compress_pool_launch(d)
    compress_pool_kernel[(entries, triton.cdiv(d, block))](
        kv, score, row_stride(kv), row_stride(score), ape, out, d, RATIO=ratio, BLOCK_D=block,
        NATIVE=not interpreting(), num_warps=warps, **LAUNCH_OPTIONS)


def _aot_kernels():
    from sparsekv.jit_kernel.triton.aot import AotKernel, Constexpr, Int, Pointer

    kernels = []
    for ratio in (4, 128):
        for d in (512, 128):  # the main compressor and the indexer's
            block, warps = compress_pool_launch(d)
            width = (2 if ratio == 4 else 1) * d  # contiguous [T, coff * d] kv and score, as the benchmark's
            kernels.append(AotKernel(f"dsv4_compress.pool[C{ratio},d{d}]", compress_pool_kernel,
                                     {"kv_ptr": Pointer("fp32"), "score_ptr": Pointer("fp32"), "kv_stride": Int(width),
                                      "score_stride": Int(width), "ape_ptr": Pointer("fp32"),
                                      "out_ptr": Pointer("fp32"), "d": Int(d), "RATIO": Constexpr(ratio),
                                      "BLOCK_D": Constexpr(block), "NATIVE": Constexpr(True)},
                                     warps, LAUNCH_OPTIONS))
    return kernels


#: The launch configurations :mod:`sparsekv.jit_kernel.triton.aot` compiles ahead of time.
AOT_KERNELS = _aot_kernels()

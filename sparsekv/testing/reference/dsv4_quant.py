"""Torch references for the DSV4 block quantizers: the byte oracles of every store and load kernel.

``fp8_ds_mla`` (the 584-byte ``V4`` token of :mod:`sparsekv.kv_layout`) stores a 512-wide
row as:

* dims 0-447: 7 blocks of 64. For each block ``a = max(amax over the block (in float32), 1e-4)``,
  ``e`` = the smallest integer with ``448 * 2^e >= a``; value byte = e4m3 (round to nearest even)
  of ``x / 2^e`` clamped to +-448; scale byte = ``e + 127`` (UE8M0).
* dims 448-511: bf16 (round to nearest even), little-endian, 128 bytes.
* value record = 448 e4m3 bytes + 128 bf16 bytes (576); scale record = 7 scale bytes + 1 zero pad byte (8).

The e2m1 (FP4) block quantizer of the indexer cache is here too: blocks of 32, ``a = max(amax,
6 * 2^-126)``, ``e`` the smallest integer with ``6 * 2^e >= a``, codes round to nearest even of
``x / 2^e`` clamped to +-6, two codes per byte with the even element in the low nibble.

The indexer keys (:func:`quantize_indexer_keys`, the oracle of the plain indexer-key quantizer and
the last step of the fused store): ``INDEXER_FP8`` (132 B) is 128 e4m3 codes of ``x / s`` then the
fp32 scale ``s = max(amax, 1e-4) / 448`` (IEEE float32 divisions, not multiplies by a rounded
reciprocal); ``INDEXER_FP4`` (68 B) is the packed FP4 codes then the 4 scale bytes.

Everything works on whole tensors; scale exponents are found exactly (mantissa comparison, not a
rounded ``log2``), the rounding is torch's own float8 cast after clamping.
"""

from __future__ import annotations

import torch

from sparsekv.kv_layout import INDEXER_LAYOUTS, V4, KVLayout

NOPE_DIMS = 448
ROPE_DIMS = 64
DIM = NOPE_DIMS + ROPE_DIMS
FP8_BLOCK = 64
NUM_FP8_BLOCKS = NOPE_DIMS // FP8_BLOCK
E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP4_BLOCK = 32
E2M1_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
_E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def ceil_scale_exponent(amax: torch.Tensor, max_finite: float) -> torch.Tensor:
    """The smallest integer ``e`` with ``max_finite * 2^e >= amax`` (elementwise, positive float32 ``amax``).

    Exact: with ``amax = m * 2^E`` and ``max_finite = mf * 2^Ef`` (mantissas in [0.5, 1)),
    ``e = E - Ef + (m > mf)``.
    """
    mantissa, exponent = torch.frexp(amax.to(torch.float32))
    max_mantissa, max_exponent = torch.frexp(torch.tensor(max_finite, dtype=torch.float32))
    return (exponent - max_exponent + (mantissa > max_mantissa).to(exponent.dtype)).to(torch.int32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(e, dtype=torch.float64), e.to(torch.int64))


def encode_fp8_ds_mla(x: torch.Tensor) -> torch.Tensor:
    """The 584-byte records of ``x`` (float32 or bf16 ``[N, 512]``): uint8 ``[N, 584]`` (value then scale)."""
    if x.dim() != 2 or x.shape[1] != DIM or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be float32 or bf16 [N, {DIM}], got {x.dtype} {list(x.shape)}")
    n = x.shape[0]
    x32 = x.to(torch.float32)
    blocks = x32[:, :NOPE_DIMS].reshape(n, NUM_FP8_BLOCKS, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_min(FP8_AMAX_FLOOR)
    e = ceil_scale_exponent(amax, E4M3_MAX)
    # Division by a power of two is exact in float64 and in float32 alike.
    scaled = (blocks.to(torch.float64) / _pow2(e)[:, :, None]).to(torch.float32).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE_DIMS)
    rope = x32[:, NOPE_DIMS:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * ROPE_DIMS)
    scales = torch.zeros(n, V4.scale_bytes, dtype=torch.uint8, device=x.device)
    scales[:, :NUM_FP8_BLOCKS] = (e + 127).to(torch.uint8)
    return torch.cat([values, rope, scales], dim=1)


def decode_fp8_ds_mla(records: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, 512]`` values of uint8 ``[N, 584]`` records: ``e4m3 * 2^(byte - 127)``, then the bf16 dims."""
    n = records.shape[0]
    codes = records[:, :NOPE_DIMS].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    scale_bytes = records[:, V4.value_bytes : V4.value_bytes + NUM_FP8_BLOCKS].to(torch.int64)
    nope = codes.reshape(n, NUM_FP8_BLOCKS, FP8_BLOCK) * _pow2(scale_bytes - 127)[:, :, None]
    rope = records[:, NOPE_DIMS : V4.value_bytes].contiguous().view(torch.bfloat16).to(torch.float64)
    return torch.cat([nope.reshape(n, NOPE_DIMS), rope], dim=1)


def _slot_views(cache: torch.Tensor, slots: torch.Tensor, page_slots: int):
    page = torch.div(slots, page_slots, rounding_mode="floor")
    offset = slots % page_slots
    return V4.value_view(cache, page_slots), V4.scale_view(cache, page_slots), page, offset


def quantize_fp8_ds_mla(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, page_slots: int) -> None:
    """In place: the records of ``x`` into the token slots ``slots`` of a paged uint8 ``[pages, page_bytes]`` cache."""
    values, scales, page, offset = _slot_views(cache, slots.to(torch.int64), page_slots)
    records = encode_fp8_ds_mla(x)
    values[page, offset] = records[:, : V4.value_bytes]
    scales[page, offset] = records[:, V4.value_bytes :]


def dequantize_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor, page_slots: int) -> torch.Tensor:
    """float64 ``[N, 512]``: the values stored in ``slots`` of a paged uint8 cache."""
    values, scales, page, offset = _slot_views(cache, slots.to(torch.int64), page_slots)
    return decode_fp8_ds_mla(torch.cat([values[page, offset], scales[page, offset]], dim=1))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, one per element) of ``x``: nearest of +-{0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even code."""
    a = x.to(torch.float64).abs().clamp(max=E2M1_MAX)
    distance = (a[..., None] - _E2M1_GRID.to(a.device)).abs()
    best = distance.min(dim=-1, keepdim=True).values
    # Among equally near grid points the even code wins: rank candidates by (code is odd, code).
    codes = torch.arange(8, device=x.device)
    rank = torch.where(distance == best, (codes % 2) * 8 + codes, torch.full_like(codes, 64))
    code = rank.argmin(dim=-1).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of 4-bit e2m1 codes."""
    magnitude = _E2M1_GRID.to(codes.device)[(codes & 7).to(torch.int64)]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def encode_fp4_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 block quantization of float32 ``[N, D]`` (D a multiple of 32).

    Returns packed codes uint8 ``[N, D // 2]`` (even element in the low nibble) and UE8M0 scale bytes
    uint8 ``[N, D // 32]``.
    """
    n, d = x.shape
    blocks = x.to(torch.float32).reshape(n, d // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_min(FP4_AMAX_FLOOR)
    e = ceil_scale_exponent(amax, E2M1_MAX)
    codes = encode_e2m1(blocks.to(torch.float64) / _pow2(e)[:, :, None]).reshape(n, d)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, (e + 127).to(torch.uint8)


def decode_fp4_blocks(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, D]`` values of packed FP4 codes and their UE8M0 block scales."""
    n = packed.shape[0]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(n, -1)
    values = decode_e2m1(codes).reshape(n, -1, FP4_BLOCK)
    return (values * _pow2(scale_bytes.to(torch.int64) - 127)[:, :, None]).reshape(n, -1)


#: Format of each indexer cache kind of the fused store.
INDEXER_FORMATS = {"INDEXER_FP8": "fp8", "INDEXER_FP4": "fp4"}


def encode_indexer_fp8(z: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 132]``: 128 e4m3 values of ``z / scale`` then the fp32 scale bytes (float32 ``z``)."""
    amax = z.abs().amax(dim=1).clamp_min(FP8_AMAX_FLOOR)
    # A true division on every device: CUDA torch divides by a CPU scalar as a multiply by its rounded
    # reciprocal, which differs from amax / 448 in the last bit for about half of all amax.
    scale = amax / torch.full_like(amax, E4M3_MAX)
    values = (z / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([values, scale.contiguous().view(torch.uint8).reshape(-1, 4)], dim=1)


def encode_indexer_keys(z: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 ``[N, 132]`` (``"fp8"``) or ``[N, 68]`` (``"fp4"``) records (value then scale) of 128-wide rows."""
    z = z.to(torch.float32)
    if fmt == "fp8":
        return encode_indexer_fp8(z)
    packed, scales = encode_fp4_blocks(z)
    return torch.cat([packed, scales], dim=1)


def store_records(records: torch.Tensor, layout: KVLayout, cache: torch.Tensor, slots: torch.Tensor,
                  page_slots: int) -> None:
    """In place: ``[N, layout.token_bytes]`` records (value then scale) into ``slots`` of a paged cache."""
    slots = slots.to(torch.int64)
    page, offset = torch.div(slots, page_slots, rounding_mode="floor"), slots % page_slots
    layout.value_view(cache, page_slots)[page, offset] = records[:, : layout.value_bytes]
    layout.scale_view(cache, page_slots)[page, offset] = records[:, layout.value_bytes :]


def quantize_indexer_keys(keys: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, page_slots: int,
                          fmt: str) -> None:
    """In place: the records of plain keys (float32 or bf16 ``[N, 128]``, no norm or RoPE) into ``slots``."""
    store_records(encode_indexer_keys(keys, fmt), INDEXER_LAYOUTS[fmt], cache, slots, page_slots)

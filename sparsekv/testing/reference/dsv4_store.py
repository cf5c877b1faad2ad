"""Torch reference of the fused norm + RoPE (+ Hadamard) + quantize + store (``csrc/dsv4_store.cuh``).

Float32 throughout, every step rounded in the kernel's order, so stored bytes compare bit for bit:

* ``x = bf16(x)``; sum of squares: 32 partial sums (partial ``l`` adds channels ``l, l + 32, ...`` in
  order), then an xor butterfly (offsets 16, 8, 4, 2, 1); ``inv = 1 / sqrt(sum / D + eps)`` with a
  correctly rounded float32 sqrt (:func:`sqrt_rn`, the kernel's ``sqrt_rn``: torch's ``sqrt`` is not)
  and a true division; ``y = bf16((x * inv) * weight)``.
* RoPE on the trailing 64 dims, interleaved pairs, by the same float32 cos/sin table the kernel
  reads (the model's); results rounded to bf16. :func:`rope_inv_freq` (float64, computed here
  independently) checks the table builder.
* Indexer: Walsh-Hadamard butterflies of stride 1 .. 64, then ``* float32(1/sqrt(128))``.
* Quantization: :mod:`sparsekv.testing.reference.dsv4_quant` (V4, FP4) and the FP8 indexer rule
  ``scale = max(amax, 1e-4) / 448`` (float32, not a power of two), ``e4m3(x / scale)``.

Every divisor is a tensor on the input's device: CUDA torch turns a division by a CPU scalar (a
Python float or a 0-dim CPU tensor) into a multiply by its rounded reciprocal, which is not the
kernel's division (power-of-two divisors excepted).
"""

from __future__ import annotations

import math

import torch

from sparsekv.kv_layout import INDEXER_FP4, INDEXER_FP8, V4
from sparsekv.testing.reference.dsv4_quant import INDEXER_FORMATS, encode_fp8_ds_mla, encode_indexer_keys, store_records

LAYOUTS = {"V4": V4, "INDEXER_FP8": INDEXER_FP8, "INDEXER_FP4": INDEXER_FP4}
#: Channels of the entry each cache kind stores (after RMSNorm and RoPE, before quantization).
ENTRY_DIMS = {"V4": 512, "INDEXER_FP8": 128, "INDEXER_FP4": 128}


def rope_inv_freq(theta: float, factor: float = 1.0, original_max_positions: int = 0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, rope_dims: int = 64) -> torch.Tensor:
    """float64 ``[rope_dims // 2]`` inverse frequencies, YaRN-blended when ``factor > 1`` (no mscale)."""
    freq = 1.0 / theta ** (torch.arange(0, rope_dims, 2, dtype=torch.float64) / rope_dims)
    if factor <= 1.0:
        return freq

    def corr(rotations):
        return rope_dims * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), rope_dims - 1)
    if high == low:
        high += 0.001
    ramp = ((torch.arange(rope_dims // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freq / factor * ramp + freq * (1 - ramp)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 ``a`` (IEEE ``sqrtf``, the kernel's ``sqrt_rn``).

    ``torch.sqrt`` is not correctly rounded everywhere: the CPU wheel's (MKL vector math) is one ulp
    off for about one float32 argument in six and one float64 argument in seventy. Its float64 root
    rounded to float32 is within one ulp of the answer; the neighbour is chosen exactly: the
    midpoints between float32 neighbours have at most 25 significant bits, so their float64
    squares are exact, and a root never lies on a midpoint.
    """
    a = a.to(torch.float32)
    root = torch.sqrt(a.to(torch.float64)).to(torch.float32)
    below = torch.nextafter(root, torch.zeros_like(root))
    above = torch.nextafter(root, torch.full_like(root, math.inf))
    low_mid = (root.to(torch.float64) + below.to(torch.float64)) / 2
    high_mid = (root.to(torch.float64) + above.to(torch.float64)) / 2
    a64 = a.to(torch.float64)
    return torch.where(low_mid * low_mid > a64, below, torch.where(high_mid * high_mid < a64, above, root))


def _team_sum(values: torch.Tensor) -> torch.Tensor:
    n, d = values.shape
    lanes = values.reshape(n, d // 32, 32)
    partial = torch.zeros(n, 32, dtype=torch.float32, device=values.device)
    for k in range(d // 32):
        partial = partial + lanes[:, k]
    lane = torch.arange(32, device=values.device)
    for offset in (16, 8, 4, 2, 1):
        partial = partial + partial[:, lane ^ offset]
    return partial[:, 0]


def normalize_rotate(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                     rope_cos: torch.Tensor, rope_sin: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """float32 ``[N, D]``: the values the kernel quantizes."""
    n, d = x.shape
    x = _bf16(x.to(torch.float32))
    ms = _team_sum(x * x) / torch.full((n,), float(d), dtype=torch.float32, device=x.device)
    root = sqrt_rn(ms + torch.full((n,), eps, dtype=torch.float32, device=x.device))
    inv = torch.ones_like(root) / root
    y = _bf16((x * inv[:, None]) * weight.to(torch.float32))
    rows = positions.to(rope_cos.device, torch.int64)
    cos, sin = rope_cos[rows].to(y.device), rope_sin[rows].to(y.device)
    even, odd = y[:, d - 64 :: 2], y[:, d - 63 :: 2]
    rotated = torch.stack([_bf16(even * cos - odd * sin), _bf16(even * sin + odd * cos)], dim=2).reshape(n, 64)
    y = torch.cat([y[:, : d - 64], rotated], dim=1)
    if hadamard:
        h = 1
        while h < d:
            blocks = y.reshape(n, d // (2 * h), 2, h)
            a, b = blocks[:, :, 0], blocks[:, :, 1]
            y = torch.stack([a + b, a - b], dim=2).reshape(n, d)
            h *= 2
        y = y * torch.tensor(1 / math.sqrt(128), dtype=torch.float32)
    return y


def norm_rope_store_reference(x, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin,
                              cache_kind="V4") -> None:
    """In place: the kernel's bytes for every entry into ``cache`` at ``slots`` (RoPE from the float32
    table ``rope_cos`` / ``rope_sin``, ``[max_position, 32]`` each)."""
    layout = LAYOUTS[cache_kind]
    z = normalize_rotate(x, weight, eps, positions, rope_cos, rope_sin, hadamard=cache_kind != "V4")
    records = encode_fp8_ds_mla(z) if cache_kind == "V4" else encode_indexer_keys(z, INDEXER_FORMATS[cache_kind])
    store_records(records, layout, cache, slots, page_slots)

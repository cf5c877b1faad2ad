"""DeepSeek-V4 compressed-attention kernels: one import point for the public functions.

Only re-exports; each function lives in its stem module (kernel header, wrapper, reference, test
and benchmark share the stem).
"""

from __future__ import annotations

# Compressors, streaming state, quantizer and fused norm + RoPE + store (issue 13).
from sparsekv.jit_kernel.dsv4_compress import CompressorState, compress_pool
from sparsekv.jit_kernel.dsv4_quant import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from sparsekv.jit_kernel.dsv4_store import RopeParams, StoreTarget, norm_rope_store

__all__ = [
    "CompressorState",
    "RopeParams",
    "StoreTarget",
    "compress_pool",
    "dequantize_fp8_ds_mla",
    "norm_rope_store",
    "quantize_fp8_ds_mla",
]

"""DeepSeek-V4 compressed-attention kernels: one import point for the public functions.

Only re-exports; each function lives in its stem module (kernel header, wrapper, reference, test
and benchmark share the stem).
"""

from __future__ import annotations

from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention
from sparsekv.jit_kernel.dsv4_compress import CompressorState, compress_decode_step, compress_pool
from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk, lightning_indexer, visible_entries
from sparsekv.jit_kernel.dsv4_quant import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from sparsekv.jit_kernel.dsv4_store import RopeParams, StoreTarget, norm_rope_store

__all__ = [
    "CompressorState",
    "RopeParams",
    "StoreTarget",
    "compress_decode_step",
    "compress_pool",
    "dequantize_fp8_ds_mla",
    "indexer_scores",
    "indexer_topk",
    "lightning_indexer",
    "norm_rope_store",
    "quantize_fp8_ds_mla",
    "sparse_decode_attention",
    "visible_entries",
]

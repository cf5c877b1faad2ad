"""DeepSeek-V4 compressed-attention kernels: one import point for the public functions.

Only re-exports; each function lives in its stem module (kernel header, wrapper, reference, test
and benchmark share the stem), whose docstring has the details. The maths in one place:

**Compressors** (:func:`compress_pool`, :func:`compress_decode_step`, and the streaming
``sparsekv.srt.mem_cache.CompressorState`` over the pool's state rings; ratio ``m`` = 4 or 128). Entry
``i`` pools, per channel ``c``, a softmax over its window's slots ``j`` of ``score + ape``::

    entry[i, c] = sum_j softmax_j(score[t_j, c'] + ape[j, c']) * kv[t_j, c']

C128: slot ``j`` = token ``128 i + j`` (``c' = c``). C4 uses two halves of ``2d`` channels: slots
0-3 are tokens ``4(i-1) .. 4i-1`` on the *first* ``d`` channels (none for ``i = 0``), slots 4-7 are
tokens ``4i .. 4i+3`` on the *last* ``d``; so each token feeds the second half of its own entry
and the first half of the next one. Entry ``i`` exists once token ``m i + m - 1`` has arrived;
its RoPE position is ``m i``.

**Store** (:func:`norm_rope_store`; fused with the compressor, ``dsv4_compress_store``, through
``CompressorState.extend(..., store=)`` and :func:`compress_decode_step`):
``y = RMSNorm(x) * weight``, RoPE (YaRN) on the last 64 dims at the entry's position, the indexer
kinds then rotated by the 128-point Walsh-Hadamard matrix over sqrt(128), then quantized into the
page: ``V4`` (584 B: dims 0-447 e4m3 with a power-of-two scale per 64, dims 448-511 bf16),
``INDEXER_FP8`` (132 B: 128 e4m3 + one fp32 scale ``max(amax, 1e-4) / 448``), ``INDEXER_FP4``
(68 B). :func:`quantize_fp8_ds_mla` / :func:`dequantize_fp8_ds_mla` do the ``V4`` step alone, and
:func:`quantize_indexer_keys` the indexer step alone (plain keys: no norm, RoPE or Hadamard).

**Indexer** (:func:`indexer_scores`, :func:`indexer_topk`, :func:`lightning_indexer`): a decode
query at raw position ``t`` sees C4 entries ``i < (t + 1) // 4`` (:func:`visible_entries`)::

    score[b, i] = sum_h w[b, h] * relu(q[b, h] . k_i)

and keeps the ``min(top_k, visible)`` highest, -1 after them (logical positions, and cache slots
through the page table).

**Sparse decode attention** (:func:`sparse_decode_attention`): MQA with key = value (``kv_j`` is
the dequantized 512-wide row of each selected slot, from one or two caches) and a per-head sink
that joins the softmax denominator only::

    l_j = softmax_scale * q[b, h] . kv_j
    out[b, h] = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink[h]))
    lse[b, h] = log sum_j exp(l_j)            (natural log, sink excluded)
"""

from __future__ import annotations

from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention
from sparsekv.jit_kernel.dsv4_compress import compress_pool
from sparsekv.jit_kernel.dsv4_compress_store import compress_decode_step
from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk, lightning_indexer, visible_entries
from sparsekv.jit_kernel.dsv4_quant import dequantize_fp8_ds_mla, quantize_fp8_ds_mla, quantize_indexer_keys
from sparsekv.jit_kernel.dsv4_store import StoreTarget, norm_rope_store
from sparsekv.rope import RopeParams, RopeTable

__all__ = [
    "RopeParams",
    "RopeTable",
    "StoreTarget",
    "compress_decode_step",
    "compress_pool",
    "dequantize_fp8_ds_mla",
    "indexer_scores",
    "indexer_topk",
    "lightning_indexer",
    "norm_rope_store",
    "quantize_fp8_ds_mla",
    "quantize_indexer_keys",
    "sparse_decode_attention",
    "visible_entries",
]

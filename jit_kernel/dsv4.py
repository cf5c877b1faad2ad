"""DSV4 compressed-attention kernels: one import for the public functions of the ``dsv4_*`` families.

This module only re-exports; each family's wrapper module holds the code and the documentation.
"""

# Sparse decode attention and the lightning indexer (families dsv4_attention, dsv4_indexer).
from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention
from sparsekv.jit_kernel.dsv4_indexer import indexer_scores, indexer_topk, lightning_indexer, visible_entries

__all__ = [
    "indexer_scores",
    "indexer_topk",
    "lightning_indexer",
    "sparse_decode_attention",
    "visible_entries",
]

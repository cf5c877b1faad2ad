"""DSV4 compressed-attention kernels: one import for the public functions of the ``dsv4_*`` families.

This module only re-exports; each family's wrapper module holds the code and the documentation.
"""

# Sparse decode attention and the lightning indexer (issue 14).
from sparsekv.jit_kernel.dsv4_attention import sparse_decode_attention

__all__ = [
    "sparse_decode_attention",
]

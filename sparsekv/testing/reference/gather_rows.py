"""Torch reference for ``gather_rows``."""

from __future__ import annotations

import torch


def gather_rows_reference(
    dst: torch.Tensor, dst_indices: torch.Tensor, src: torch.Tensor, src_indices: torch.Tensor
) -> torch.Tensor:
    """Return a copy of ``dst`` with ``dst[dst_indices[i]] = src[src_indices[i]]`` applied in order
    (for a repeated destination, the last write wins, as in a sequential loop)."""
    out = dst.clone()
    for d, s in zip(dst_indices.tolist(), src_indices.tolist()):
        out[d] = src[s]
    return out

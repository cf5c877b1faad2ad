"""The demo's model: a small DeepSeek-V4-shaped attention stack with seeded random weights.

What is DSV4-shaped: every layer keeps a sliding window of 128 raw tokens (SWA, 512-wide MQA KV
in the 584-byte ``fp8_ds_mla`` layout) and a per-head sink; C4 layers add a 4:1 compressor (two
overlapping halves per entry), a lightning indexer (its own 4:1 compressor of 128-wide keys, FP8,
Walsh-Hadamard rotated) and a top-k over the compressed entries; C128 layers add a 128:1
compressor whose every entry is attended. What is not modelled: the MLP, the residual stream and
the query's RoPE. Each layer reads a token's seeded hidden state through its own projections, so
the demo exercises the KV path (what sparsekv serves), not a language model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsekv.jit_kernel.dsv4 import RopeParams

HEAD_DIM = 512
INDEXER_DIM = 128
WINDOW = 128
EPS = 1e-6
#: DSV4 compressed layers' RoPE/YaRN; SWA-only layers use plain RoPE with theta 10000.
COMPRESSED_ROPE = RopeParams(160000, 16, 65536, 32, 1)
SWA_ROPE = RopeParams(10000)


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the demo model.

    Attributes
    ----------
    compress_ratios : tuple of int
        Per layer: 0 (sliding window only), 4 (C4) or 128 (C128).
    heads : int
        Query heads (MQA over one 512-wide KV head).
    indexer_heads : int
        Lightning-indexer heads (128 wide).
    hidden : int
        Width of the seeded hidden states the projections read.
    top_k : int
        C4 entries the indexer selects per query.
    """

    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)
    heads: int = 8
    indexer_heads: int = 4
    hidden: int = 256
    top_k: int = 64


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


class LayerWeights:
    """One layer's projections (float32), drawn from ``g`` in a fixed order."""

    def __init__(self, shape: ModelShape, ratio: int, g: torch.Generator):
        h = shape.hidden
        s = h**-0.5
        self.ratio = ratio
        self.rope = SWA_ROPE if ratio == 0 else COMPRESSED_ROPE
        self.wq = _randn(g, h, shape.heads * HEAD_DIM, scale=4 * s)
        self.w_kv = _randn(g, h, HEAD_DIM, scale=s)
        self.kv_norm = 1 + _randn(g, HEAD_DIM, scale=0.1)
        self.sink = _randn(g, shape.heads)
        if ratio:
            coff = 2 if ratio == 4 else 1
            self.w_ckv = _randn(g, h, coff * HEAD_DIM, scale=s)
            self.w_cscore = _randn(g, h, coff * HEAD_DIM, scale=s)
            self.ape = _randn(g, ratio, coff * HEAD_DIM, scale=0.5)
            self.c_norm = 1 + _randn(g, HEAD_DIM, scale=0.1)
        if ratio == 4:
            self.w_ikv = _randn(g, h, 2 * INDEXER_DIM, scale=s)
            self.w_iscore = _randn(g, h, 2 * INDEXER_DIM, scale=s)
            self.i_ape = _randn(g, 4, 2 * INDEXER_DIM, scale=0.5)
            self.i_norm = 1 + _randn(g, INDEXER_DIM, scale=0.1)
            self.w_iq = _randn(g, h, shape.indexer_heads * INDEXER_DIM, scale=s)
            self.w_iw = _randn(g, h, shape.indexer_heads, scale=s)


class DemoModel:
    """Seeded weights of every layer and the seeded hidden state of every (request, position).

    Parameters
    ----------
    shape : ModelShape
        The sizes.
    seed : int
        Everything (weights, hidden states) follows from it: two processes with the same seed
        build the same model.
    """

    def __init__(self, shape: ModelShape, seed: int = 0):
        self.shape = shape
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.layers = [LayerWeights(shape, ratio, g) for ratio in shape.compress_ratios]

    def hidden(self, request: int, start: int, end: int) -> torch.Tensor:
        """float32 ``[end - start, hidden]``: the hidden states of a request's positions ``start..end-1``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + request + 1)
        return torch.randn(end, self.shape.hidden, generator=g)[start:end]

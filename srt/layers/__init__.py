"""What an engine's model layers call: :class:`Dsv4AttentionBackend` (DSV4 attention over the pools,
HiSparse and the compressor state). Names resolve lazily from their modules."""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "Dsv4AttentionBackend": "dsv4_attention_backend",
    "Dsv4LayerParams": "dsv4_attention_backend",
    "ForwardBatch": "dsv4_attention_backend",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

"""Torch references of the kernels, one module per kernel stem: the oracles of the tests and the
baselines of the benchmarks.

``sparsekv.testing.reference.<stem>`` computes what its kernel's docstring specifies, in float64
(attention, indexer, compressor: compare with the tolerance the kernel documents) or bit for bit
in the kernel's own order (quantizer, store, copies: compare bytes)::

    from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
    ref_out, ref_lse = sparse_decode_attention_reference(q, kv_cache, indices, sink, page_slots)

They run on CPU tensors (inputs on another device are copied) and favour clarity over speed.
"""

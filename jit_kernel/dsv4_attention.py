"""DSV4 sparse decode attention with a sink over paged fp8_ds_mla caches (kernel in ``csrc/dsv4_attention.cuh``).

For batch row ``b`` and head ``h``, with ``J`` the valid entries of ``indices[b]`` (slots of
``kv_cache``) followed by those of ``extra_indices[b]`` (slots of ``extra_kv_cache``), ``kv_j`` the
dequantized 512-wide row of slot ``j`` (key = value) and ``l_j = softmax_scale * q[b, h] . kv_j``::

    out[b, h] = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink[h]))
    lse[b, h] = log sum_j exp(l_j)                 (natural log; the sink is excluded)

A slot listed twice counts twice; a row without a valid entry gives ``out = 0`` and ``lse = +inf``.
Equivalently ``out = softmax(l) @ kv * sigmoid(lse - sink)``. The caches are uint8 page rows of the
584-byte ``V4`` layout (:mod:`sparsekv.jit_kernel.kv_layout`): slot ``s`` is page ``s // page_size``,
offset ``s % page_size``; dims 0-447 are e4m3 times a UE8M0 scale per 64 dims, dims 448-511 bf16.

Split-KV: the list ``[indices[b] | extra_indices[b]]`` is cut into ``num_splits`` ranges whose
partial (lse, normalized output) pairs are merged by a combine pass; the cuda backend picks the
split from the grid size, the cpu backend runs one split unless told otherwise (tests pin it to
show that the combine equals the single pass).

Tolerance against the fp64 reference (:mod:`sparsekv.testing.reference.dsv4_attention`), which
dequantizes the same bytes (FP8 compared in value space, so the only difference is float32
arithmetic): ``|out - ref| <= 2e-4 + 2e-4 |ref|`` and ``|lse - ref| <= 2e-4 + 2e-4 |ref|`` for logits
of order 10 and values of order 1.

Example
-------
>>> out, lse = sparse_decode_attention(q, swa_cache, swa_indices, sink, 128,
...                                     extra_kv_cache=c4_cache, extra_indices=c4_topk, extra_page_size=64)
"""

from __future__ import annotations

import torch

from sparsekv import env
from sparsekv.jit_kernel.registry import KernelFamily, backend_of, check_choice, register

__all__ = ["ATTENTION", "HEAD_DIM", "attention_template_args", "sparse_decode_attention"]

HEAD_DIM = 512
_Q_TYPES = {torch.float32: "float", torch.bfloat16: "sparsekv::dsv4_attention::Bf16"}
# cuda: blocks of 8 heads (Partial::kHeadsPerBlock); split until the grid covers ~2 waves of an H100/H200.
_CUDA_HEADS_PER_BLOCK = 8
_CUDA_TARGET_BLOCKS = 264
_CUDA_MIN_SPLIT_LEN = 64

ATTENTION = register(
    KernelFamily(
        name="dsv4_attention",
        header="dsv4_attention.cuh",
        exports={"sparse_decode_attention": "sparsekv::dsv4_attention::sparse_decode_attention"},
        kernels=("sparsekv::dsv4_attention::Partial", "sparsekv::dsv4_attention::Combine"),
        params=("q_dtype",),
        complete=lambda *, q_dtype: (_Q_TYPES[check_choice("dsv4_attention", "q_dtype", q_dtype, _Q_TYPES)],),
        instances=tuple({"q_dtype": dtype} for dtype in _Q_TYPES),
    )
)


def attention_template_args(q_dtype: torch.dtype) -> tuple[str]:
    """The ``dsv4_attention`` template arguments for a query dtype.

    Raises
    ------
    TypeError
        ``q_dtype`` is neither float32 nor bfloat16 (the message names ``q``).
    """
    if q_dtype not in _Q_TYPES:
        raise TypeError(f"sparsekv: argument `q` must have dtype float32 or bfloat16, got {q_dtype}")
    return ATTENTION.template_args({"q_dtype": q_dtype})


def _default_splits(backend: str, batch: int, heads: int, entries: int) -> int:
    if backend != "cuda" or entries <= _CUDA_MIN_SPLIT_LEN:
        return 1
    blocks = max(1, batch * -(-heads // _CUDA_HEADS_PER_BLOCK))
    return max(1, min(-(-_CUDA_TARGET_BLOCKS // blocks), entries // _CUDA_MIN_SPLIT_LEN))


def _check_slots_on_device(indices: torch.Tensor, cache: torch.Tensor, page_size: int, name: str) -> None:
    # SPARSEKV_CHECK_INDICES=1 on the GPU: the full check costs a host sync, so it is opt-in there.
    bad = (indices < -1) | (indices >= cache.shape[0] * page_size)
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise IndexError(f"sparsekv: argument `{name}`[{b}, {j}] = {int(indices[b, j])} is neither -1 nor a slot "
                         f"of its cache [0, {cache.shape[0] * page_size})")


def sparse_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    page_size: int,
    *,
    softmax_scale: float = 512**-0.5,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_page_size: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA decode attention with a per-head sink over one or two paged V4 caches.

    Parameters
    ----------
    q : torch.Tensor
        float32 or bfloat16 ``[B, H, 512]``, unit last stride.
    kv_cache : torch.Tensor
        uint8 ``[pages, V4.page_bytes(page_size)]`` (584-byte fp8_ds_mla tokens), unit last stride.
    indices : torch.Tensor
        int32 ``[B, K]``, unit last stride: flat slots ``page * page_size + offset``, -1 = none.
    sink : torch.Tensor
        float32 ``[H]`` sink logits (a bf16 sink is rejected: reading fp32 sinks as bf16 is a known bug).
    page_size : int
        Slots per page of ``kv_cache``, a power of two.
    softmax_scale : float
        Logit scale, default ``512 ** -0.5``.
    extra_kv_cache, extra_indices : torch.Tensor, optional
        A second cache and its int32 ``[B, K2]`` slots (e.g. the C4 or C128 entries beside the SWA
        window), both or neither.
    extra_page_size : int, optional
        Slots per page of ``extra_kv_cache``; required exactly when it is given.
    num_splits : int, optional
        Split-KV ranges per row, in ``[1, max(1, K + K2)]``; default: the backend's choice (1 on cpu).

    Returns
    -------
    out : torch.Tensor
        float32 ``[B, H, 512]``, new.
    lse : torch.Tensor
        float32 ``[B, H]``, new; natural-log logsumexp of the logits without the sink, +inf for a row
        with no valid entry.

    Notes
    -----
    Allocates ``out``, ``lse`` and, with more than one split, the split workspace
    (``[B, splits, H, 512]`` + ``[B, splits, H]`` float32); never synchronizes (except with
    ``SPARSEKV_CHECK_INDICES=1`` on the GPU, which checks the indices on the device and reads back one flag).

    Raises
    ------
    TypeError
        Wrong dtype (the message names the argument), including a bf16 ``sink``.
    ValueError
        Wrong shape, stride or device; ``page_size`` not a power of two; ``extra_*`` given partly.
    IndexError
        An entry that is neither -1 nor a slot of its cache, when the indices are host-readable (cpu
        backend) or with ``SPARSEKV_CHECK_INDICES=1``; otherwise the kernel skips such entries.
    """
    attention_template_args(q.dtype)
    if sink.dtype != torch.float32:
        raise TypeError(f"sparsekv: argument `sink` must have dtype float32 (sink logits are fp32; reading them as "
                        f"bf16 corrupts heads), got {sink.dtype}")
    if q.dim() != 3:
        raise ValueError(f"sparsekv: argument `q` must be [B, H, {HEAD_DIM}], got shape {list(q.shape)}")
    backend = backend_of(q)
    batch, heads = q.shape[0], q.shape[1]
    entries = (indices.shape[-1] if indices.dim() == 2 else 0) + (
        extra_indices.shape[-1] if extra_indices is not None and extra_indices.dim() == 2 else 0)
    splits = _default_splits(backend, batch, heads, entries) if num_splits is None else num_splits
    if backend == "cuda" and env.check_indices():
        _check_slots_on_device(indices, kv_cache, page_size, "indices")
        if extra_indices is not None and extra_kv_cache is not None and extra_page_size is not None:
            _check_slots_on_device(extra_indices, extra_kv_cache, extra_page_size, "extra_indices")
    out = torch.empty((batch, heads, HEAD_DIM), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads), dtype=torch.float32, device=q.device)
    part_out = part_lse = None
    if isinstance(splits, int) and splits > 1:
        part_out = torch.empty((batch, splits, heads, HEAD_DIM), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, splits, heads), dtype=torch.float32, device=q.device)
    module = ATTENTION.module(q_dtype=q.dtype, backend=backend)
    module.sparse_decode_attention(q, kv_cache, indices, sink, page_size, float(softmax_scale), extra_kv_cache,
                                   extra_indices, -1 if extra_page_size is None else extra_page_size, out, lse,
                                   part_out, part_lse, splits)
    return out, lse


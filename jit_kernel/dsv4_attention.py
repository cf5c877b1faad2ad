"""DSV4 sparse decode attention with a sink over paged fp8_ds_mla caches (kernel in ``csrc/dsv4_attention.cuh``).

For batch row ``b`` and head ``h``, with ``J`` the valid entries of ``indices[b]`` (slots of
``kv_cache``; only the first ``topk_length[b]`` when given) followed by those of
``extra_indices[b]`` (slots of ``extra_kv_cache``), ``kv_j`` the dequantized 512-wide row of slot
``j`` (key = value) and ``l_j = softmax_scale * q[b, h] . kv_j``::

    out[b, h] = sum_j exp(l_j) kv_j / (sum_j exp(l_j) + exp(sink[h]))
    lse[b, h] = log sum_j exp(l_j)                 (natural log; the sink is excluded)

A slot listed twice counts twice; a row without a valid entry gives ``out = 0`` and ``lse = +inf``.
Equivalently ``out = softmax(l) @ kv * sigmoid(lse - sink)``. The caches are uint8 page rows of the
584-byte ``V4`` layout (:mod:`sparsekv.kv_layout`): slot ``s`` is page ``s // page_slots``,
offset ``s % page_slots``; dims 0-447 are e4m3 times a UE8M0 scale per 64 dims, dims 448-511 bf16.

Split-KV: the list ``[indices[b] | extra_indices[b]]`` is cut into ``num_splits`` ranges whose
partial (lse, normalized output) pairs are merged by a combine pass; the cuda backend picks the
split from the grid size, the cpu backend runs one split unless told otherwise (tests pin it to
show that the combine equals the single pass).

Tolerance against the fp64 reference (:mod:`sparsekv.testing.reference.dsv4_attention`), which
dequantizes the same bytes (FP8 compared in value space, so the only difference is float32
arithmetic): ``|out - ref| <= 2e-4 + 2e-4 |ref|`` and ``|lse - ref| <= 2e-4 + 2e-4 |ref|`` for logits
of order 10 and values of order 1. The header's GPU kernel (cuda, and sim) runs both products on
tensor cores with bf16 operands and float32 accumulation: the rows are exact in bf16, a float32
query goes in as three bf16 terms and the probabilities as two, which keeps it within the same
tolerance.

Example
-------
>>> out, lse = sparse_decode_attention(q, swa_cache, swa_indices, sink, 128,
...                                     extra_kv_cache=c4_cache, extra_indices=c4_topk, extra_page_slots=64)
"""

from __future__ import annotations

import math

import torch

from sparsekv.checks import as_float, as_int, one_of
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.flashmla import dsv4_attention as flashmla
from sparsekv.jit_kernel.torch_op import (
    CheckMemo,
    first_true,
    index_checks_on_device,
    kernel_op,
    metadata_key,
    rows_of,
    runs_bodies,
)
from sparsekv.jit_kernel.triton import resolve_impl
from sparsekv.jit_kernel.triton.checks import (
    check,
    check_disjoint,
    optional_arg,
    page_shift,
    read,
    row_stride,
    written,
)
from sparsekv.kv_layout import V4

__all__ = ["ATTENTION", "HEAD_DIM", "IMPLS", "attention_impl", "attention_template_args", "check_attention_arguments",
           "reads_values", "sparse_decode_attention", "workspace_floats"]

HEAD_DIM = 512
_Q_TYPES = {torch.float32: "float", torch.bfloat16: "sparsekv::Bf16"}
# cuda: CTAs of 64 heads (Partial::kHeads), one per SM (its registers and shared memory), working in
# tiles of 32 rows (Partial::kRows): split until the CTAs fill one wave of an H100/H200's 132 SMs,
# never below half a tile per split. The kernel then takes 32 or 16 heads per CTA while its CTAs
# still fit the wave (Partial::run_on_cuda): at batch 1, top-k 512, 32 splits x 4 groups of 16 heads
# = 128 CTAs, each with a quarter of the products of a 64-head tile.
_CUDA_HEADS_PER_BLOCK = 64
_CUDA_TARGET_BLOCKS = 132
_CUDA_MIN_SPLIT_LEN = 16

ATTENTION = register(
    KernelFamily(
        name="dsv4_attention",
        header="dsv4_attention.cuh",
        exports={"sparse_decode_attention": "sparsekv::dsv4_attention::sparse_decode_attention"},
        kernels=("sparsekv::dsv4_attention::Partial", "sparsekv::dsv4_attention::Combine"),
        params=("q_dtype",),
        complete=lambda *, q_dtype: (_Q_TYPES[one_of(q_dtype, "q_dtype", _Q_TYPES, owner="dsv4_attention")],),
        instances=tuple({"q_dtype": dtype} for dtype in _Q_TYPES),
    )
)


#: The values of ``impl=``: the kernels' common ones and FlashMLA's (:mod:`.flashmla.dsv4_attention`).
IMPLS = ("auto", "header", "triton", "flashmla")


def attention_impl(impl: str, q: torch.Tensor, indices: torch.Tensor, extra_indices: torch.Tensor | None) -> str:
    """The implementation a call runs: ``"header"``, ``"triton"`` or ``"flashmla"``.

    ``"auto"`` is FlashMLA where it runs (a CUDA tensor on an sm_90 or sm_100 GPU, the ``flash_mla``
    package importable) and fits the call (bfloat16 ``q`` with 64 or 128 heads, top-k lists in whole
    blocks of 64); otherwise the header (:func:`sparsekv.jit_kernel.triton.resolve_impl`).

    Raises
    ------
    ValueError
        ``impl`` is not one of :data:`IMPLS`; ``"flashmla"`` where FlashMLA cannot run (the one-line
        reason); ``"triton"`` where Triton cannot run.
    """
    if impl == "header":  # runs on every device
        return impl
    if impl == "flashmla":
        reason = flashmla.unavailable_reason(q.device)
        if reason is not None:
            raise ValueError(f"sparsekv: argument `impl` is 'flashmla', but {reason}")
        return impl
    if impl == "auto" and isinstance(q, torch.Tensor):
        device = q.device  # built once: ~0.1 us a call of the decode path
        if flashmla.unavailable_reason(device) is None and isinstance(indices, torch.Tensor) \
                and flashmla.misfit_reason(q, indices, extra_indices) is None:
            return "flashmla"
        return resolve_impl(impl, device)
    if impl not in IMPLS:
        raise ValueError(f"sparsekv: argument `impl` must be one of {list(IMPLS)}, got {impl!r}")
    return resolve_impl(impl, q.device)


def attention_template_args(q_dtype: torch.dtype) -> tuple[str]:
    """The ``dsv4_attention`` template arguments for a query dtype.

    Raises
    ------
    TypeError
        ``q_dtype`` is neither float32 nor bfloat16 (the message names ``q``).
    """
    _check_q_dtype(q_dtype)
    return ATTENTION.template_args({"q_dtype": q_dtype})


def _check_q_dtype(q_dtype: torch.dtype) -> None:
    if q_dtype not in _Q_TYPES:
        raise TypeError(f"sparsekv: argument `q` must have dtype float32 or bfloat16, got {q_dtype}")


def _default_splits(on_cuda: bool, batch: int, heads: int, entries: int) -> int:
    if not on_cuda or entries <= _CUDA_MIN_SPLIT_LEN:
        return 1
    blocks = max(1, batch * -(-heads // _CUDA_HEADS_PER_BLOCK))
    return max(1, min(_CUDA_TARGET_BLOCKS // blocks, entries // _CUDA_MIN_SPLIT_LEN))


def _entries(indices: torch.Tensor, extra_indices: torch.Tensor | None) -> int:
    """Entries per row of ``[indices | extra_indices]`` (0 for a wrong-rank table: the C++ entry names it)."""
    return rows_of(indices, 2, 1) + (0 if extra_indices is None else rows_of(extra_indices, 2, 1))


def reads_values(q: torch.Tensor, impl: str) -> bool:
    """Whether the input contract (:func:`check_attention_arguments`) reads the values of the index tables
    (slots, ``topk_length``) for a call of ``impl``: on the GPU only with ``SPARSEKV_CHECK_INDICES=1`` (a
    host sync); on host tables for the Triton twin (the interpreter). Host tables of the header are read
    by its C++ entry, with the same messages and without allocating, so the contract leaves them to it.
    Otherwise the checks stay O(1) and never read the device: the kernels skip a slot outside its cache
    and clamp ``topk_length`` to ``[0, K]``."""
    return index_checks_on_device(q) or (q.is_cpu and impl != "header")


def _check_slots(indices: torch.Tensor, num_slots: int, name: str) -> None:
    bad = first_true((indices < -1) | (indices >= num_slots))
    if bad is not None:
        b, j = bad
        raise IndexError(f"sparsekv: argument `{name}`[{b}, {j}] = {int(indices[b, j])} is neither -1 nor a slot "
                         f"of its cache [0, {num_slots})")


def _check_topk_length(topk_length: torch.Tensor, q: torch.Tensor, width: int, *, values: bool) -> None:
    if topk_length.dtype != torch.int32:
        raise TypeError(f"sparsekv: argument `topk_length` must have dtype int32, got {topk_length.dtype}")
    if topk_length.dim() != 1 or topk_length.shape[0] != q.shape[0] or not topk_length.is_contiguous():
        raise ValueError(f"sparsekv: argument `topk_length` must be contiguous [B={q.shape[0]}], got shape "
                         f"{list(topk_length.shape)}")
    if topk_length.device != q.device:
        raise ValueError(f"sparsekv: argument `topk_length` must be on {q.device} (with `q`), got {topk_length.device}")
    if values:
        _check_topk_length_values(topk_length, width)


def _check_topk_length_values(topk_length: torch.Tensor, width: int) -> None:
    if first_true((topk_length < 0) | (topk_length > width)) is not None:
        raise ValueError(f"sparsekv: argument `topk_length` must be in [0, K={width}], got {topk_length.tolist()}")


def _source(cache: torch.Tensor, cache_name: str, indices: torch.Tensor, indices_name: str, page_slots: int,
            page_slots_name: str, batch: int, q: torch.Tensor, read_values: bool) -> tuple:
    """One cache and its slot table, checked as the header's ``make_source``; the Triton kernel's
    arguments of it: ``(cache, page_stride, page_shift, num_slots, indices, index_stride, count)``."""
    shift = page_shift(page_slots, page_slots_name)
    check(cache, cache_name).dtype(torch.uint8).ndim(2).rows_dense().same_device(q, "q")
    check(cache, cache_name).size(1, V4.page_bytes(page_slots), "page_bytes(page_slots) of the 584 B V4 layout")
    check(indices, indices_name).dtype(torch.int32).ndim(2).rows_dense().same_device(q, "q")
    check(indices, indices_name).size(0, batch, "batch of q")
    num_slots = cache.shape[0] * page_slots
    if num_slots > 2**31 - 1:
        raise ValueError(f"sparsekv: argument `{cache_name}` holds {num_slots} slots, more than int32 indices can name")
    if read_values:
        _check_slots(indices, num_slots, indices_name)
    return cache, row_stride(cache), shift, num_slots, indices, indices.stride(0), indices.shape[1]


def check_attention_arguments(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                              page_slots: int, softmax_scale: float, extra_kv_cache: torch.Tensor | None,
                              extra_indices: torch.Tensor | None, extra_page_slots: int, num_splits: int,
                              out: torch.Tensor, lse: torch.Tensor, workspace: torch.Tensor | None,
                              topk_length: torch.Tensor | None, *, impl: str,
                              read_values: bool) -> tuple[tuple, tuple | None, int]:
    """The input contract of sparse decode attention, which the op runs before the Triton twin and FlashMLA
    run; the header's C++ entry runs the same checks itself, so a header call runs this only where the
    entry does not see the call's own arguments (a bfloat16 ``out`` of one split, written from the
    entry's float32 staging) or where the tables' values are read on the device with torch.

    The checks and their words are the header entry's (``sparse_decode_attention`` in
    ``csrc/dsv4_attention.cuh``), after those of the op's own arguments (``workspace``,
    ``topk_length``). Without ``read_values`` they are
    O(1) in the tables' sizes and read nothing from the device; with it (see :func:`reads_values`) every
    slot and ``topk_length`` value is checked too.

    Parameters
    ----------
    q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache, extra_indices, num_splits, out, lse, \
workspace, topk_length
        As :func:`sparse_decode_attention` takes them (``softmax_scale`` a float, ``num_splits`` an int).
    extra_page_slots : int
        -1 without an extra cache (the header entry's convention).
    impl : {"header", "triton", "flashmla"}
        FlashMLA takes no workspace.
    read_values : bool
        Whether to read the index tables' values.

    Returns
    -------
    main, extra, split_len
        The Triton kernel's arguments of each cache (``extra`` None without one) and the entries per split.

    Raises
    ------
    TypeError, ValueError, IndexError
        As :func:`sparse_decode_attention` documents, naming the argument, before anything is written.
    """
    key = metadata_key(q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache, extra_indices,
                       extra_page_slots, num_splits, out, lse, workspace, topk_length, impl)
    derived = _CONTRACT_MEMO.get(key)
    if derived is None:  # the full contract, in its order; the O(1) part of a passing call is remembered
        main, extra, split_len = _check_contract(q, kv_cache, indices, sink, page_slots, softmax_scale,
                                                 extra_kv_cache, extra_indices, extra_page_slots, num_splits, out,
                                                 lse, workspace, topk_length, impl, read_values)
        _CONTRACT_MEMO.put(key, (main[1:4] + main[5:], extra and extra[1:4] + extra[5:], split_len))
        return main, extra, split_len
    # The same metadata passed before: only the values can fail now, checked in the contract's order.
    main_sizes, extra_sizes, split_len = derived
    if read_values:
        if topk_length is not None:
            _check_topk_length_values(topk_length, indices.shape[1])
        _check_slots(indices, main_sizes[2], "indices")
        if extra_sizes is not None:
            _check_slots(extra_indices, extra_sizes[2], "extra_indices")
        if impl == "triton":
            _check_arrivals_zero(_workspace_views(workspace, out, q.shape[0], q.shape[1], num_splits, impl)[3])
    main = (kv_cache, *main_sizes[:3], indices, *main_sizes[3:])
    extra = None if extra_sizes is None else (extra_kv_cache, *extra_sizes[:3], extra_indices, *extra_sizes[3:])
    return main, extra, split_len


#: The metadata keys of the calls that passed the O(1) contract, with its sizes: a repeated decode call
#: with the same buffers costs one key and one lookup instead of ~40 checks (issue 36 item 2).
_CONTRACT_MEMO = CheckMemo()


def _check_contract(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                    page_slots: int, softmax_scale: float, extra_kv_cache: torch.Tensor | None,
                    extra_indices: torch.Tensor | None, extra_page_slots: int, num_splits: int, out: torch.Tensor,
                    lse: torch.Tensor, workspace: torch.Tensor | None, topk_length: torch.Tensor | None, impl: str,
                    read_values: bool) -> tuple[tuple, tuple | None, int]:
    """:func:`check_attention_arguments` in full, every check in the header entry's order."""
    _check_q_dtype(q.dtype)
    if sink.dtype != torch.float32:
        raise TypeError(f"sparsekv: argument `sink` must have dtype float32 (sink logits are fp32; reading them as "
                        f"bf16 corrupts heads), got {sink.dtype}")
    if q.dim() != 3:
        raise ValueError(f"sparsekv: argument `q` must be [B, H, {HEAD_DIM}], got shape {list(q.shape)}")
    if out.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"sparsekv: argument `out` must have dtype float32 or bfloat16 (`out_dtype`), got {out.dtype}")
    batch, heads = q.shape[0], q.shape[1]
    _check_splits_and_workspace(q, indices, extra_indices, num_splits, out, workspace, impl)
    if topk_length is not None:
        _check_topk_length(topk_length, q, rows_of(indices, 2, 1), values=read_values)
    _, part_out, part_lse, part_arrivals = _workspace_views(workspace, out, batch, heads, num_splits, impl)
    # The header entry's checks, in its order.
    check_disjoint(read(q, "q"), read(kv_cache, "kv_cache"), read(indices, "indices"), read(sink, "sink"),
                   read(optional_arg(extra_kv_cache, "extra_kv_cache"), "extra_kv_cache"),
                   read(optional_arg(extra_indices, "extra_indices"), "extra_indices"),
                   read(optional_arg(topk_length, "topk_length"), "topk_length"), written(out, "out"),
                   written(lse, "lse"), written(optional_arg(part_out, "part_out"), "part_out"),
                   written(optional_arg(part_lse, "part_lse"), "part_lse"),
                   written(optional_arg(part_arrivals, "part_arrivals"), "part_arrivals"))
    check(q, "q").dtype(torch.float32 if q.dtype == torch.float32 else torch.bfloat16).ndim(3).rows_dense()
    check(q, "q").size(2, HEAD_DIM, "head dim")
    check(sink, "sink").dtype(torch.float32).ndim(1).contiguous().same_device(q, "q")
    check(sink, "sink").size(0, heads, "heads of q")
    check(out, "out").ndim(3).contiguous().same_device(q, "q")
    check(out, "out").size(0, batch, "batch").size(1, heads, "heads").size(2, HEAD_DIM, "head dim")
    check(lse, "lse").dtype(torch.float32).ndim(2).contiguous().same_device(q, "q")
    check(lse, "lse").size(0, batch, "batch").size(1, heads, "heads")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"sparsekv: argument `softmax_scale` must be finite, got {softmax_scale}")
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("sparsekv: arguments `extra_kv_cache` and `extra_indices` go together: pass both or neither")
    if (extra_kv_cache is None) != (extra_page_slots < 0):
        raise ValueError("sparsekv: argument `extra_page_slots` is required exactly when `extra_kv_cache` is given")
    main = _source(kv_cache, "kv_cache", indices, "indices", page_slots, "page_slots", batch, q, read_values)
    extra = None
    if extra_kv_cache is not None:
        extra = _source(extra_kv_cache, "extra_kv_cache", extra_indices, "extra_indices", extra_page_slots,
                        "extra_page_slots", batch, q, read_values)
    total = main[-1] + (extra[-1] if extra is not None else 0)
    if not 1 <= num_splits <= max(1, total):
        raise ValueError(f"sparsekv: argument `num_splits` must be in [1, max(1, K + K2) = {max(1, total)}], "
                         f"got {num_splits}")
    if read_values and impl == "triton":  # the header's entry checks its own
        _check_arrivals_zero(part_arrivals)
    return main, extra, -(-total // num_splits)


def _check_arrivals_zero(part_arrivals: torch.Tensor | None) -> None:
    """The arrival counters of a split call (None for one split) are zero, as every call leaves them."""
    if part_arrivals is None:
        return
    nonzero = part_arrivals.flatten().nonzero()
    if len(nonzero):
        i = int(nonzero[0])
        raise ValueError(f"sparsekv: argument `part_arrivals` must be all zero before a call (a zeroed workspace "
                         f"stays zero: every call resets it), got {int(part_arrivals.flatten()[i])} at flat index {i}")


def _check_splits_and_workspace(q: torch.Tensor, indices: torch.Tensor, extra_indices: torch.Tensor | None,
                                num_splits: int, out: torch.Tensor, workspace: torch.Tensor | None, impl: str) -> None:
    """The split count, in range before any workspace is sized for it, then the workspace it needs."""
    most = max(1, _entries(indices, extra_indices))
    if not 1 <= num_splits <= most:
        raise ValueError(f"sparsekv: argument `num_splits` must be in [1, max(1, K + K2) = {most}], got {num_splits}")
    floats = 0 if impl == "flashmla" else workspace_floats(rows_of(q, 3, 0), rows_of(q, 3, 1), num_splits, out.dtype)
    if floats and (workspace is None or workspace.dtype != torch.float32 or workspace.dim() != 1
                   or not workspace.is_contiguous() or workspace.numel() < floats or workspace.device != q.device):
        got = "None" if workspace is None else f"{workspace.dtype} {list(workspace.shape)} on {workspace.device}"
        raise ValueError(f"sparsekv: argument `workspace` must be a contiguous 1-D float32 tensor on {q.device} with "
                         f"at least {floats} elements (workspace_floats), got {got}")


def _split_views(q: torch.Tensor, indices: torch.Tensor, extra_indices: torch.Tensor | None, num_splits: int,
                 out: torch.Tensor, workspace: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(part_out, part_lse, part_arrivals)`` of :func:`_workspace_views` for a header call of ``num_splits``
    other than 1, after :func:`_check_splits_and_workspace`: both from a memo of the calls that passed
    (the checks and three views cost ~3 us a decode call).

    The memo keeps the workspace tensor itself with its views, so its key names the workspace by
    identity (``id``: no other tensor gets that id while the entry holds it) and by what an
    in-place change can alter in that object: its address, length and strides (``resize_``,
    ``set_``, ``as_strided_``, ``.data``; not a ``.data`` retyped at the same address, length and
    strides); then all the checks read of the call (q's device and shape, the index tables'
    shapes, out's dtype, the split count). Not its version counter: a call through the op's
    dispatcher (a compiled graph without CUDA graphs) bumps it, and a miss there costs ~40 us (the
    views made under the dispatcher). A hit costs ~1.1 us where a key by the workspace's full
    metadata (shape, strides, dtype, device) cost ~1.3 us. A view kept in the memo keeps its memory
    alive, so a workspace at the same address is that memory."""
    key = None
    if type(workspace) is torch.Tensor:
        key = (id(workspace), workspace.data_ptr(), workspace.numel(), workspace.stride(), q.device, q.shape,
               indices.shape, None if extra_indices is None else extra_indices.shape, out.dtype, num_splits)
        kept = _SPLIT_VIEWS.get(key)
        if kept is not None:
            return kept[1]
    _check_splits_and_workspace(q, indices, extra_indices, num_splits, out, workspace, "header")
    views = _workspace_views(workspace, out, q.shape[0], q.shape[1], num_splits, "header")[1:]
    if key is not None:
        if len(_SPLIT_VIEWS) >= _SPLIT_VIEWS_KEPT:  # a decode loop reuses one or two workspaces
            _SPLIT_VIEWS.clear()
        _SPLIT_VIEWS[key] = (workspace, views)
    return views


_SPLIT_VIEWS: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
_SPLIT_VIEWS_KEPT = 8


def _workspace_views(workspace: torch.Tensor | None, out: torch.Tensor, batch: int, heads: int, num_splits: int,
                     impl: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(staged, part_out, part_lse, part_arrivals)``: where the header writes its output (``out`` itself,
    but for a bf16 ``out`` with one split a float32 ``[B, H, 512]`` of the workspace, which the Triton
    twin does not use: split, the header's combine writes bf16 itself), the split partials that follow it
    and the header's int32 arrival counters ``[B, ceil(H / 16), 2]`` (None for one split).

    The counters sit in the workspace's first :func:`_reserved_floats` elements, a prefix that depends
    only on the workspace's length and that nothing else ever writes: calls of any shape that share a
    workspace find them where the last call left them, zero."""
    if impl == "flashmla":  # no workspace: FlashMLA plans its own splits
        return out, None, None, None
    staged, used = out, 0 if workspace is None else _reserved_floats(workspace.numel())
    if out.dtype == torch.bfloat16:  # the layout workspace_floats sizes, whichever implementation runs
        if impl == "header" and num_splits == 1:
            staged = workspace[used:used + batch * heads * HEAD_DIM].view(batch, heads, HEAD_DIM)
        used += batch * heads * HEAD_DIM
    part_out = part_lse = part_arrivals = None
    if num_splits > 1:
        part_out = workspace[used:used + batch * num_splits * heads * HEAD_DIM].view(batch, num_splits, heads, HEAD_DIM)
        used += part_out.numel()
        part_lse = workspace[used:used + batch * num_splits * heads].view(batch, num_splits, heads)
        groups = _arrival_groups(heads)
        part_arrivals = workspace[:batch * groups * 2].view(torch.int32).view(batch, groups, 2)
    return staged, part_out, part_lse, part_arrivals


def _arrival_groups(heads: int) -> int:
    """Arrival counters per batch row: one per 16 heads (``arrival_groups`` in the header)."""
    return -(-heads // 16)


def _reserved_floats(workspace_numel: int) -> int:
    """The counters' prefix of a workspace: 1 element per 512. A split call's partials take at least
    2 x 513 floats per (row, head), so the prefix of any workspace long enough for the call holds its
    ``B x ceil(H / 16) x 2`` counters."""
    return -(-workspace_numel // 512)


def workspace_floats(batch: int, heads: int, num_splits: int, out_dtype: torch.dtype = torch.float32) -> int:
    """float32 elements of the workspace one :func:`sparse_decode_attention` call needs.

    The split-KV partials ``[B, splits, H, 512]`` + ``[B, splits, H]`` when ``num_splits > 1``, and a
    float32 ``[B, H, 512]`` staging of the output when ``out_dtype`` is bfloat16 (the kernel
    accumulates in float32; with one split the header finishes there and the op rounds to bf16,
    round-to-nearest-even; split, its combine rounds the same way and writes ``out`` directly); and
    before them a prefix of ``ceil(n / 512)`` elements of a workspace of ``n`` that holds the
    header's int32 arrival counters (``[B, ceil(H / 16), 2]`` when split). The prefix must be zero
    before the first call: every call leaves it zero, so zero a workspace once (``torch.zeros``) and
    pass it whole to every call that shares it.
    """
    partials = batch * num_splits * heads * (HEAD_DIM + 1) if num_splits > 1 else 0
    data = partials + (batch * heads * HEAD_DIM if out_dtype == torch.bfloat16 else 0)
    if data == 0:
        return 0
    floats = data + -(-data // 511)  # the least n with n - ceil(n / 512) >= data, or one more
    return floats - 1 if floats - 1 - _reserved_floats(floats - 1) >= data else floats


# One workspace per device, shared by the calls that pass none; replaced only by a larger one. Zeroed
# once: the arrival counters must start at zero, and every call leaves them so.
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def _cached_workspace(device: torch.device, floats: int) -> torch.Tensor:
    buffer = _WORKSPACES.get(device)
    if buffer is None or buffer.numel() < floats:
        buffer = torch.zeros(floats, dtype=torch.float32, device=device)
        _WORKSPACES[device] = buffer
    return buffer


@renamed_keywords(page_size="page_slots", extra_page_size="extra_page_slots")
def sparse_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor,
    page_slots: int,
    *,
    softmax_scale: float = 512**-0.5,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_page_slots: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    workspace: torch.Tensor | None = None,
    impl: str = "auto",
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA decode attention with a per-head sink over one or two paged V4 caches.

    Parameters
    ----------
    q : torch.Tensor
        float32 or bfloat16 ``[B, H, 512]``, unit last stride.
    kv_cache : torch.Tensor
        uint8 ``[pages, V4.page_bytes(page_slots)]`` (584-byte fp8_ds_mla tokens), unit last stride.
    indices : torch.Tensor
        int32 ``[B, K]``, unit last stride: flat slots ``page * page_slots + offset``, -1 = none.
    sink : torch.Tensor
        float32 ``[H]`` sink logits. A bfloat16 sink is rejected rather than converted: a caller
        that keeps its sinks in bf16 has usually lost precision already, and a silent cast would hide it.
    page_slots : int
        Slots per page of ``kv_cache``, a power of two.
    softmax_scale : float
        Logit scale, default ``512 ** -0.5``.
    extra_kv_cache, extra_indices : torch.Tensor, optional
        A second cache and its int32 ``[B, K2]`` slots (e.g. the C4 or C128 entries beside the SWA
        window), both or neither.
    extra_page_slots : int, optional
        Slots per page of ``extra_kv_cache``; required exactly when it is given.
    num_splits : int, optional
        Split-KV ranges per row, in ``[1, max(1, K + K2)]``; default: the backend's choice (1 on cpu).
    out : torch.Tensor, optional
        ``[B, H, 512]`` of dtype ``out_dtype``, contiguous, to write (default: a new tensor).
    lse : torch.Tensor, optional
        float32 ``[B, H]``, contiguous, to write (default: a new tensor).
    out_dtype : torch.dtype
        ``torch.float32`` (default) or ``torch.bfloat16``: the dtype of ``out``.
    workspace : torch.Tensor, optional
        float32, contiguous, 1-D, at least :func:`workspace_floats` elements (the split-KV partials, their
        arrival counters and the bf16 output's float32 staging), zeroed before its first use (the
        counters must start at zero; every call, refused or not, leaves them zero). Default: one
        zeroed buffer per device kept by this module and replaced only when a call needs more (calls
        on one device share it: concurrent calls on different streams, and CUDA graphs, pass their own).
    impl : {"auto", "header", "triton", "flashmla"}
        ``"header"``: the kernel of ``csrc/dsv4_attention.cuh`` on the cpu or cuda backend by device;
        ``"triton"``: the tensor-core twin (:mod:`sparsekv.jit_kernel.triton.dsv4_attention`), on a GPU
        or, on CPU tensors, under ``TRITON_INTERPRET=1``; ``"flashmla"``: FlashMLA's kernel through
        the ``flash_mla`` package (:mod:`sparsekv.jit_kernel.flashmla.dsv4_attention`: sm_90 / sm_100,
        bf16 ``q``, 64 or 128 heads, lists in blocks of 64, bf16-rounded ``out``; it allocates its
        outputs); ``"auto"``: FlashMLA where it runs and fits the call (:func:`attention_impl`), else
        the header (on the H200 the header took 372 us and the twin 853 us at batch 1, top-k 512:
        docs/sim-and-triton.md). Same arguments, same custom op, same refusals; results within the tolerance
        each implementation documents.
    topk_length : torch.Tensor, optional
        int32 ``[B]``, contiguous, on ``q``'s device (FlashMLA's argument of that name): only the
        first ``topk_length[b]`` entries of ``indices[b]`` are candidates, so a row with fewer valid
        entries need not pad with -1 (``extra_indices`` is not affected). Values in ``[0, K]``:
        checked when host-readable (cpu backend) or with ``SPARSEKV_CHECK_INDICES=1``, clamped by the
        kernel otherwise.

    Returns
    -------
    out : torch.Tensor
        ``[B, H, 512]`` of ``out_dtype`` (``out`` when given).
    lse : torch.Tensor
        float32 ``[B, H]`` (``lse`` when given); natural-log logsumexp of the logits without the
        sink, +inf for a row with no valid entry. A NaN in ``q[b, h]`` (or in a row it selects)
        gives NaN in ``out[b, h]`` and ``lse[b, h]``, never a value that reads like an empty row.

    Notes
    -----
    Given ``out``, ``lse`` and a large-enough ``workspace`` (or none needed: one split and float32
    output), a call allocates nothing and never synchronizes (except with ``SPARSEKV_CHECK_INDICES=1``
    on the GPU, which checks the indices on the device and reads back one flag), so it can be
    captured in a CUDA graph. The call is the custom op ``torch.ops.sparsekv.sparse_decode_attention``.

    Raises
    ------
    TypeError
        Wrong dtype (the message names the argument), including a bf16 ``sink``; a scalar of the
        wrong type (``page_slots`` 64.0, ``softmax_scale`` '0.1', ``num_splits`` True).
    ValueError
        Wrong shape, stride or device; ``page_slots`` not a power of two in ``[1, 2^20]``; ``extra_*``
        given partly; ``num_splits`` out of range (before anything is allocated); a ``workspace``
        smaller than :func:`workspace_floats`; an output sharing memory with another argument.
    IndexError
        An entry that is neither -1 nor a slot of its cache, when the indices are host-readable (cpu
        backend) or with ``SPARSEKV_CHECK_INDICES=1``; otherwise the kernel skips such entries.
    """
    impl = attention_impl(impl, q, indices, extra_indices)
    page_slots = as_int(page_slots, "page_slots")
    softmax_scale = as_float(softmax_scale, "softmax_scale")
    extra_page_slots = -1 if extra_page_slots is None else as_int(extra_page_slots, "extra_page_slots")
    if num_splits is not None:
        num_splits = as_int(num_splits, "num_splits")
    on_cpu = impl == "header" and not q.is_cuda  # one split, by the cpu backend's choice
    if num_splits is not None:
        splits = num_splits
    elif impl == "flashmla" or on_cpu:  # FlashMLA plans its own splits
        splits = 1
    elif impl == "triton":
        from sparsekv.jit_kernel.triton.dsv4_attention import default_splits

        splits = default_splits(q.device, rows_of(q, 3, 0), rows_of(q, 3, 1), _entries(indices, extra_indices))
    else:
        splits = _default_splits(isinstance(q, torch.Tensor) and q.is_cuda, rows_of(q, 3, 0), rows_of(q, 3, 1),
                                 _entries(indices, extra_indices))
    splits = splits if type(splits) is int else -1  # noqa: E721 - the op body names a bad count
    if out is None:
        out = torch.empty((rows_of(q, 3, 0), rows_of(q, 3, 1), HEAD_DIM), dtype=out_dtype, device=q.device)
    elif isinstance(out, torch.Tensor) and out.dtype != out_dtype:  # the dtype asked for is the one written
        raise TypeError(f"sparsekv: argument `out` has dtype {out.dtype}, but `out_dtype` is {out_dtype}")
    if lse is None:
        lse = torch.empty((rows_of(q, 3, 0), rows_of(q, 3, 1)), dtype=torch.float32, device=q.device)
    # One split into a float32 `out` (the decode step on the cpu backend) needs no workspace.
    if workspace is None and impl != "flashmla" and (splits != 1 or out_dtype != torch.float32) \
            and 1 <= splits <= max(1, _entries(indices, extra_indices)):
        floats = workspace_floats(rows_of(q, 3, 0), rows_of(q, 3, 1), splits, out_dtype)
        workspace = (torch.zeros(floats, dtype=torch.float32, device=q.device) if torch.compiler.is_compiling()
                     else _cached_workspace(q.device, floats))
    # The scalars are of their plain types by now: the op's own pass over them is not needed, and an eager
    # call of plain tensors runs the op's body directly (what the op would decide).
    tensors = (q, kv_cache, indices, sink, extra_kv_cache, extra_indices, out, lse, workspace, topk_length)
    run = _attention.body if runs_bodies("sparse_decode_attention", tensors, _TENSOR_SLOTS) else _attention
    run(q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache, extra_indices, extra_page_slots, splits,
        out, lse, workspace, impl, topk_length)
    return out, lse


_TENSOR_SLOTS = tuple(range(10))


@kernel_op("sparse_decode_attention", mutates_args=("out", "lse", "workspace"))
def _attention(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, page_slots: int,
               softmax_scale: float, extra_kv_cache: torch.Tensor | None, extra_indices: torch.Tensor | None,
               extra_page_slots: int, num_splits: int, out: torch.Tensor, lse: torch.Tensor,
               workspace: torch.Tensor | None, impl: str,
               topk_length: torch.Tensor | None) -> None:
    if impl == "header" and q.dtype in _Q_TYPES and not index_checks_on_device(q) \
            and (num_splits != 1 or out.dtype != torch.bfloat16):
        # The header's C++ entry runs the contract itself before it writes anything (the same checks in
        # the same words, host index tables included): Python checks only what builds the entry's
        # arguments, the query dtype (which module: another one is the contract's to refuse, below) and
        # the split count and workspace (its views). Not here: the index tables checked on the device
        # with torch (SPARSEKV_CHECK_INDICES=1), and a bfloat16 `out` of one split, which the op writes
        # itself from the entry's float32 staging (the entry never sees `out`).
        part_out = part_lse = part_arrivals = None
        if num_splits != 1:  # a count below 1 is refused by the checks
            part_out, part_lse, part_arrivals = _split_views(q, indices, extra_indices, num_splits, out, workspace)
        module = ATTENTION.module_for(q, q.dtype)
        module.sparse_decode_attention(q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache,
                                       extra_indices, extra_page_slots, out, lse, part_out, part_lse, part_arrivals,
                                       num_splits, topk_length)
        return
    # One contract for the three implementations, checked before any of them runs.
    main, extra, split_len = check_attention_arguments(
        q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache, extra_indices, extra_page_slots,
        num_splits, out, lse, workspace, topk_length, impl=impl, read_values=reads_values(q, impl))
    if impl == "flashmla":
        flashmla.sparse_decode_attention(q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache,
                                         extra_indices, extra_page_slots, out, lse, topk_length)
        return
    staged, part_out, part_lse, part_arrivals = _workspace_views(workspace, out, q.shape[0], q.shape[1], num_splits,
                                                                 impl)
    if impl == "triton":  # writes bf16 output directly: the staging is the header's
        from sparsekv.jit_kernel.triton import dsv4_attention as triton_attention

        triton_attention.sparse_decode_attention(q, main, extra, split_len, sink, softmax_scale, num_splits, out, lse,
                                                 part_out, part_lse, part_arrivals, topk_length)
        return
    module = ATTENTION.module_for(q, q.dtype)
    module.sparse_decode_attention(q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache, extra_indices,
                                   extra_page_slots, staged, lse, part_out, part_lse, part_arrivals, num_splits,
                                   topk_length)
    if staged is not out:
        out.copy_(staged)

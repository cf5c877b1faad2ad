"""DSV4 lightning indexer: scores over a paged FP8 / FP4 indexer K cache, top-k, and the page-table
transform to cache slots (kernels in ``csrc/dsv4_indexer.cuh``).

For a decode query at raw position ``t`` (C4 layers), compressed entry ``i`` is visible iff
``i < (t + 1) // 4``. With ``k_i`` the dequantized 128-wide key of entry ``i`` (found through the
page table: slot ``page_table[b, i // P] * P + i % P``)::

    scores[b, i] = sum_h weights[b, h] * relu(q[b, h] . k_i)     (visible i; -inf beyond)

Because relu is positively homogeneous, a positive per-(row, head) query scale can be moved into
``weights`` (the FP8 / FP4 query scales of a quantized indexer query are folded this way).
:func:`indexer_topk` then keeps ``min(num_top_k, visible)`` entries with the largest scores, in ascending
position (of equal scores at the threshold, the lower positions), -1 after them, as logical entry
positions (what the HiSparse swap-in takes as ``top_k_tokens``) and, with a
page table, as cache slots (what :func:`sparsekv.jit_kernel.dsv4.sparse_decode_attention` takes as
indices into the fully resident cache).

Cache layouts (:mod:`sparsekv.kv_layout`), ``P`` slots per page, values then scales:
``"fp8"`` = ``INDEXER_FP8`` (128 e4m3 + one fp32 scale, 132 B); ``"fp4"`` = ``INDEXER_FP4`` (64 bytes
of e2m1 pairs, even element in the low nibble, + 4 UE8M0 scales per 32 dims, 68 B).

Limits: 1 to 64 heads of dim 128, ``page_slots`` a power of two, ``num_top_k >= 1`` (any value: the
selection is a radix select with no per-k instantiation), score rows up to 2^31 - 1 entries.

Tolerance of the scores against the fp64 reference (:mod:`sparsekv.testing.reference.dsv4_indexer`,
same dequantized keys): ``|s - ref| <= 1e-5 * sum_h |w_h| |q_h| |k|`` (float32 dot products). Top-k
is exact and deterministic: on the same scores every backend writes the same tokens in the same order
(the swap-in assigns miss slots in that order, attention sums in it).

Example
-------
>>> scores = indexer_scores(q, weights, k_cache, page_table, positions, page_slots=64, layout="fp8")
>>> tokens, slots = indexer_topk(scores, positions, 512, page_table=page_table, page_slots=64)
>>> out, lse = sparse_decode_attention(q_main, c4_cache, slots, sink, 64)
"""

from __future__ import annotations

import functools

import torch

from sparsekv.checks import as_int, named_as, one_of, rename_arguments
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.torch_op import (
    CheckMemo,
    _through_dispatcher,
    first_true,
    index_checks_on_device,
    kernel_op,
    rows_of,
    runs_bodies,
)
from sparsekv.jit_kernel.triton import resolve_impl
from sparsekv.jit_kernel.triton.checks import check_no_overlap, page_shift, visible_entries
from sparsekv.kv_layout import INDEXER_HEAD_DIM, INDEXER_LAYOUTS, MAX_PAGE_SLOTS

__all__ = [
    "INDEXER",
    "INDEXER_HEAD_DIM",
    "INDEXER_LAYOUTS",
    "INDEXER_TOPK",
    "MAX_INDEXER_HEADS",
    "check_pages_in_use",
    "indexer_scores",
    "indexer_template_args",
    "indexer_topk",
    "lightning_indexer",
    "topk_workspace_ints",
    "visible_entries",
]

MAX_INDEXER_HEADS = 64
COMPRESS_RATIO = 4
#: Entry positions and cache slots are int32: a top-k longer than that names nothing more.
_MAX_TOP_K = 2**31 - 1
#: A top-k past the row length only adds columns of -1: up to this many (above every DSV4 / V3.2
#: top-k) are taken whatever the row length, so a short batch keeps the model's fixed top-k; beyond
#: it, num_top_k must not exceed the row length (``num_top_k=2**28`` once allocated and wrote 1 GiB of -1).
TOP_K_PAST_ROW_LENGTH = 2**16
_Q_TYPES = {torch.float32: "float", torch.bfloat16: "sparsekv::Bf16"}

INDEXER = register(
    KernelFamily(
        name="dsv4_indexer",
        header="dsv4_indexer.cuh",
        exports={"indexer_scores": "sparsekv::dsv4_indexer::indexer_scores"},
        kernels=("sparsekv::dsv4_indexer::IndexerScores",),
        params=("layout", "q_dtype"),
        complete=lambda *, layout, q_dtype: (
            INDEXER_LAYOUTS[one_of(layout, "layout", INDEXER_LAYOUTS, owner="dsv4_indexer")].cpp_type,
            _Q_TYPES[one_of(q_dtype, "q_dtype", _Q_TYPES, owner="dsv4_indexer")]),
        instances=tuple({"layout": layout, "q_dtype": dtype} for layout in INDEXER_LAYOUTS for dtype in _Q_TYPES),
    )
)

INDEXER_TOPK = register(
    KernelFamily(
        name="dsv4_indexer_topk",
        header="dsv4_indexer.cuh",
        exports={"indexer_topk": "sparsekv::dsv4_indexer::indexer_topk",
                 "check_indexer_topk": "sparsekv::dsv4_indexer::check_indexer_topk"},
        kernels=("sparsekv::dsv4_indexer::TopK",),
    )
)


def indexer_template_args(layout: str, q_dtype: torch.dtype) -> tuple[str, str]:
    """The ``dsv4_indexer`` template arguments for a cache layout name and a query dtype.

    Raises
    ------
    ValueError
        ``layout`` is not ``"fp8"`` or ``"fp4"``.
    TypeError
        ``q_dtype`` is neither float32 nor bfloat16.
    """
    _check_instance(layout, q_dtype)
    return INDEXER.template_args({"layout": layout, "q_dtype": q_dtype})


def _check_instance(layout: str, q_dtype: torch.dtype) -> None:
    """The refusals of :func:`indexer_template_args`, without building the arguments (the op body's
    check: the module lookup builds them once per instance)."""
    if layout not in INDEXER_LAYOUTS:
        raise ValueError(f"sparsekv: argument `layout` must be one of {sorted(INDEXER_LAYOUTS)}, got {layout!r}")
    if q_dtype not in _Q_TYPES:
        raise TypeError(f"sparsekv: argument `q` must have dtype float32 or bfloat16, got {q_dtype}")


def check_pages_in_use(page_table: torch.Tensor, positions: torch.Tensor, page_slots: int, num_pages: int,
                       pages_are: str = "the pages of `k_cache`") -> None:
    """Torch check, on the tables' own device, that every page holding a visible entry is in ``[0, num_pages)``
    and that every row's visible entries fit its table row (the kernel's host entry does the same for
    host tensors; on the GPU this runs with ``SPARSEKV_CHECK_INDICES=1`` and costs a sync).
    ``pages_are`` says what the bound is, for the message.

    Raises
    ------
    TypeError
        ``positions`` is not int32 or int64.
    ValueError
        ``page_slots`` is not a power of two in ``[1, 2^20]``; ``positions`` is not one per table row; a
        row sees more entries than its page-table row holds.
    IndexError
        A page holding visible entries is outside the cache.
    """
    # The O(1) checks the kernel's entry makes first come first here too, so bad input is named the same.
    page_shift(page_slots, "page_slots")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"sparsekv: argument `positions` must be int32 or int64, got {positions.dtype}")
    if positions.dim() != 1 or positions.shape[0] != page_table.shape[0]:
        raise ValueError(f"sparsekv: argument `positions` must be [B={page_table.shape[0]}] (one per page-table row), "
                         f"got shape {list(positions.shape)}")
    pages_seen = -(-visible_entries(positions.to(torch.int64)) // page_slots)
    too_long = first_true(pages_seen > page_table.shape[1])
    if too_long is not None:
        (b,) = too_long
        raise ValueError(f"sparsekv: argument `page_table` has {page_table.shape[1]} pages per row, but row {b} "
                         f"sees {int(visible_entries(positions[b:b + 1].to(torch.int64))[0])} entries")
    in_use = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < pages_seen[:, None]
    bad = first_true(in_use & ((page_table < 0) | (page_table >= num_pages)))
    if bad is not None:
        b, i = bad
        raise IndexError(f"sparsekv: argument `page_table`[{b}, {i}] = {int(page_table[b, i])} is outside "
                         f"[0, {num_pages}) ({pages_are}) but holds visible entries")


@renamed_keywords(page_size="page_slots")
def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    *,
    page_slots: int = 64,
    layout: str = "fp8",
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Lightning indexer scores ``sum_h w[b,h] relu(q[b,h] . k_i)`` of every visible entry, -inf beyond.

    Parameters
    ----------
    q : torch.Tensor
        float32 or bfloat16 ``[B, Hi, 128]`` (``1 <= Hi <= 64``), unit last stride; quantized queries
        are passed dequantized (or with their positive scales folded into ``weights``).
    weights : torch.Tensor
        float32 ``[B, Hi]`` head weights, unit last stride.
    k_cache : torch.Tensor
        uint8 ``[pages, layout.page_bytes(page_slots)]`` indexer keys, unit last stride.
    page_table : torch.Tensor
        int32 ``[B, max_pages]``: cache page of each row's logical page ``i // page_slots``.
    positions : torch.Tensor
        int32 or int64 ``[B]``, contiguous: raw position ``t`` of each query (sees ``(t + 1) // 4`` entries).
    page_slots : int
        Entries per page, a power of two (64 for DSV4).
    layout : str
        ``"fp8"`` (132 B entries) or ``"fp4"`` (68 B).
    out : torch.Tensor, optional
        float32 ``[B, L]`` to write (unit last stride); default a new ``[B, max_pages * page_slots]``.
        Entries of a row past its visible count (or past ``L``) are -inf.
    impl : {"auto", "header", "triton"}
        ``"header"``: the ``csrc/dsv4_indexer.cuh`` kernel on the cpu or cuda backend by device;
        ``"triton"``: the tensor-core twin (:mod:`sparsekv.jit_kernel.triton.dsv4_indexer`), on a GPU or,
        on CPU tensors, under ``TRITON_INTERPRET=1``; ``"auto"``: the header (on the H200 the header
        took 227 us and the twin 279 us over 64k entries: docs/sim-and-triton.md). Same arguments, same custom
        op, same refusals, scores within the same tolerance.

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    TypeError
        Wrong dtype, or a ``page_slots`` that is not an int (the message names the argument).
    ValueError
        Wrong shape, stride or device; more than 64 heads; ``page_slots`` not a power of two in
        ``[1, 2^20]``; a row that sees more entries than its page-table row holds (host-readable
        tables); ``out`` sharing memory with another argument or with itself.
    IndexError
        A page holding visible entries outside the cache (host-readable tables; the kernel scores
        such entries -inf otherwise).
    """
    page_slots = as_int(page_slots, "page_slots")
    if out is None:  # a page size out of range gives no columns; the op body refuses it
        width = rows_of(page_table, 2, 1) * page_slots if 1 <= page_slots <= MAX_PAGE_SLOTS else 0
        out = torch.empty((rows_of(page_table, 2, 0), width), dtype=torch.float32, device=q.device)
    impl = resolve_impl(impl, q)
    try:
        _indexer_scores(q, weights, k_cache, page_table, positions, page_slots, layout, out, impl)
    except (TypeError, ValueError, IndexError) as error:
        rename_arguments(error, scores="out")  # the entries call the output `scores`
        raise
    return out


@kernel_op("indexer_scores", mutates_args=("out",))
def _indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, page_table: torch.Tensor,
                    positions: torch.Tensor, page_slots: int, layout: str, out: torch.Tensor, impl: str) -> None:
    q_dtype = q.dtype
    _check_instance(layout, q_dtype)
    on_device = index_checks_on_device(out)
    if (on_device or impl == "triton") and page_table.dim() != 2:  # the header's entry says the same itself
        raise ValueError(f"sparsekv: argument `page_table` must be 2-D, got shape {list(page_table.shape)}")
    if on_device:
        check_pages_in_use(page_table, positions, page_slots, k_cache.shape[0])
    if impl == "triton":
        _twin().indexer_scores(q, weights, k_cache, page_table, positions, page_slots, layout, out)
        return
    INDEXER.module_for(out, layout, q_dtype).indexer_scores(q, weights, k_cache, page_table, positions, page_slots, out)



@renamed_keywords(top_k="num_top_k", page_size="page_slots")
def indexer_topk(
    scores: torch.Tensor,
    positions: torch.Tensor,
    num_top_k: int,
    *,
    page_table: torch.Tensor | None = None,
    page_slots: int = 64,
    out: torch.Tensor | None = None,
    out_slots: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``min(num_top_k, visible)`` highest-scoring visible entries of each row, -1 padded.

    Parameters
    ----------
    scores : torch.Tensor
        float32 ``[B, L]``, unit last stride (e.g. from :func:`indexer_scores`); only the first
        ``min((t + 1) // 4, L)`` entries of a row are candidates, whatever the rest holds.
    positions : torch.Tensor
        int32 or int64 ``[B]``, contiguous: raw query positions ``t``.
    num_top_k : int
        ``1 <= k < 2^31`` (an int or a numpy integer), at most ``max(L, 65536)`` for rows of ``L``
        entries (:data:`TOP_K_PAST_ROW_LENGTH`: columns past ``L`` only hold -1).
    page_table : torch.Tensor, optional
        int32 ``[B, max_pages]``; when given, the cache slots of the selected entries are returned too.
    page_slots : int
        Entries per page of the table, a power of two.
    out, out_slots : torch.Tensor, optional
        int32 ``[B, num_top_k]`` (unit last stride) to write; default new tensors.
    workspace : torch.Tensor, optional
        int32, 1-D, contiguous, on the scores' device, any contents, at least
        :func:`topk_workspace_ints` elements for this ``impl``: the header's GPU kernel then splits
        each row over several CTAs at small batch (the global histogram and the CTAs' candidate
        segments; without it, one CTA per row and nothing allocated), the Triton twin cuts its
        scratch lists from it (without it, they are allocated per call). Given it (and ``out``,
        ``out_slots``), a call allocates nothing. Not to be shared by calls on different streams.
    impl : {"auto", "header", "triton"}
        ``"header"``: the ``csrc/dsv4_indexer.cuh`` top-k on the cpu or cuda backend by device;
        ``"triton"``: the Triton twin (:mod:`sparsekv.jit_kernel.triton.dsv4_indexer`), on a GPU or, on
        CPU tensors, under ``TRITON_INTERPRET=1``; ``"auto"``: the header (its GPU kernel runs a block
        of 1024 threads per row, or several given a ``workspace``; the twin is not yet timed on a
        GPU). Identical outputs, same refusals.

    Returns
    -------
    tokens : torch.Tensor
        int32 ``[B, num_top_k]``: logical entry positions, distinct and ascending (equal scores at the
        threshold: the lower positions are taken), then -1; the HiSparse swap-in's ``top_k_tokens``.
    slots : torch.Tensor or None
        int32 ``[B, num_top_k]``: ``page_table[b, tok // P] * P + tok % P`` per token, -1 for -1 (None
        without ``page_table``).

    Raises
    ------
    TypeError, ValueError
        Wrong dtype, shape, stride or device; ``num_top_k`` not an int or out of range (above the row
        length and 65,536 included; refused before anything is allocated); ``out_slots`` without
        ``page_table``; an output sharing memory with
        another argument or with itself; a ``workspace`` of the wrong dtype, shape or device, or too small.
    IndexError
        A page holding visible entries that is negative or whose slots overflow int32 (host-readable
        tables; with ``SPARSEKV_CHECK_INDICES=1`` on the GPU too; otherwise such slots are -1).
    """
    num_top_k, page_slots = as_int(num_top_k, "num_top_k"), as_int(page_slots, "page_slots")
    impl = resolve_impl(impl, scores)
    if out is None or (out_slots is None and page_table is not None):  # given both, nothing to make
        out, out_slots = _topk_outputs(scores, num_top_k, page_table, out, out_slots)
    _indexer_topk(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
    return out, out_slots


def _check_top_k(scores: torch.Tensor, num_top_k: int) -> None:
    if not 1 <= num_top_k <= _MAX_TOP_K:
        raise ValueError(f"sparsekv: argument `num_top_k` must be in [1, 2^31 - 1] (any k; no per-k instances), got "
                         f"{num_top_k}")
    if num_top_k <= TOP_K_PAST_ROW_LENGTH:  # any row takes it (the decode path's k: no need to read the width)
        return
    width = rows_of(scores, 2, 1)
    if num_top_k > width:
        raise ValueError(f"sparsekv: argument `num_top_k` = {num_top_k} is more than the {width} entries of a `scores` "
                         f"row (and than {TOP_K_PAST_ROW_LENGTH}, the columns of -1 taken past a row's length)")


def _topk_outputs(scores: torch.Tensor, num_top_k: int, page_table: torch.Tensor | None, out: torch.Tensor | None,
                  out_slots: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out`` and ``out_slots`` of a top-k call, allocated when not given (``[B, num_top_k]`` int32), after
    the ``num_top_k`` check (:func:`_check_top_k`), so an absurd ``num_top_k`` allocates nothing (given
    both, the op body checks it)."""
    slots_missing = page_table is not None and out_slots is None
    if out is not None and not slots_missing:
        return out, out_slots
    _check_top_k(scores, num_top_k)
    k, batch = num_top_k, rows_of(scores, 2)
    if out is None:
        out = torch.empty((batch, k), dtype=torch.int32, device=scores.device)
    if slots_missing:
        out_slots = torch.empty((batch, k), dtype=torch.int32, device=scores.device)
    return out, out_slots


#: The header's split rows (``TopK::split_of`` in ``csrc/dsv4_indexer.cuh``): a CTA per
#: ``_SPLIT_MIN_SLICE`` entries, at most ``_SPLIT_MAX`` a row and ``_SPLIT_CTAS`` a launch; a row's
#: workspace is ``_SPLIT_SEGMENTS_AT`` words, then two words per entry of its split row.
_SPLIT_MIN_SLICE, _SPLIT_MAX, _SPLIT_CTAS, _SPLIT_SEGMENTS_AT = 4096, 32, 128, 4160


def _header_workspace_ints(batch: int, width: int) -> int:
    splits = min(-(-width // _SPLIT_MIN_SLICE), _SPLIT_MAX, _SPLIT_CTAS // max(batch, 1))
    if splits <= 1:
        return 0
    slice_ = (-(-width // splits) + 3) // 4 * 4
    splits = -(-width // slice_)
    return batch * (_SPLIT_SEGMENTS_AT + 2 * splits * slice_)


def topk_workspace_ints(batch: int, width: int, num_top_k: int, impl: str = "any") -> int:
    """int32 elements of the ``workspace`` of an :func:`indexer_topk` call on ``[batch, width]`` scores.

    ``impl="header"``: the header's split rows (at small batch its GPU kernel splits a row of more
    than 4,096 entries over several CTAs; 0 when one CTA takes each row); ``"triton"``: the scratch
    lists of the twin's on-chip levels (0 when a row is selected in one program); ``"any"`` (the
    default): enough for both, so one workspace serves every ``impl``. Neither reads what it holds
    before writing it: any contents will do.
    """
    header = _header_workspace_ints(batch, width)
    if impl == "header":
        return header
    triton = _twin().topk_workspace_ints(batch, width, num_top_k)
    return triton if impl == "triton" else max(header, triton)


def _check_workspace(workspace: torch.Tensor, scores: torch.Tensor, num_top_k: int, impl: str, out: torch.Tensor,
                     out_slots: torch.Tensor | None) -> None:
    need = topk_workspace_ints(scores.shape[0], scores.shape[1], num_top_k, impl)
    if workspace.dtype != torch.int32 or workspace.dim() != 1 or not workspace.is_contiguous() \
            or workspace.device != scores.device or workspace.numel() < need:
        raise ValueError(f"sparsekv: argument `workspace` must be a contiguous 1-D int32 tensor on {scores.device} "
                         f"with at least {need} elements (topk_workspace_ints), got {workspace.dtype} "
                         f"{list(workspace.shape)} on {workspace.device}")
    for other, name in ((scores, "scores"), (out, "out"), (out_slots, "out_slots")):
        if other is not None:
            check_no_overlap(workspace, "workspace", other, name)


def _check_topk_options(scores: torch.Tensor, positions: torch.Tensor, num_top_k: int, page_table: torch.Tensor | None,
                        page_slots: int, out: torch.Tensor, out_slots: torch.Tensor | None,
                        workspace: torch.Tensor | None, impl: str) -> None:
    """The top-k op body's own checks (the entry's follow in the kernel call)."""
    if not 1 <= num_top_k <= TOP_K_PAST_ROW_LENGTH:  # else any row takes it
        _check_top_k(scores, num_top_k)
    if out_slots is not None and page_table is None:
        raise ValueError("sparsekv: argument `out_slots` needs `page_table`")
    shape = out.shape
    if len(shape) != 2 or shape[1] != num_top_k:
        raise ValueError(f"sparsekv: argument `out` must be [B, num_top_k={num_top_k}], got shape {list(out.shape)}")
    if page_table is not None and index_checks_on_device(scores) and page_slots > 0:
        # The host entry's check of host tables, on the device (a sync): no page whose slots wrap int32.
        check_pages_in_use(page_table, positions, page_slots, 2**31 // page_slots, "pages whose slots fit int32")
    if workspace is not None and scores.dim() == 2:
        _check_workspace(workspace, scores, num_top_k, impl, out, out_slots)


@kernel_op("indexer_topk", mutates_args=("out", "out_slots", "workspace"))
def _indexer_topk(scores: torch.Tensor, positions: torch.Tensor, num_top_k: int, page_table: torch.Tensor | None,
                  page_slots: int, out: torch.Tensor, out_slots: torch.Tensor | None, workspace: torch.Tensor | None,
                  impl: str) -> None:
    _check_topk_options(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
    _topk(scores, positions, page_table, page_slots, out, out_slots, workspace, impl)


def _topk(scores: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor | None, page_slots: int,
          out: torch.Tensor, out_slots: torch.Tensor | None, workspace: torch.Tensor | None, impl: str) -> None:
    """The ``indexer_topk`` op's body after its own checks: the implementation's entry, which checks the rest."""
    if impl == "triton":
        _twin().indexer_topk(scores, positions, out, page_table, out_slots, page_slots, workspace)
        return
    INDEXER_TOPK.module_for(scores).indexer_topk(scores, positions, out, page_table, out_slots,
                                                                 page_slots, workspace)


@renamed_keywords(top_k="num_top_k", page_size="page_slots")
def lightning_indexer(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    positions: torch.Tensor,
    num_top_k: int,
    *,
    page_slots: int = 64,
    layout: str = "fp8",
    scores: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_slots: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`indexer_scores` then :func:`indexer_topk` through the page table (``impl`` passed to both).

    Returns ``(tokens, slots)``, both int32 ``[B, num_top_k]`` (``out`` and ``out_slots`` when given).
    ``scores`` is the float32 ``[B, L]`` score buffer (default: new rows of ``max_pages * page_slots``).
    ``workspace`` is the top-k's (:func:`topk_workspace_ints`). Same parameters and errors as the two;
    given the four buffers, a call allocates nothing.

    Every argument of the top-k (``num_top_k``, ``out``, ``out_slots``, ``workspace``, and ``scores`` as
    the top-k reads it) is checked before the scores are computed: a refusal leaves ``scores`` as
    it was (in eager calls; a traced graph checks each op as it runs).
    """
    num_top_k, page_slots = as_int(num_top_k, "num_top_k"), as_int(page_slots, "page_slots")
    if scores is None:
        width = rows_of(page_table, 2, 1) * page_slots if 1 <= page_slots <= MAX_PAGE_SLOTS else 0
        scores = torch.empty((rows_of(page_table, 2, 0), width), dtype=torch.float32, device=q.device)
    impl = resolve_impl(impl, scores)
    out, out_slots = _topk_outputs(scores, num_top_k, page_table, out, out_slots)
    tensors = (q, weights, k_cache, page_table, positions, scores, out, out_slots, workspace)
    if runs_bodies("lightning_indexer", tensors, _LIGHTNING_TENSORS):  # what each op would run directly
        # One pass over the arguments for both ops, the top-k's checks before any score is written
        # (memoized), then the two bodies: the scores', and the top-k's entry without its own checks,
        # which the pre-check ran.
        _check_topk_arguments(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
        try:
            _indexer_scores.body(q, weights, k_cache, page_table, positions, page_slots, layout, scores, impl)
        except (TypeError, ValueError, IndexError) as error:
            rename_arguments(error, out="scores")  # the scores' `out` is this call's `scores`
            raise
        _topk(scores, positions, page_table, page_slots, out, out_slots, workspace, impl)
        return out, out_slots
    if not _through_dispatcher((scores, positions, out)):
        _check_topk_arguments(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
    with named_as(out="scores"):
        _indexer_scores(q, weights, k_cache, page_table, positions, page_slots, layout, scores, impl)
    _indexer_topk(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
    return out, out_slots


#: The argument slots :func:`lightning_indexer`'s one pass reads (its scalars are plain by then).
_LIGHTNING_TENSORS = tuple(range(9))


def _check_topk_arguments(scores: torch.Tensor, positions: torch.Tensor, num_top_k: int,
                          page_table: torch.Tensor | None, page_slots: int, out: torch.Tensor,
                          out_slots: torch.Tensor | None, workspace: torch.Tensor | None, impl: str) -> None:
    """The checks of a top-k call (the op body's, then the entry's), without running it. The table
    pages are left to the call itself: that check reads values, and the scores' own check of them
    refuses first.

    The header's entry checks are its module's ``check_indexer_topk`` (one FFI crossing, the entry's
    own code and words); the Triton twin's are its Python mirror of that contract, O(1) unless
    ``SPARSEKV_CHECK_INDICES=1`` on the GPU, so a call whose arguments' metadata passed before
    (:class:`~sparsekv.jit_kernel.torch_op.CheckMemo`) is not checked again."""
    if impl != "triton":
        _check_topk_options(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
        INDEXER_TOPK.module_for(scores).check_indexer_topk(scores, positions, out, page_table, out_slots, page_slots,
                                                           workspace)
        return
    key = None if index_checks_on_device(scores) else _topk_key(scores, positions, num_top_k, page_table, page_slots,
                                                                  out, out_slots, workspace)
    if _TOPK_MEMO.get(key) is not None:
        return
    _check_topk_options(scores, positions, num_top_k, page_table, page_slots, out, out_slots, workspace, impl)
    _twin().check_topk_arguments(scores, positions, out, page_table, out_slots, page_slots, read_tables=False)
    _TOPK_MEMO.put(key, True)


def _topk_key(scores: torch.Tensor, positions: torch.Tensor, num_top_k: int, page_table: torch.Tensor | None,
              page_slots: int, out: torch.Tensor, out_slots: torch.Tensor | None,
              workspace: torch.Tensor | None) -> tuple | None:
    """What the Triton top-k's O(1) checks read of a call, as the memo's key: each tensor's address,
    shape, strides, dtype and device (what :func:`~sparsekv.jit_kernel.torch_op.metadata_key` keys),
    and the two ints, as plain as the wrapper made them (:func:`~sparsekv.checks.as_int`); None when
    a tensor is a subclass (checked in full). Written out for these arguments, in one flat tuple:
    about 2.5 us where the generic loop took 4 (issue 36 item 2). An optional tensor not given is
    one None, never an int, so no two calls share a key."""
    if not (type(scores) is _Tensor and type(positions) is _Tensor and type(out) is _Tensor
            and (page_table is None or type(page_table) is _Tensor)
            and (out_slots is None or type(out_slots) is _Tensor)
            and (workspace is None or type(workspace) is _Tensor)):
        return None
    return (num_top_k, page_slots,
            _data_ptr(scores), scores.shape, _stride(scores), scores.dtype, scores.device,
            _data_ptr(positions), positions.shape, _stride(positions), positions.dtype, positions.device,
            _data_ptr(out), out.shape, _stride(out), out.dtype, out.device,
            *((None,) if page_table is None else (_data_ptr(page_table), page_table.shape, _stride(page_table),
                                                  page_table.dtype, page_table.device)),
            *((None,) if out_slots is None else (_data_ptr(out_slots), out_slots.shape, _stride(out_slots),
                                                 out_slots.dtype, out_slots.device)),
            *((None,) if workspace is None else (_data_ptr(workspace), workspace.shape, _stride(workspace),
                                                 workspace.dtype, workspace.device)))


_Tensor, _data_ptr, _stride = torch.Tensor, torch.Tensor.data_ptr, torch.Tensor.stride


@functools.cache
def _twin():
    """The Triton twin's module (:mod:`sparsekv.jit_kernel.triton.dsv4_indexer`), imported at its first use
    (importing it imports triton); an import statement in a function costs ~0.4 us a call."""
    from sparsekv.jit_kernel.triton import dsv4_indexer

    return dsv4_indexer


#: The Triton top-k calls :func:`_check_topk_arguments` passed, by :func:`_topk_key` (issue 36 item 2:
#: ~45 us a decode step).
_TOPK_MEMO = CheckMemo()

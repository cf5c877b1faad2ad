"""The kernel instances a model's serving path loads, so a deployment can prebuild exactly those
(``sparsekv jit build --model dsv4-flash``) and serve with ``SPARSEKV_JIT_STRICT=1``.

It lives next to the model specs it reads and names the kernel families by string (as
``sparsekv jit build --instance`` does), so it imports no kernel: the front end that builds them
(:mod:`sparsekv.cli.jit`) looks the families up in the registry.
"""

from __future__ import annotations

from sparsekv.checks import as_int
from sparsekv.deprecation import renamed_keywords
from sparsekv.kv_layout import C4_RATIO, c4_page_slots
from sparsekv.srt.model_executor.model_spec import DSV4_PRESETS, ServerSpec, dsv4_preset

#: ``index_topk`` of each preset's model config: the CSA indexer's top-k, which the swap-in is built for.
INDEX_TOP_K = {"dsv4-flash": 512, "dsv4-pro": 1024}

#: The model of ``sparsekv demo`` (:mod:`sparsekv.cli.demo.model`): its top-k, hot buffer and query dtype.
DEMO = "demo"
DEMO_TOP_K, DEMO_HOT_BUFFER = 64, 128


@renamed_keywords(hot_buffer="hot_buffer_size")
def model_instances(model: str, *, hot_buffer_size: int | None = None,
                    page_size: int | None = None) -> list[tuple[str, dict[str, object]]]:
    """``(family, {param: value})`` for every kernel instance a HiSparse server of ``model`` loads.

    Parameters
    ----------
    model : {"dsv4-flash", "dsv4-pro", "demo"}
        A planner preset, or the model of ``sparsekv demo`` (float32 queries, FP8 indexer keys).
    hot_buffer_size : int, optional
        Device hot-buffer slots per request (default ``2 * index_topk``; 128 for the demo); formerly
        ``hot_buffer=``, which still works for one release (with a ``DeprecationWarning``).
    page_size : int, optional
        Full-pool page size (default the planner's :class:`ServerSpec` default).

    Raises
    ------
    TypeError
        ``hot_buffer_size`` or ``page_size`` is not an int.
    ValueError
        Unknown model, a hot buffer smaller than the top-k, or a ``page_size`` not one of
        :data:`~sparsekv.kv_layout.DSV4_PAGE_SIZES` (the page sizes the DSV4 kernels serve).
    """
    if model == DEMO:
        import torch

        hot = DEMO_HOT_BUFFER if hot_buffer_size is None else hot_buffer_size
        _check_hot_buffer(hot, DEMO_TOP_K)
        server = ServerSpec() if page_size is None else ServerSpec(page_size=page_size)
        return serving_instances(num_top_k=DEMO_TOP_K, hot_buffer_size=hot, page_size=server.page_size,
                                 q_dtypes=(torch.float32,), indexer_layouts=("fp8",))
    if model not in DSV4_PRESETS:
        raise ValueError(f"sparsekv: unknown model {model!r}; expected one of {sorted(DSV4_PRESETS) + [DEMO]}")
    spec = dsv4_preset(model)
    if C4_RATIO not in spec.compress_ratios:
        return []
    num_top_k = INDEX_TOP_K[model]
    hot = 2 * num_top_k if hot_buffer_size is None else hot_buffer_size
    _check_hot_buffer(hot, num_top_k)
    server = ServerSpec() if page_size is None else ServerSpec(page_size=page_size)
    return serving_instances(num_top_k=num_top_k, hot_buffer_size=hot, page_size=server.page_size)


def _check_hot_buffer(hot: int, num_top_k: int) -> None:
    if as_int(hot, "hot_buffer_size") < num_top_k:
        raise ValueError(f"sparsekv: argument `hot_buffer_size` must be >= the model's index top-k ({num_top_k}), "
                         f"got {hot}")


@renamed_keywords(top_k="num_top_k", hot_buffer="hot_buffer_size")
def serving_instances(*, num_top_k: int, hot_buffer_size: int, page_size: int = 256, q_dtypes=None,
                      indexer_layouts: tuple[str, ...] = ("fp8", "fp4")) -> list[tuple[str, dict[str, object]]]:
    """``(family, {param: value})`` of every kernel instance a HiSparse DSV4 decode loads.

    The compressors (``dsv4_compress``), the store of the main and indexer caches (``dsv4_store``)
    and the compressors fused with it (``dsv4_compress_store``), the quantizer (``dsv4_quant``), the
    indexer scores and top-k, the sparse attention, the HiSparse swap-in, its planned copy and the
    token/page copies.

    Parameters
    ----------
    num_top_k, hot_buffer_size : int
        The indexer's top-k and the hot-buffer slots per request (the swap-in's instance); formerly
        ``top_k=`` and ``hot_buffer=``, which still work for one release (with a ``DeprecationWarning``).
    page_size : int
        Full-pool page size (the C4 pages the HiSparse kernels move hold ``page_size / 4`` entries).
    q_dtypes : tuple of torch.dtype, optional
        Query dtypes of the attention and indexer (default bfloat16 and float32).
    indexer_layouts : tuple of str
        Indexer key layouts (``"fp8"``, ``"fp4"``).

    Raises
    ------
    TypeError
        ``page_size`` is not an int.
    ValueError
        ``page_size`` is not one of :data:`~sparsekv.kv_layout.DSV4_PAGE_SIZES`.
    """
    import torch

    q_dtypes = (torch.bfloat16, torch.float32) if q_dtypes is None else tuple(q_dtypes)
    page_slots = c4_page_slots(page_size)
    store_kinds = ["V4"] + [f"INDEXER_{layout.upper()}" for layout in indexer_layouts]
    return [
        ("dsv4_compress", {}),
        *(("dsv4_store", {"cache_kind": kind}) for kind in store_kinds),
        *(("dsv4_compress_store", {"cache_kind": kind}) for kind in store_kinds),
        ("dsv4_quant", {}),
        *(("dsv4_indexer", {"layout": layout, "q_dtype": dtype}) for layout in indexer_layouts for dtype in q_dtypes),
        ("dsv4_indexer_topk", {}),
        *(("dsv4_attention", {"q_dtype": dtype}) for dtype in q_dtypes),
        ("hisparse", {"num_top_k": num_top_k, "hot_buffer_size": hot_buffer_size, "layout": "dsv4",
                      "page_slots": page_slots}),
        ("hisparse_planned", {"layout": "dsv4", "page_slots": page_slots}),
        ("hisparse_copy", {"page_slots": page_slots}),
    ]

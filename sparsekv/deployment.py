"""The kernel instances a model's serving path loads, so a deployment can prebuild exactly those
(``sparsekv jit build --model dsv4-flash``) and serve with ``SPARSEKV_JIT_STRICT=1``.

It joins the planner's model specs with the kernel families, so it lives above both: the kernel
package never imports the pools or the planner.
"""

from __future__ import annotations

from sparsekv.srt.model_executor.dsv4_geometry import kv_page_tokens
from sparsekv.srt.model_executor.model_spec import DSV4_PRESETS, ServerSpec, dsv4_preset

#: ``index_topk`` of each preset's model config: the CSA indexer's top-k, which the swap-in is built for.
INDEX_TOP_K = {"dsv4-flash": 512, "dsv4-pro": 1024}

#: C4 compression ratio: the compressed pages the HiSparse kernels move hold ``page_size / 4`` tokens.
C4_RATIO = 4


def model_instances(model: str, *, hot_buffer: int | None = None,
                    page_size: int | None = None) -> list[tuple[str, dict[str, object]]]:
    """``(family, {param: value})`` for every kernel instance a HiSparse server of ``model`` loads.

    Parameters
    ----------
    model : {"dsv4-flash", "dsv4-pro"}
        A planner preset.
    hot_buffer : int, optional
        Device hot-buffer slots per request (default ``2 * index_topk``).
    page_size : int, optional
        Full-pool page size (default the planner's :class:`ServerSpec` default).

    Raises
    ------
    ValueError
        Unknown model, or a hot buffer smaller than the top-k.
    """
    if model not in DSV4_PRESETS:
        raise ValueError(f"sparsekv: unknown model {model!r}; expected one of {sorted(DSV4_PRESETS)}")
    spec = dsv4_preset(model)
    if C4_RATIO not in spec.compress_ratios:
        return []
    top_k = INDEX_TOP_K[model]
    hot = 2 * top_k if hot_buffer is None else hot_buffer
    if hot < top_k:
        raise ValueError(f"sparsekv: --hot-buffer ({hot}) must be >= the model's index top-k ({top_k})")
    server = ServerSpec() if page_size is None else ServerSpec(page_size=page_size)
    page_slots = kv_page_tokens(server.page_size, C4_RATIO)
    return [
        ("hisparse", {"num_top_k": top_k, "hot_buffer_size": hot, "layout": "dsv4", "page_slots": page_slots}),
        ("hisparse_planned", {"layout": "dsv4", "page_slots": page_slots}),
        ("hisparse_copy", {"page_slots": page_slots}),
    ]

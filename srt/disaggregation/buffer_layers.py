"""Which layer each registered region holds: the labels that make PP-aligned slicing a lookup.

Pools with compressed layers (DSV4) list their regions *by buffer type*, each type over the
stage's layers of the ratios it applies to, in layer order::

    get_contiguous_buf_infos()      C4 KV (C4 layers), C4 indexer (C4 layers), C128 KV (C128 layers)
    get_state_buf_infos()           SWA KV (every layer), C4 state (C4 layers), C4 indexer state (C4 layers)
    get_request_state_buf_infos()   C128 state (C128 layers)

so with the per-layer compression ratios (``mla_compression_ratios``) and the first layer, region
``i`` is "group g, layer l". A PP stage labels its regions ``"g:l"`` with *global* layer ids; the
decode pool (all layers) has a region of every label, and the sender picks its destination by
label: each stage writes exactly its own layers. Pools without compressed layers label regions
by position (``"kv:i"``), which only pairs pools of the same layers.
"""

from __future__ import annotations

from collections.abc import Sequence

#: (group name, ratios whose layers the group covers), in each list's order.
KV_GROUPS = (("c4_kv", (4,)), ("c4_indexer", (4,)), ("c128_kv", (128,)))
SWA_STATE_GROUPS = (("swa_kv", (0, 4, 128)), ("c4_state", (4,)), ("c4_indexer_state", (4,)))
REQUEST_STATE_GROUPS = (("c128_state", (128,)),)


def layer_labels(groups: Sequence[tuple[str, Sequence[int]]], start_layer: int, ratios: Sequence[int],
                 prefix: str = "") -> list[str]:
    """``"<prefix><group>:<layer>"`` for every region of a list laid out as ``groups``.

    Examples
    --------
    >>> layer_labels(KV_GROUPS, 2, [4, 128, 4])
    ['c4_kv:2', 'c4_kv:4', 'c4_indexer:2', 'c4_indexer:4', 'c128_kv:3']
    """
    return [f"{prefix}{name}:{start_layer + i}" for name, covered in groups
            for i, ratio in enumerate(ratios) if ratio in covered]


def positional_labels(prefix: str, count: int) -> list[str]:
    """``"<prefix>:0" .. "<prefix>:<count-1>"``: regions identified by position only."""
    return [f"{prefix}:{i}" for i in range(count)]


def _checked(labels: list[str], count: int, what: str) -> list[str]:
    if len(labels) != count:
        raise ValueError(f"sparsekv: the pool lists {count} {what} regions, but its layer layout has {len(labels)} "
                         f"({labels[:4]}...): the buffer list and the compression ratios disagree")
    return labels


def kv_labels(count: int, start_layer: int, ratios: Sequence[int] | None) -> list[str]:
    """Labels of a pool's ``get_contiguous_buf_infos`` regions.

    Raises
    ------
    ValueError
        ``count`` differs from what the layout of ``ratios`` gives.
    """
    if ratios is None:
        return positional_labels("kv", count)
    return _checked(layer_labels(KV_GROUPS, start_layer, ratios), count, "KV")


def swa_state_labels(count: int, start_layer: int, ratios: Sequence[int] | None, prefix: str = "") -> list[str]:
    """Labels of a pool's ``get_state_buf_infos`` regions routed as SWA state."""
    if ratios is None:
        return positional_labels(f"{prefix}swa_state", count)
    return _checked(layer_labels(SWA_STATE_GROUPS, start_layer, ratios, prefix), count, "SWA state")


def request_state_labels(count: int, start_layer: int, ratios: Sequence[int] | None) -> list[str]:
    """Labels of a pool's ``get_request_state_buf_infos`` regions."""
    if ratios is None:
        return positional_labels("request_state", count)
    return _checked(layer_labels(REQUEST_STATE_GROUPS, start_layer, ratios), count, "request state")

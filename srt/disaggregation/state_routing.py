"""``kv_args_of``: what one side of a PD transfer registers for a pool; ``setup_state_kv_args``: which
state components the pool sends beside its KV pages.

One dispatch shared by the prefill and the decode side, so both list the same components in the
same order:

==========================================  =================================================
pool                                        components
==========================================  =================================================
:class:`BaseSWAKVPool` (DSV4 included)      ``SWA`` (``get_state_buf_infos``), then
                                            ``C128_STATE`` if the pool has request-scoped
                                            state (``get_request_state_buf_infos``)
:class:`HybridLinearStatePool`              ``MAMBA``
:class:`DSAStatePool`                       ``DSA`` (a DSA draft's regions appended)
anything else                               none
==========================================  =================================================

A DSV4 pool is an SWA pool: its compressor rings are addressed by SWA page, so they travel on the
generic SWA path with the SWA pages; there is no DSV4-only branch. A draft pool of an SWA target
adds a second ``SWA`` component. Every :class:`StateType` has a sender (:mod:`.planning`); a type
without one is refused before anything is sent, never skipped (a skipped state decodes garbage).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from sparsekv.srt.disaggregation.buffer_layers import (
    kv_labels,
    positional_labels,
    request_state_labels,
    swa_state_labels,
)
from sparsekv.srt.disaggregation.kv_args import KVArgs, StateType, check_region_list, mem_kind_of
from sparsekv.srt.mem_cache.base_swa_pool import BaseSWAKVPool


class HybridLinearStatePool(ABC):
    """A pool of hybrid linear-attention (Mamba-style) models: per-request state slots.

    Not built by sparsekv; engines register their pool class (``HybridLinearStatePool.register``)
    or subclass this to have it routed as ``MAMBA``.
    """

    @abstractmethod
    def get_contiguous_buf_infos(self):
        """KV regions of the full-attention layers."""

    @abstractmethod
    def get_state_buf_infos(self):
        """State regions; one transfer index = one state slot."""


class DSAStatePool(ABC):
    """A pool of DSA (sparse-attention indexer) models: indexer keys addressed by full-token page.

    Routed as ``DSA``; register or subclass as for :class:`HybridLinearStatePool`.
    """

    @abstractmethod
    def get_contiguous_buf_infos(self):
        """KV regions."""

    @abstractmethod
    def get_state_buf_infos(self):
        """Indexer-key regions; one transfer index = one full-token page."""


def _layout(pool) -> tuple[int, list[int] | None]:
    ratios = getattr(pool, "stage_compress_ratios", None)
    return getattr(pool, "start_layer", 0), (list(ratios) if ratios is not None else None)


def _add_swa(kv_args: KVArgs, pool, prefix: str = "") -> None:
    infos = pool.get_state_buf_infos()
    start, ratios = _layout(pool)
    kv_args.add_state(StateType.SWA, infos, swa_state_labels(len(infos[0]), start, ratios, prefix), mem_kind_of(pool))


def setup_state_kv_args(kv_args: KVArgs, token_to_kv_pool, draft_token_to_kv_pool=None) -> None:
    """Fill ``kv_args``'s state components and ``mla_compression_ratios`` from the pools.

    Parameters
    ----------
    kv_args : KVArgs
        Its state lists are replaced.
    token_to_kv_pool
        The target model's pool (see the module docstring for the routing).
    draft_token_to_kv_pool : optional
        A speculative draft's pool: an SWA pool beside an SWA target (its own ``SWA`` component,
        labels prefixed ``draft.``) or a DSA pool beside a DSA target (regions appended).

    Raises
    ------
    ValueError
        A draft pool of another kind than the target's; a region list that does not match the
        pool's layer layout.
    """
    kv_args.clear_state()
    for pool in (token_to_kv_pool, draft_token_to_kv_pool):
        if pool is not None and all(pool is not owner for owner in kv_args.owners):
            kv_args.owners.append(pool)
    start, ratios = _layout(token_to_kv_pool)
    kv_args.mla_compression_ratios = ratios
    draft = draft_token_to_kv_pool
    if isinstance(token_to_kv_pool, BaseSWAKVPool):
        _add_swa(kv_args, token_to_kv_pool)
        if hasattr(token_to_kv_pool, "get_request_state_buf_infos"):
            infos = token_to_kv_pool.get_request_state_buf_infos()
            kv_args.add_state(StateType.C128_STATE, infos, request_state_labels(len(infos[0]), start, ratios),
                              mem_kind_of(token_to_kv_pool))
        if draft is not None:
            if not isinstance(draft, BaseSWAKVPool):
                raise ValueError(f"sparsekv: the draft pool of an SWA target must be an SWA pool, got "
                                 f"{type(draft).__name__}")
            _add_swa(kv_args, draft, prefix="draft.")
    elif isinstance(token_to_kv_pool, HybridLinearStatePool):
        infos = token_to_kv_pool.get_state_buf_infos()
        kv_args.add_state(StateType.MAMBA, infos, positional_labels("mamba", len(infos[0])),
                          mem_kind_of(token_to_kv_pool))
        if draft is not None:
            raise ValueError("sparsekv: draft pools of hybrid-linear targets are not supported by PD transfer")
    elif isinstance(token_to_kv_pool, DSAStatePool):
        ptrs, lens, items = (list(x) for x in token_to_kv_pool.get_state_buf_infos())
        labels = positional_labels("dsa", len(ptrs))
        if draft is not None:
            if not isinstance(draft, DSAStatePool):
                raise ValueError(f"sparsekv: the draft pool of a DSA target must be a DSA pool, got "
                                 f"{type(draft).__name__}")
            d_ptrs, d_lens, d_items = (list(x) for x in draft.get_state_buf_infos())
            ptrs, lens, items = ptrs + d_ptrs, lens + d_lens, items + d_items
            labels += positional_labels("draft.dsa", len(d_ptrs))
        kv_args.add_state(StateType.DSA, (ptrs, lens, items), labels, mem_kind_of(token_to_kv_pool))
    elif draft is not None:
        raise ValueError(f"sparsekv: a draft pool ({type(draft).__name__}) beside a target without state "
                         f"({type(token_to_kv_pool).__name__}) is not supported by PD transfer")


def kv_args_of(token_to_kv_pool, draft_token_to_kv_pool=None, *, attn_tp_size: int = 1, attn_tp_rank: int = 0,
               is_mla: bool = True) -> KVArgs:
    """``KVArgs`` of a pool: its KV regions (``get_contiguous_buf_infos``), layers, page size and
    state components (:func:`setup_state_kv_args`).

    Parameters
    ----------
    token_to_kv_pool
        Any pool with ``get_contiguous_buf_infos``; DSV4 pools also give their layers and ratios.
    draft_token_to_kv_pool : optional
        The speculative draft's pool, whose state travels as an extra component.
    attn_tp_size, attn_tp_rank : int
        This side's attention TP.
    is_mla : bool
        Whether the KV is MLA.

    Raises
    ------
    ValueError
        A region list that does not match the pool's layer layout; bad TP values.
    """
    if not 0 <= attn_tp_rank < attn_tp_size:
        raise ValueError(f"sparsekv: arguments `attn_tp_rank` ({attn_tp_rank}) and `attn_tp_size` ({attn_tp_size}) "
                         "must satisfy 0 <= rank < size")
    ptrs, lens, item_lens = (list(x) for x in token_to_kv_pool.get_contiguous_buf_infos())
    kind = mem_kind_of(token_to_kv_pool)
    ratios = getattr(token_to_kv_pool, "stage_compress_ratios", None)
    start = getattr(token_to_kv_pool, "start_layer", 0)
    end = getattr(token_to_kv_pool, "end_layer", start + (len(ratios) if ratios is not None else 0))
    labels = kv_labels(len(ptrs), start, ratios)
    check_region_list("KV", ptrs, lens, item_lens, labels, kind)
    args = KVArgs(kv_data_ptrs=ptrs, kv_data_lens=lens, kv_item_lens=item_lens, kv_labels=labels,
                  kv_mem_kinds=[kind] * len(ptrs), layers=(start, end),
                  page_size=getattr(token_to_kv_pool, "page_size", 1), attn_tp_size=attn_tp_size,
                  attn_tp_rank=attn_tp_rank, is_mla=is_mla, owners=[token_to_kv_pool])
    setup_state_kv_args(args, token_to_kv_pool, draft_token_to_kv_pool)
    return args

"""PD with HiSparse on the decode side: C4 KV written straight into the decode's host memory.

With HiSparse the decode keeps every request's C4 KV in the host pool
(:class:`~sparsekv.srt.mem_cache.dsv4_paged_host_pool.DeepSeekV4PagedHostPool`) and only hot
buffers on the device, so the prefill writes the C4 KV page rows directly into host pages instead
of device pages that would be backed up and freed again. The decode side registers

* the host pool's per-layer regions (``get_contiguous_buf_infos``, memory kind DRAM) in place of
  the device C4 KV regions; one host row is one C4 page (64 entries = one 256-token page), the
  same item size as the prefill's device row;
* the remaining device regions of the pool (C4 indexer, C128 KV);
* the state components as without HiSparse (SWA path, C128 state).

The C4 KV regions keep their ``c4_kv:<layer>`` labels, so PP stages still write exactly their own
layers, and take the host pages as their own destination indices (``kv_group_indices``); every
other region takes the logical full-token pages. When a room has arrived the scheduler calls
``HiSparseCoordinator.admit_request_direct``.
"""

from __future__ import annotations

from sparsekv.srt.disaggregation.kv_args import KVArgs
from sparsekv.srt.disaggregation.state_routing import kv_args_of

C4_KV_GROUP = "c4_kv"


def hisparse_decode_kv_args(token_to_kv_pool, coordinator, draft_token_to_kv_pool=None, *, attn_tp_size: int = 1,
                            attn_tp_rank: int = 0, is_mla: bool = True) -> KVArgs:
    """The decode side's ``KVArgs`` with the C4 KV regions in the coordinator's host pool.

    Parameters
    ----------
    token_to_kv_pool : DeepSeekV4TokenToKVPool
        The decode's device pool (its indexer, C128 and state regions are used as they are).
    coordinator : HiSparseCoordinator
        Its ``mem_pool_host`` (layer-first) holds one region per C4 layer of the pool.
    draft_token_to_kv_pool, attn_tp_size, attn_tp_rank, is_mla
        As for :func:`~.kv_args.kv_args_of`.

    Raises
    ------
    ValueError
        The host pool's layers or row size do not match the pool's C4 KV regions, or the host
        pool is not layer-first.
    """
    args = kv_args_of(token_to_kv_pool, draft_token_to_kv_pool, attn_tp_size=attn_tp_size,
                      attn_tp_rank=attn_tp_rank, is_mla=is_mla)
    c4 = [i for i, label in enumerate(args.kv_labels) if label.split(":", 1)[0] == C4_KV_GROUP]
    host_ptrs, host_lens, host_items = (list(x) for x in coordinator.mem_pool_host.get_contiguous_buf_infos())
    if len(host_ptrs) != len(c4):
        raise ValueError(f"sparsekv: the HiSparse host pool has {len(host_ptrs)} layers, the pool {len(c4)} C4 layers")
    for i, item in zip(c4, host_items):
        if item != args.kv_item_lens[i]:
            raise ValueError(f"sparsekv: HiSparse host rows are {item} B, the pool's C4 KV pages "
                             f"{args.kv_item_lens[i]} B: one host row must hold one C4 page")
    for i, ptr, nbytes, item in zip(c4, host_ptrs, host_lens, host_items):
        args.kv_data_ptrs[i], args.kv_data_lens[i], args.kv_item_lens[i] = ptr, nbytes, item
        args.kv_mem_kinds[i] = "DRAM"
    args.owners.append(coordinator.mem_pool_host)
    return args


def alloc_direct_host_pages(coordinator, req, num_kv_pages: int) -> list[int]:
    """Host pages receiving a request's C4 KV: one per full-token KV page the prefill sends.

    Allocates ``num_kv_pages`` whole host pages for the request's C4 positions ``0 ..`` through
    ``HiSparseCoordinator.alloc_direct_host_slots`` (they stay the request's until
    ``request_finished``).

    Returns
    -------
    list of int
        Host page ids, in position order.

    Raises
    ------
    HostPoolExhaustedError
        Not enough free host pages; nothing was allocated.
    """
    slots = coordinator.alloc_direct_host_slots(req, num_kv_pages * coordinator.mem_pool_host.page_slots)
    pages = slots.whole_pages(coordinator.mem_pool_host.page_slots)
    return [] if pages is None else pages.tensor.tolist()

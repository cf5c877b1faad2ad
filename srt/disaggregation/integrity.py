"""End-to-end integrity of a room: a digest per region, computed on the prefill, checked on the decode.

A transfer the engine reports as a success can still have delivered wrong bytes: a notification
that overtakes its data, a write that went to another process (two deployments on one host), a
room mix-up. The check is end to end: for every region a room touches, the prefill hashes the
items it sends, in the order of its index list, and reports the digests with the room's status;
the decode hashes the items it received, in the order of its own index list (the transfer maps
source item ``s[k]`` to destination item ``d[k]``, so both concatenations are the same bytes), and
fails the room on any difference, naming the region.

The hash is xxHash's XXH3-64 (the ``xxhash`` package): some 20 GB/s on one core, so it costs a
fraction of the copy it checks (``tools/bench/bench_pd_transfer.py`` reports the cost). Host
memory (``DRAM``) regions are hashed in place; a device region (``VRAM``) is skipped (its digest
would need a device kernel) and the status says which regions were checked.
"""

from __future__ import annotations

import ctypes

import numpy as np
import xxhash

from sparsekv.srt.disaggregation.manifest import Region

#: Items hashed per step: bounds the temporary copy of gathered items.
_CHUNK_BYTES = 8 << 20


def region_digest(region: Region, indices) -> int:
    """XXH3-64 of items ``indices`` of a host ``region``, concatenated in index order.

    Raises
    ------
    IndexError
        An index outside the region.
    """
    items = region.nbytes // region.item_len
    memory = (ctypes.c_uint8 * (items * region.item_len)).from_address(region.ptr)
    table = np.frombuffer(memory, dtype=np.uint8).reshape(items, region.item_len)
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= items):
        raise IndexError(f"sparsekv: an index of region {region.label!r} is outside its {items} items")
    state = xxhash.xxh3_64()
    step = max(1, _CHUNK_BYTES // region.item_len)
    for start in range(0, idx.size, step):
        state.update(np.ascontiguousarray(table[idx[start:start + step]]))
    return state.intdigest()


def room_digests(components: list[tuple[str, list[Region]]], kv_indices, kv_group_indices: dict,
                 state_indices: list, only: set[str] | None = None) -> dict[str, int]:
    """``{"<component>/<label>": digest}`` of the host regions of a room (of the keys in ``only``).

    ``components`` is one side's manifest components (``kv`` first, then each state component);
    ``kv_group_indices`` gives a KV region group (label prefix before ``:``) its own index list.

    Raises
    ------
    IndexError
        An index outside its region, or fewer state index lists than components.
    """
    digests = {}
    for c, (name, regions) in enumerate(components):
        for region in regions:
            key = f"{name}/{region.label}"
            if region.mem_kind != "DRAM" or (only is not None and key not in only):
                continue
            if c == 0:
                indices = kv_group_indices.get(region.label.split(":", 1)[0], kv_indices)
            else:
                indices = state_indices[c - 1]
            digests[key] = region_digest(region, indices)
    return digests


def mismatched(expected: dict[str, int], got: dict[str, int]) -> list[str]:
    """The regions whose digests differ (or are missing on one side), sorted."""
    return sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))

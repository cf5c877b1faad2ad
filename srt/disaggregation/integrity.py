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
memory (``DRAM``) regions are hashed in place: a run of consecutive items (a paged allocator's
pages) is one contiguous span, hashed without a copy, and only many short runs are gathered
first. A large room's regions are hashed on a few threads side by side (xxhash releases the GIL
on large buffers). A
device region (``VRAM``) is skipped (its digest would need a device kernel) and the status says
which regions were checked.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import xxhash

from sparsekv.srt.disaggregation.manifest import Region

#: Items hashed per step: bounds the temporary copy of gathered items.
_CHUNK_BYTES = 8 << 20
#: Runs of consecutive items at least this long on average are hashed in place; shorter ones are
#: gathered first (one Python call per run would cost more than the copy).
_MIN_RUN_BYTES = 64 << 10
#: A room's regions are hashed on one more thread per this many bytes (up to :data:`_HASH_THREADS`);
#: a smaller room is hashed by the caller (handing it to a thread would cost more than it saves).
_BYTES_PER_THREAD = 16 << 20
_HASH_THREADS = min(4, os.cpu_count() or 1)


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    """The threads that hash a large room's regions side by side (one process-wide pool)."""
    return ThreadPoolExecutor(max_workers=_HASH_THREADS, thread_name_prefix="sparsekv-digest")


class ItemRuns(NamedTuple):
    """An index list as the runs of consecutive items it names, in order (computed once per list
    and shared by every region the list indexes: a room's KV regions all take its page list)."""

    indices: np.ndarray  # int64
    starts: list[int]
    lengths: list[int]
    lowest: int
    highest: int

    @classmethod
    def of(cls, indices) -> ItemRuns:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size == 0:
            return cls(idx, [], [], 0, -1)
        first = np.concatenate(([0], np.flatnonzero(np.diff(idx) != 1) + 1))
        lengths = np.diff(np.concatenate((first, [idx.size])))
        return cls(idx, idx[first].tolist(), lengths.tolist(), int(idx.min()), int(idx.max()))


@functools.lru_cache(maxsize=1024)
def _region_bytes(ptr: int, nbytes: int) -> memoryview:
    """A region's bytes, viewed where they lie (one view per region, not one per room)."""
    return memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)).cast("B")


def region_digest(region: Region, indices) -> int:
    """XXH3-64 of items ``indices`` of a host ``region``, concatenated in index order.

    ``indices`` may be an :class:`ItemRuns` already made of them.

    Raises
    ------
    IndexError
        An index outside the region.
    """
    runs = indices if isinstance(indices, ItemRuns) else ItemRuns.of(indices)
    size = region.item_len
    items = region.nbytes // size
    if runs.lowest < 0 or runs.highest >= items:
        raise IndexError(f"sparsekv: an index of region {region.label!r} is outside its {items} items")
    memory = _region_bytes(region.ptr, items * size)
    state = xxhash.xxh3_64()
    if runs.indices.size * size >= _MIN_RUN_BYTES * len(runs.starts):
        for first, n in zip(runs.starts, runs.lengths):
            state.update(memory[first * size : (first + n) * size])  # contiguous: hashed where it lies
        return state.intdigest()
    table = np.frombuffer(memory, dtype=np.uint8).reshape(items, size)
    step = max(1, _CHUNK_BYTES // size)
    for start in range(0, runs.indices.size, step):
        state.update(np.ascontiguousarray(table[runs.indices[start:start + step]]))
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
    return start_room_digests(components, kv_indices, kv_group_indices, state_indices, only)()


def _hash_regions(work: list[tuple[str, Region, ItemRuns]]) -> dict[str, int]:
    return {key: region_digest(region, indices) for key, region, indices in work}


def start_room_digests(components: list[tuple[str, list[Region]]], kv_indices, kv_group_indices: dict,
                       state_indices: list, only: set[str] | None = None) -> Callable[[], dict[str, int]]:
    """:func:`room_digests`, started: a large room's regions are hashed on the hashing threads,
    side by side, while the caller goes on (e.g. reads the next request), a small room's at once.

    Returns
    -------
    callable
        Waits for the digests and returns :func:`room_digests`' dict (raising what it raises).

    Raises
    ------
    IndexError
        Fewer state index lists than components, or (a small room) an index outside its region.
    """
    work = []
    runs: dict[int, ItemRuns] = {}  # id(index list) -> its runs: regions that share a list share them
    for c, (name, regions) in enumerate(components):
        for region in regions:
            key = f"{name}/{region.label}"
            if region.mem_kind != "DRAM" or (only is not None and key not in only):
                continue
            if c == 0:
                indices = kv_group_indices.get(region.label.split(":", 1)[0], kv_indices)
            else:
                indices = state_indices[c - 1]
            if id(indices) not in runs:
                runs[id(indices)] = ItemRuns.of(indices)
            work.append((key, region, runs[id(indices)]))
    sizes = [r.indices.size * region.item_len for _, region, r in work]
    threads = min(_HASH_THREADS, sum(sizes) // _BYTES_PER_THREAD)
    if threads <= 1:
        digests = _hash_regions(work)
        return lambda: digests
    shares: list[list] = [[] for _ in range(threads)]
    loads = [0] * threads
    for size, item in sorted(zip(sizes, work), key=lambda p: -p[0]):  # largest first, onto the lightest share
        lightest = loads.index(min(loads))
        shares[lightest].append(item)
        loads[lightest] += size
    jobs = [_hash_pool().submit(_hash_regions, share) for share in shares]
    return lambda: {key: digest for job in jobs for key, digest in job.result().items()}


def mismatched(expected: dict[str, int], got: dict[str, int]) -> list[str]:
    """The regions whose digests differ (or are missing on one side), sorted."""
    return sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))

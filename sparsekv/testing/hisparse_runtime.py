"""Helpers for tests of the HiSparse runtime (allocator, pools, coordinator).

:func:`entry_bytes` is the deterministic content a test's "model" writes for each C4 entry, so any
slot can be checked against the entry it should hold.

A rejected call must leave every allocator, table, queue and byte as it was. :func:`snapshot`
copies all of it from a :class:`~sparsekv.srt.managers.hisparse_coordinator.HiSparseCoordinator`
(and the allocator, device pool and host pool it drives) plus the scheduler's ``req_to_token``;
:func:`changed` names the parts that differ between two snapshots.

Example
-------
>>> before = snapshot(coord, req_to_token)
>>> with pytest.raises(IndexError):
...     coord.map_last_loc_to_buffer([0], [28], [-4])
>>> assert changed(before, snapshot(coord, req_to_token)) == []
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Req:
    """The scheduler's view of a request that the coordinator reads: its row, its KV length, an id."""

    req_pool_idx: int
    kv_allocated_len: int
    uid: int


@dataclass
class ReqToTokenPool:
    """The scheduler's request-to-token table, as the coordinator takes it."""

    req_to_token: torch.Tensor


def entry_bytes(uid: int, pos: int, layer: int) -> torch.Tensor:
    """The 584 bytes of C4 entry ``pos`` of layer ``layer`` of request ``uid`` (a fixed pseudo-random pattern)."""
    gen = torch.Generator().manual_seed(uid * 1_000_003 + pos * 31 + layer)
    return torch.randint(0, 256, (584,), dtype=torch.uint8, generator=gen)


def _copy(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def snapshot(coord, req_to_token: torch.Tensor) -> dict[str, object]:
    """Copies of every piece of state a runtime call may change, by name."""
    a, host, c = coord.allocator, coord.mem_pool_host, coord
    pages = {"logical": a.logical, "device": a.device_alloc, "host": host.page_alloc}
    parts = {
        **{f"{name}.{part}": value for name, alloc in pages.items()
           for part, value in (("free", alloc._free), ("released", list(alloc._released)),
                               ("owned", alloc._owned_mask), ("owner", alloc._owner))},
        "held_rows": dict(a._held_rows),
        "mapping": a.full_to_hisparse_device_index_mapping, "req_to_token": req_to_token,
        "req_to_host_pool": c.req_to_host_pool, "host_allocated_len": c.req_to_host_pool_allocated_len,
        "req_to_device_buffer": c.req_to_device_buffer, "buffer_tokens": c.req_device_buffer_tokens,
        "buffer_token_locs": c.req_device_buffer_token_locs, "lru_slots": c.lru_slots,
        "top_k_device_locs": c.top_k_device_locs_buffer,
        "resident_indexes": [t for index in c.resident_indexes or () for t in (index.slot_of, index.queue,
                                                                             index.queue_pos)],
        "phases": {rid: (s.phase, s.skip_first_backup) for rid, s in c._reqs.items()},
        "staging_queue": [(id(event), q.req_pool_idx) for event, q in c.ack_staging_queue],
        "pending_backup": id(c._pending_backup) if c._pending_backup is not None else None,
        "device_bytes": list(coord.device_pool.kv_buffer), "host_bytes": host.buffer,
    }
    return {name: _copy(value) for name, value in parts.items()}


def _equal(x: object, y: object) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, list):
        return isinstance(y, list) and len(x) == len(y) and all(_equal(p, q) for p, q in zip(x, y))
    return x == y


def resident_index_disagreements(coord) -> list[tuple[int, int]]:
    """``(layer, request row)`` of every row whose resident index disagrees with the coordinator's
    slot tokens (empty when the coordinator runs the scanning kernel)."""
    rows = coord.req_device_buffer_tokens.shape[1]
    return [(layer, rid) for layer, index in enumerate(coord.resident_indexes or ()) for rid in range(rows)
            if not index.agrees_with(rid, coord.req_device_buffer_tokens[layer])]


def changed(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """Names of the parts that differ between two :func:`snapshot` results (empty: nothing changed)."""
    return [name for name in before if not _equal(before[name], after[name])]

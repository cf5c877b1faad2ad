"""A PD session: a loopback prefill -> decode transfer of DSV4 pools, checked byte for byte
(``sparsekv pd-demo`` runs it; the PD tests run it with faults injected).

Two processes on 127.0.0.1 (spawned; every wait bounded by ``DemoSpec.timeout_s``), over one engine
of :data:`~sparsekv.srt.disaggregation.engines.ENGINES` (one whose listeners bind every interface,
Mooncake, is best run in a private network namespace, e.g. ``unshare -rn``):

* **prefill** -- one :class:`~sparsekv.srt.disaggregation.sender.KVSender` per PP stage, each over its stage's
  ``DeepSeekV4TokenToKVPool`` filled with seeded random bytes (each region's bytes follow from the
  seed and the region's label, so the other side can recompute them);
* **decode** -- one pool holding every layer (optionally with HiSparse: C4 KV straight into the
  host pool, then ``admit_request_direct``), filled with other random bytes, and a
  :class:`~sparsekv.srt.disaggregation.receiver.KVReceiver` connected to every stage.

Several requests of different lengths are transferred (KV pages, SWA pages with their C4 rings,
the request's C128 rings). The decode then rebuilds what every registered region must hold --
its own bytes, with each transferred item replaced by the prefill's -- and compares every byte,
so a missing, misplaced or stray write is found (:func:`verdict`).

Faults to inject are fields of :class:`DemoSpec`: a decode of another state dtype or TP size, rooms
with a bad index length, a decode the prefill kills after N completed batches.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import secrets
import select
import signal
import threading
import time
import zlib
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import numpy as np

from sparsekv.srt.disaggregation.engines import DEFAULT_ENGINE


@dataclass(frozen=True)
class DemoSpec:
    """One demo session: model, pools, requests, and the faults to inject (tests)."""

    num_layers: int = 6
    budget_mib: int = 48
    pp_size: int = 2
    hisparse: bool = False
    seq_lens: tuple[int, ...] = (1000, 3000, 700, 5000)
    seed: int = 0
    timeout_s: float = 30.0
    max_batch_rows: int = 16384
    max_inflight: int = 4
    max_running_requests: int = 4
    #: Decode built with another compressor-state dtype: a manifest mismatch.
    decode_state_dtype: str | None = None
    #: Attention TP of the decode side (the prefill has 1); with ``is_mla=False`` a TP mismatch.
    decode_attn_tp_size: int = 1
    is_mla: bool = True
    #: Rooms whose decode asks for one SWA destination too many: an index-length mismatch.
    bad_rooms: tuple[int, ...] = ()
    #: The prefill kills the decode after this many completed batches (0: never).
    kill_decode_after: int = 0
    #: Transfer engine of both sides (:data:`~sparsekv.srt.disaggregation.engines.ENGINES`).
    engine: str = DEFAULT_ENGINE
    #: The session's shared secret (docs/pd.md, "PD trust model"); :func:`run_session` draws one when empty.
    secret: str = ""
    #: The decode verifies every region's digest (:mod:`~sparsekv.srt.disaggregation.integrity`).
    checksums: bool = True


# ---- pools and regions ---------------------------------------------------------------------------


def _server(spec: DemoSpec, *, hisparse: bool = False, state_dtype: str | None = None):
    from sparsekv.srt.model_executor.model_spec import ServerSpec

    kwargs = {"max_running_requests": spec.max_running_requests, "enable_hisparse": hisparse}
    if state_dtype is not None:
        kwargs["compress_state_dtype"] = state_dtype
    return ServerSpec(**kwargs)


def _model(spec: DemoSpec):
    from sparsekv.srt.model_executor.model_spec import dsv4_preset

    return dsv4_preset("dsv4-flash", num_hidden_layers=spec.num_layers)


def prefill_pools(spec: DemoSpec) -> list:
    """One pool per PP stage."""
    from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
    from sparsekv.srt.model_executor.pool_planner import plan_pipeline

    plan = plan_pipeline(_model(spec), _server(spec), spec.budget_mib << 20, spec.pp_size)
    return [DeepSeekV4TokenToKVPool(r.config, r.configurator, device="cpu") for r in plan.ranks]


def decode_pool(spec: DemoSpec):
    """The decode's pool (every layer) and its final config."""
    from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
    from sparsekv.srt.model_executor.pool_planner import plan_pipeline

    server = _server(spec, hisparse=spec.hisparse, state_dtype=spec.decode_state_dtype)
    rank = plan_pipeline(_model(spec), server, spec.budget_mib * spec.pp_size << 20, 1).ranks[0]
    return DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device="cpu"), rank.config


def region_array(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 numpy view of host memory ``[ptr, ptr + nbytes)`` (a registered region)."""
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


def label_bytes(label: str, nbytes: int, seed: int) -> np.ndarray:
    """The seeded random contents of a region: a function of the seed and the label only."""
    return np.frombuffer(np.random.default_rng([seed, zlib.crc32(label.encode())]).bytes(nbytes), dtype=np.uint8)


def _regions(kv_args) -> list[tuple[str, int, int]]:
    """``(label, ptr, nbytes)`` of every region (labels are unique per component, so prefix them)."""
    out = [(f"kv/{lb}", p, n) for lb, p, n in zip(kv_args.kv_labels, kv_args.kv_data_ptrs, kv_args.kv_data_lens)]
    for c, (labels, ptrs, lens) in enumerate(zip(kv_args.state_labels, kv_args.state_data_ptrs,
                                                  kv_args.state_data_lens)):
        out += [(f"{c + 1}/{lb}", p, n) for lb, p, n in zip(labels, ptrs, lens)]
    return out


def fill_regions(kv_args, seed: int) -> None:
    """Write :func:`label_bytes` into every region."""
    for label, ptr, nbytes in _regions(kv_args):
        region_array(ptr, nbytes)[:] = label_bytes(label, nbytes, seed)


# ---- the request plan ----------------------------------------------------------------------------


class _Free:
    """Free indices ``1 .. capacity - 1`` (0 is the reserved page/slot everywhere)."""

    def __init__(self, capacity: int) -> None:
        self.free = np.ones(max(capacity, 1), dtype=bool)
        self.free[0] = False

    def run(self, n: int) -> list[int]:
        """The lowest ``n`` consecutive free indices."""
        start = 1
        while start + n <= self.free.size:
            window = self.free[start : start + n]
            if window.all():
                self.free[start : start + n] = False
                return list(range(start, start + n))
            start += int(np.flatnonzero(~window)[-1]) + 1
        raise ValueError(f"sparsekv: pd-demo pools too small for a run of {n}")

    def scattered(self, n: int, rng: np.random.Generator) -> list[int]:
        """``n`` random free indices, in random order."""
        choice = rng.permutation(np.flatnonzero(self.free))[:n]
        if choice.size < n:
            raise ValueError(f"sparsekv: pd-demo pools too small for {n} more indices")
        self.free[choice] = False
        return [int(i) for i in choice]


def _region_items(kv_args, component: int) -> list[int]:
    """Items each region of a component holds (component 0: the KV, then each state type)."""
    if component == 0:
        return [n // i for n, i in zip(kv_args.kv_data_lens, kv_args.kv_item_lens)]
    return [n // i for n, i in zip(kv_args.state_data_lens[component - 1], kv_args.state_item_lens[component - 1])]


def item_counts(seq_len: int, n_states: int) -> list[int]:
    """Items a request of ``seq_len`` tokens moves per component: its KV pages, the SWA pages of
    its last window (at most two 256-token pages), one request slot."""
    pages = math.ceil(seq_len / 256)
    return [pages, min(pages, 2), 1][: n_states + 1]


def index_spaces(sides: list, seq_lens) -> list[int]:
    """Per component, how many indices the plan draws its items from: the items every region of
    the component holds on every side (``sides``: each side's kv args), or, where no side has a
    region of it (no layer of its kind), one more than the requests ask for: no byte moves, the
    indices only need to be distinct. So the plan's free lists never outgrow the pools."""
    n_states = len(sides[-1].state_types)
    demand = np.sum([item_counts(n, n_states) for n in seq_lens], axis=0)
    spaces = []
    for c in range(n_states + 1):
        items = [n for a in sides for n in _region_items(a, c)]
        spaces.append(min(items) if items else int(demand[c]) + 1)
    return spaces


def plan_sides(spec: DemoSpec) -> list:
    """The kv args of every prefill stage, then the decode's (of a decode that matches the prefill).

    Raises
    ------
    ValueError
        ``spec.hisparse`` with no C4 layer among the model's layers (HiSparse holds C4 KV only).
    """
    from sparsekv.srt.disaggregation.state_routing import kv_args_of

    if spec.hisparse and spec.num_layers <= first_c4_layer(spec):
        raise ValueError(f"sparsekv: pd-demo: a HiSparse decode needs a C4 layer, and the model's first is layer "
                         f"{first_c4_layer(spec)}: argument `num_layers` ({spec.num_layers}) holds none")
    dec_pool, _ = decode_pool(replace(spec, decode_state_dtype=None))
    return [kv_args_of(p) for p in prefill_pools(spec)] + [kv_args_of(dec_pool)]


def first_c4_layer(spec: DemoSpec) -> int:
    """The model's first C4 layer: a HiSparse decode (C4 KV only) needs more layers than this."""
    return _model(spec).compress_ratios.index(4)


def make_plan(spec: DemoSpec) -> list[dict]:
    """Per request: room id, length, source and destination indices of the KV and each state component.

    Sources are runs of pages (a prefill allocator's pages); destinations alternate between runs
    and scattered indices, so both the coalesced and the one-item writes happen.

    Raises
    ------
    ValueError
        From :func:`plan_sides`.
    """
    sides = plan_sides(spec)
    n_states = len(sides[-1].state_types)
    rng = np.random.default_rng(spec.seed)
    spaces = index_spaces(sides, spec.seq_lens)
    src, dst = [_Free(n) for n in spaces], [_Free(n) for n in spaces]
    rooms = []
    for r, seq_len in enumerate(spec.seq_lens):
        room = {"room": r + 1, "seq_len": seq_len, "src": [], "dst": []}
        for c, n in enumerate(item_counts(seq_len, n_states)):
            room["src"].append(src[c].run(n))
            room["dst"].append(dst[c].run(n) if r % 2 == 0 else dst[c].scattered(n, rng))
        rooms.append(room)
    return rooms


# ---- the two roles -------------------------------------------------------------------------------


class Waits:
    """Every wait of one pd-demo process, each bounded by ``--timeout`` (``DemoSpec.timeout_s``).

    A role's work that takes longer than one wait (the decode: start, transfer, check) is a
    sequence of steps, each announced by a message, so no wait encloses another. ``log`` holds
    ``(what, seconds)`` of each wait as it was given to the operating system (every report carries
    it: tests check that none exceeds the timeout).
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.log: list[tuple[str, float]] = []

    def bound(self, what: str, deadline: float | None = None) -> float:
        """Seconds the wait for ``what`` may last: the timeout, or less to reach ``deadline``
        (``time.monotonic()``); logged."""
        seconds = self.timeout_s if deadline is None else min(self.timeout_s, max(0.0, deadline - time.monotonic()))
        self.log.append((what, seconds))
        return seconds

    def recv(self, conn, what: str, proc=None):
        """The next message on ``conn``, or ``None`` if process ``proc`` (its sender) ended first.

        Raises
        ------
        TimeoutError
            Neither within the timeout.
        """
        seconds = self.bound(what)
        ready = mp_connection.wait([conn] + ([proc.sentinel] if proc is not None else []), seconds)
        if conn.poll(0):
            try:
                return conn.recv()
            except EOFError:
                return None
        if ready:
            return None
        raise TimeoutError(f"sparsekv: pd-demo: no {what} within {seconds} s")

    def process_end(self, pid: int, what: str) -> bool:
        """Wait for process ``pid`` (not a child of this one) to end; whether it did."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        try:
            return bool(select.select([fd], [], [], self.bound(what))[0])
        finally:
            os.close(fd)

    def join(self, proc, what: str) -> None:
        """Join child process ``proc``, killing it if it has not ended within the timeout."""
        proc.join(self.bound(what))
        if proc.is_alive():
            proc.kill()
            proc.join(self.bound(f"{what} (killed)"))


def prefill_main(spec: DemoSpec, plan: list[dict], conn) -> None:
    """The prefill process: one sender per PP stage, every room declared, statuses reported.

    After its addresses it waits for the parent's messages, each within the timeout: the decode's
    pid, then the decode's steps as the parent relays them (``requested``, then ``arrived`` or
    ``gone``); then it gives each room a last moment to finish, closes and reports.
    """
    from sparsekv.srt.disaggregation.engines import open_backend
    from sparsekv.srt.disaggregation.room import RoomStatus
    from sparsekv.srt.disaggregation.sender import KVSender
    from sparsekv.srt.disaggregation.state_routing import kv_args_of

    waits = Waits(spec.timeout_s)
    decode_pid: dict[str, int] = {}
    batches_done = [0]
    events: dict[str, float] = {}

    def progress(room: int, done: int, total: int) -> None:
        batches_done[0] += 1
        if spec.kill_decode_after and batches_done[0] == spec.kill_decode_after and decode_pid:
            os.kill(decode_pid["pid"], signal.SIGKILL)
            events["killed"] = time.monotonic()
            waits.process_end(decode_pid["pid"], "the killed decode's end")

    senders, held = [], {}
    held_lock = threading.Lock()

    def on_done(r: int, ok: bool) -> None:  # a real scheduler frees the room's source pages here
        # Every stage's threads call this, at once when the stages refuse a room together.
        with held_lock:
            if not ok:
                events.setdefault("first_failure", time.monotonic())
            held[r] -= 1
            if held[r] == 0:
                del held[r]

    backend = None
    try:
        # One engine endpoint per process, shared by the stages it hosts (a real deployment runs
        # one process per stage; this demo hosts them all in one).
        backend = open_backend(spec.engine, f"prefill-{os.getpid()}", timeout_s=spec.timeout_s)
        for pool in prefill_pools(spec):
            args = kv_args_of(pool, is_mla=spec.is_mla)
            fill_regions(args, spec.seed)
            senders.append(KVSender(args, backend, timeout_s=spec.timeout_s, max_batch_rows=spec.max_batch_rows,
                                    max_inflight=spec.max_inflight, progress=progress, close_backend=False,
                                    secret=spec.secret or None))
        conn.send({"addresses": [s.address for s in senders]})
        decode_pid["pid"] = waits.recv(conn, "decode pid from the parent")["decode_pid"]
        for room in plan:
            with held_lock:
                held[room["room"]] = len(senders)
            for s in senders:
                s.add_request(room["room"], room["src"][0], room["src"][1:], on_done=on_done)
        t0 = time.perf_counter()
        step = None
        while step not in ("arrived", "done"):
            step = waits.recv(conn, f"decode step after {step or 'its start'} from the parent")["step"]
        # The decode is done: a room it received is finished here a moment later; the rest were never asked for.
        grace = time.monotonic() + min(1.0, spec.timeout_s)
        for s in senders:
            for room in plan:
                s.wait(room["room"], timeout_s=waits.bound(f"room {room['room']}'s end", grace))
        elapsed = time.perf_counter() - t0
        for s in senders:
            for room in plan:
                s.abort(room["room"], "sparsekv: the decode side never asked for this room")
        rooms = {}
        for room in plan:
            r = room["room"]
            statuses = [s.status(r) for s in senders]
            ok = all(st == RoomStatus.SUCCESS for st in statuses)
            rooms[r] = {"status": "success" if ok else "failed",
                        "error": "; ".join(s.error(r) for s in senders if s.error(r)),
                        "bytes": sum(s.stats(r)[0] for s in senders), "seconds": max(s.stats(r)[1] for s in senders)}
        open_handles = backend.open_handles
        refusals = [r for s in senders for r in s.refusals]
        for s in senders:
            s.close()
        backend.close()
        report = {"rooms": rooms, "elapsed": elapsed, "refusals": refusals, "open_handles": open_handles,
                  "registered_after_close": len(backend.registered),
                  "rooms_still_held": sorted(held), "waits": waits.log}
        if "killed" in events:
            report["failure_detected_after_kill_s"] = events.get("first_failure", float("inf")) - events["killed"]
        conn.send(report)
    except BaseException as e:
        for s in senders:
            s.close()
        if backend is not None:
            backend.close()
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def _expected_regions(manifests, snapshot: dict, requested: list[dict], seed: int) -> dict:
    """What every decode region must hold: its snapshot with each arrived room's items replaced
    (``manifests``: every prefill stage's)."""
    expected = {k: v.copy() for k, v in snapshot.items()}
    cache: dict[str, np.ndarray] = {}
    for manifest in manifests:
        for c, (_, regions) in enumerate(manifest.components):
            for region in regions:
                key = f"{'kv' if c == 0 else c}/{region.label}"
                if key not in cache:
                    cache[key] = label_bytes(key, region.nbytes, seed)
                item = region.item_len
                for room in requested:
                    src = room["src"][c]
                    dst = room["dst"][c]
                    if c == 0 and region.label.split(":", 1)[0] in room.get("groups", {}):
                        dst = room["groups"][region.label.split(":", 1)[0]]
                    for s, d in zip(src, dst):
                        expected[key][d * item : (d + 1) * item] = cache[key][s * item : (s + 1) * item]
    return expected


def decode_main(spec: DemoSpec, plan: list[dict], conn, addresses: list) -> None:
    """The decode process: allocate, request every room, wait, admit, verify every byte."""
    import torch

    from sparsekv.srt.disaggregation.backend import TransferError
    from sparsekv.srt.disaggregation.engines import open_backend
    from sparsekv.srt.disaggregation.hisparse_direct import alloc_direct_host_pages, hisparse_decode_kv_args
    from sparsekv.srt.disaggregation.manifest import ManifestMismatchError
    from sparsekv.srt.disaggregation.receiver import KVReceiver
    from sparsekv.srt.disaggregation.state_routing import kv_args_of

    waits = Waits(spec.timeout_s)
    pool, _ = decode_pool(spec)
    coord = allocator = req_table = None
    if spec.hisparse:
        from sparsekv.srt.managers.hisparse_coordinator import HiSparseCoordinator
        from sparsekv.srt.mem_cache.allocators import HiSparseTokenToKVPoolAllocator
        from sparsekv.srt.mem_cache.hisparse_device_pool import HiSparseC4DevicePool

        ratio = 2
        allocator = HiSparseTokenToKVPoolAllocator(pool.size // ratio, pool.page_size, host_to_device_ratio=ratio)
        num_c4 = sum(1 for r in pool.stage_compress_ratios if r == 4)
        device_pool = HiSparseC4DevicePool(allocator, num_c4, "cpu")
        req_table = SimpleNamespace(req_to_token=torch.zeros(len(plan) + 1, max(spec.seq_lens) + 256,
                                                             dtype=torch.int64))
        coord = HiSparseCoordinator(req_table, allocator, device_pool, num_top_k=16, hot_buffer_size=64)
        args = hisparse_decode_kv_args(pool, coord, attn_tp_size=spec.decode_attn_tp_size, is_mla=spec.is_mla)
    else:
        args = kv_args_of(pool, attn_tp_size=spec.decode_attn_tp_size, is_mla=spec.is_mla)
    decode_seed = spec.seed + 1_000_003
    fill_regions(args, decode_seed)
    snapshot = {label: region_array(p, n).copy() for label, p, n in _regions(args)}
    result: dict = {"rooms": {}}
    try:
        receiver = KVReceiver(args, open_backend(spec.engine, f"decode-{os.getpid()}", timeout_s=spec.timeout_s),
                              addresses, timeout_s=spec.timeout_s, secret=spec.secret or None,
                              checksums=spec.checksums)
    except ManifestMismatchError as e:
        result["refused"] = str(e)
        result["unchanged"] = all(np.array_equal(region_array(p, n), snapshot[lb]) for lb, p, n in _regions(args))
        result["waits"] = waits.log
        conn.send(result)
        return
    requested, reqs = [], {}
    t0 = time.perf_counter()
    for slot, room in enumerate(plan, start=1):
        room = dict(room, dst=[list(d) for d in room["dst"]])
        if spec.hisparse:
            req = SimpleNamespace(req_pool_idx=slot, kv_allocated_len=room["seq_len"])
            full = allocator.alloc_extend(req_table.req_to_token, slot, 0, room["seq_len"], with_device=False)
            room["dst"][0] = [int(p) for p in torch.unique_consecutive(full // pool.page_size)]
            room["groups"] = {"c4_kv": alloc_direct_host_pages(coord, req, len(room["dst"][0]))}
            reqs[room["room"]] = req
        if room["room"] in spec.bad_rooms:
            room["dst"][1] = room["dst"][1] + [room["dst"][1][-1] + 1]
        receiver.request(room["room"], room["dst"][0], room["dst"][1:], room.get("groups"))
        requested.append(room)
    conn.send({"step": "requested"})
    arrived = []
    deadline = time.monotonic() + spec.timeout_s  # every room within the timeout of the requests
    for room in requested:
        r = room["room"]
        try:
            receiver.wait(r, timeout_s=waits.bound(f"room {r}'s arrival", deadline))
            result["rooms"][r] = {"status": "success", "error": ""}
            arrived.append(room)
            if spec.hisparse:
                coord.admit_request_direct(reqs[r])
        except TransferError as e:
            result["rooms"][r] = {"status": "failed", "error": str(e)}
    result["elapsed"] = time.perf_counter() - t0
    manifests = receiver.stage_manifests
    receiver.close()
    conn.send({"step": "arrived"})
    expected = _expected_regions(manifests, snapshot, arrived, spec.seed)
    mismatched = {}
    for label, ptr, nbytes in _regions(args):
        bad = int(np.count_nonzero(region_array(ptr, nbytes) != expected[label]))
        if bad:
            mismatched[label] = bad
    result["mismatched"] = mismatched
    result["regions_checked"] = len(expected)
    result["bytes_checked"] = int(sum(v.size for v in expected.values()))
    if spec.hisparse:
        result["admitted"] = sorted(r for r in reqs if result["rooms"][r]["status"] == "success")
        result["hot_entries_checked"], result["hot_entries_wrong"] = _check_hot_buffers(
            coord, [reqs[r] for r in result["admitted"]])
    result["waits"] = waits.log
    conn.send(result)


def _check_hot_buffers(coord, reqs) -> tuple[int, int]:
    """After ``admit_request_direct``: the C4 entries preloaded into each request's hot buffer (all
    of them when they fit, else the newest one in column ``H``) equal the host entries, every layer."""
    import torch

    from sparsekv.kv_layout import V4

    def entry(cache, slot: int):
        page, offset = divmod(slot, coord.page_slots)
        return torch.cat([V4.value_view(cache, coord.page_slots)[page, offset],
                          V4.scale_view(cache, coord.page_slots)[page, offset]])

    checked = wrong = 0
    hot = coord.hot_buffer_size
    for req in reqs:
        rid, n = req.req_pool_idx, coord.host_token_len(req.kv_allocated_len)
        host = coord.req_to_host_pool[rid].tolist()
        buffer = coord.req_to_device_buffer[rid].tolist()
        pairs = list(zip(host[:n], buffer[:n])) if n <= hot else [(host[n - 1], buffer[hot])]
        for layer in range(coord.device_pool.layer_num):
            for host_slot, device_slot in pairs:
                checked += 1
                wrong += not torch.equal(entry(coord.mem_pool_host.kv_buffer[layer], host_slot),
                                         entry(coord.device_pool.kv_buffer[layer], device_slot))
    return checked, wrong


def _role(target, spec, plan, conn, *extra) -> None:
    try:
        target(spec, plan, conn, *extra)
    finally:
        conn.close()


def reap(*procs, timeout_s: float = 10.0) -> None:
    """Join each started process (``None`` skipped), killing one that has not ended within ``timeout_s``."""
    waits = Waits(timeout_s)
    for proc in procs:
        if proc is not None:
            waits.join(proc, f"process {proc.name}")


def run_session(spec: DemoSpec) -> dict:
    """Run one prefill process and one decode process; the two sides' reports.

    Every wait of the three processes is bounded by ``spec.timeout_s``: this one relays the
    decode's steps (``requested``, ``arrived``; ``done`` when it reported or ended without
    ``arrived``) to the prefill, so neither waits for the other's whole run at once.

    Returns
    -------
    dict
        ``{"spec", "plan", "prefill", "decode", "waits"}``; ``decode`` is ``{"killed": True}`` when
        the decode process was killed; ``waits`` is this process's :attr:`Waits.log`.

    Raises
    ------
    RuntimeError
        The prefill failed before it listened.
    TimeoutError
        A role did not send its next message within the timeout.
    """
    if not spec.secret:  # one per session: another deployment on this host cannot claim its rooms
        spec = replace(spec, secret=secrets.token_hex(16))
    plan = make_plan(spec)
    waits = Waits(spec.timeout_s)
    ctx = mp.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    d_parent, d_child = ctx.Pipe()
    prefill = ctx.Process(target=_role, args=(prefill_main, spec, plan, p_child), name="prefill", daemon=True)
    prefill.start()
    decode = None
    try:
        addresses = waits.recv(p_parent, "prefill addresses", prefill)
        if addresses is None or "error" in addresses:
            raise RuntimeError(f"sparsekv: pd-demo prefill failed: {(addresses or {}).get('error', 'it ended')}")
        decode = ctx.Process(target=_role, args=(decode_main, spec, plan, d_child, addresses["addresses"]),
                             name="decode", daemon=True)
        decode.start()
        p_parent.send({"decode_pid": decode.pid})
        decode_report, step = None, None
        while decode_report is None:
            message = waits.recv(d_parent, f"decode message after {step or 'its start'}", decode)
            if message is None:
                decode.join(waits.bound("the ended decode's exit code"))
                decode_report = {"killed": decode.exitcode == -signal.SIGKILL, "exitcode": decode.exitcode}
            elif "step" in message:
                step = message["step"]
                p_parent.send({"step": step})
            else:
                decode_report = message
        if step != "arrived":
            p_parent.send({"step": "done"})
        prefill_report = waits.recv(p_parent, "prefill report", prefill)
        if prefill_report is None:
            raise RuntimeError("sparsekv: pd-demo prefill ended without a report")
    finally:
        for proc in (prefill, decode):
            if proc is not None:
                waits.join(proc, f"the {proc.name} process's end")
    return {"spec": {**asdict(spec), "secret": "<set>"}, "plan": plan, "prefill": prefill_report,
            "decode": decode_report, "waits": waits.log}


def verdict(report: dict) -> bool:
    """Every room arrived on both sides and every decode byte is what it must be."""
    d, p = report["decode"], report["prefill"]
    if "rooms" not in d or "rooms" not in p or d.get("mismatched"):
        return False
    return all(r["status"] == "success" for r in d["rooms"].values()) and \
        all(r["status"] == "success" for r in p["rooms"].values())

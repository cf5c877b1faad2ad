"""``HiSparseCoordinator``: drives the HiSparse C4 hot buffers of a DSV4 model.

The whole C4 KV of every request lives in the host pool
(:class:`~sparsekv.srt.mem_cache.dsv4_paged_host_pool.DeepSeekV4PagedHostPool`); the device keeps,
per request and layer, a hot buffer of ``H`` slots plus one page whose first slot (column ``H``)
holds the newest C4 entry. Each decode step and layer, :meth:`HiSparseCoordinator.swap_in_selected_pages`
resolves the indexer's top-k against the hot buffer with the swap-in kernel
(:func:`sparsekv.jit_kernel.hisparse.load_cache_to_device_buffer_dsv4_mla`).

Host-side planning (tables, allocation, backups) is split from the launch-only swap-in, which
neither allocates nor synchronizes. Copies run on side streams ordered by events
(:mod:`sparsekv.srt.streams`), so the same class runs on the GPU and, in tests, on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from sparsekv import env
from sparsekv.checks import as_bool, as_int, index_in, int_in
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.hisparse import COUNTERS, load_cache_to_device_buffer_dsv4_mla, policy_protections
from sparsekv.jit_kernel.hisparse_index import ResidentIndex
from sparsekv.kv_layout import V4
from sparsekv.srt.checks import index_table
from sparsekv.srt.errors import RequestStateError
from sparsekv.srt.mem_cache.allocators import AllocatorExhaustedError, HiSparseTokenToKVPoolAllocator
from sparsekv.srt.mem_cache.dsv4_paged_host_pool import DeepSeekV4PagedHostPool
from sparsekv.srt.mem_cache.hisparse_device_pool import HiSparseC4DevicePool
from sparsekv.srt.mem_cache.hisparse_host_pool import HostPoolExhaustedError
from sparsekv.srt.mem_cache.ids import DeviceSlots, HostSlots
from sparsekv.srt.streams import Event, StreamFactory, make_streams


class Request(Protocol):
    """What the coordinator reads from a scheduler request."""

    #: Row of the request in ``req_to_token`` and in every per-request table.
    req_pool_idx: int
    #: Full tokens allocated to the request so far (prompt, then + decode tokens).
    kv_allocated_len: int


class ReqToTokenPool(Protocol):
    """The scheduler's position -> full-token-location table."""

    #: int64 ``[max_reqs, max_context_len]``.
    req_to_token: torch.Tensor


Phase = Literal["transfer", "staging", "decode"]

#: How a message names each phase (``None``: the row holds nothing of the coordinator's).
_PHASE_WORDS = {None: "not admitted (unknown, or already finished)",
                "transfer": "holding host slots for a direct transfer (admit it with admit_request_direct)",
                "staging": "still staging (its backup is in flight)", "decode": "already admitted for decode"}


@dataclass
class _ReqState:
    phase: Phase
    #: The request's length as the coordinator accounts for it: ``kv_allocated_len`` at admission,
    #: then each decode step's sequence length. A finishing request must agree.
    length: int = 0
    skip_first_backup: bool = False
    #: While staging: the prefill's C4 locations and their device slots, as admitted. Collection
    #: and release use these, never the scheduler's tables again (which the scheduler may reuse).
    locs: torch.Tensor | None = None
    device: DeviceSlots | None = None


class HiSparseCoordinator:
    """Per-request C4 hot buffers of a HiSparse DSV4 model: admission, backups, swap-in, release.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
        The scheduler's table of full-token locations (its shape fixes the request rows and the
        context length).
    allocator : HiSparseTokenToKVPoolAllocator
        Logical and device allocator (``compress_ratio=4``).
    device_pool : HiSparseC4DevicePool
        The device C4 pool of that allocator.
    num_top_k : int
        Indexer top-k (``K``), the swap-in's ``num_top_k`` (``top_k=`` still works for one release, with a
        ``DeprecationWarning``).
    hot_buffer_size : int
        Hot slots per request (``H >= K``), the swap-in's ``hot_buffer_size`` (formerly
        ``device_buffer_size=``, which still works for one release).
    host_pool : DeepSeekV4PagedHostPool, optional
        Default: a layer-first pool over ``device_pool``'s layers with room for every logical C4 entry.
    streams : StreamFactory, optional
        Default: CUDA streams for a CUDA device pool, host streams otherwise.
    tp_group : torch.distributed.ProcessGroup, optional
        Tensor-parallel group; staging completion is agreed on with an all-reduce MIN over it.
    swap_in_block_size : int, optional
        GPU threads per request of the swap-in (default from the kernel's instantiation table).
    collect_counters : bool
        Accumulate device-side ``(hits, misses, bytes)`` counters over swap-ins (:meth:`read_counters`).
    resident_index : bool
        Swap in with the indexed kernel (:mod:`sparsekv.jit_kernel.hisparse_index`): one
        :class:`~sparsekv.jit_kernel.hisparse_index.ResidentIndex` per layer (``resident_indexes``),
        rebuilt from ``req_device_buffer_tokens`` whenever a row's tables are reset (admission,
        release), updated by the kernel otherwise; the LRU order then lives in the index and
        ``lru_slots`` stays at its reset value. Same results; ``O(K)`` instead of ``O(H)`` table work
        per step and layer, for :func:`~sparsekv.jit_kernel.hisparse_index.resident_index_bytes`
        more device bytes per request and layer. Default False: the scanning kernel.
    swap_in_policy : str or tuple of int
        The swap-in's replacement policy (``policy=`` of the swap-in; default ``"lru"``):
        ``"recent_lru"``, ``"near_lru"`` or a ``(protect_recent, protect_near)`` pair select a
        protected LRU, with either kernel.

    Raises
    ------
    TypeError
        An argument of the wrong kind: a non-integer ``req_to_token``, an allocator of another
        class, a bool or float where an int is meant.
    ValueError
        ``num_top_k < 1``, ``hot_buffer_size < num_top_k``, or ``device_pool`` not the allocator's pool.

    Examples
    --------
    A request's life on the CPU (tests/runtime/test_hisparse_coordinator.py runs this for real)::

        coord = HiSparseCoordinator(req_pool, allocator, device_pool, num_top_k=5, hot_buffer_size=7)
        allocator.alloc_extend(req_pool.req_to_token, req.req_pool_idx, 0, prompt_len)
        ...                                              # prefill writes C4 entries to the device pool
        coord.admit_request_into_staging(req)            # back the prefill up to the host
        ready = coord.collect_ready_reqs()               # -> [req]: hot buffer in place
        for step in decode_steps:
            coord.map_last_loc_to_buffer([rid], [seq_len], [out_loc])   # before the forward
            for layer in c4_layers:
                locs = coord.swap_in_selected_pages(rids, c4_lens, top_k_result, layer)
        coord.request_finished(req)                      # every host page and device slot freed

    Notes
    -----
    Lifecycle of a request row: ``admit_request_into_staging`` (prefill on the device, backup in
    flight) -> ``collect_ready_reqs`` (hot buffer allocated, prefill pages beyond it freed), or
    ``admit_request_direct`` (PD: the KV is already in the host pool) -> decode steps
    (``map_last_loc_to_buffer`` once per step, ``swap_in_selected_pages`` per layer) ->
    ``request_finished`` (also valid while staging, and after ``alloc_direct_host_slots`` for a
    transfer that is abandoned). The logical full-token locations belong to the scheduler, which
    frees them with ``allocator.free_logical``.

    A call out of that order (admitted twice, admitted while staging, finished twice, decoded
    before admission, swapped in while not decoding) raises
    :class:`~sparsekv.srt.errors.RequestStateError`; bad arguments raise ``TypeError`` /
    ``ValueError`` / ``IndexError`` naming them. Either way nothing has changed.

    Ownership: the coordinator records what it admitted for each request (its length, and while
    staging its C4 locations and device slots) and frees exactly that. A scheduler field that
    disagrees with the record (a ``kv_allocated_len`` at finish shorter than the length admitted or
    last decoded, an admission shorter than what the allocator gave the row, or longer: a reused
    row's stale ``kv_allocated_len`` reaching into other requests' locations) is a
    ``RequestStateError``, never a leak or a free of another request's pages. Every page the
    coordinator allocates (device and host) records the request row as its owner, and the
    coordinator holds its rows in the allocator (:meth:`HiSparseTokenToKVPoolAllocator.hold_row
    <sparsekv.srt.mem_cache.allocators.HiSparseTokenToKVPoolAllocator.hold_row>`) from admission to
    finish: a free or a load that names another row's pages, a ``free_logical`` or
    ``free_device_buffer`` of a held row, and an ``alloc_extend`` of a staging or decoding row are
    refused, naming the request; only ``request_finished`` releases a held row's pages.
    """

    @renamed_keywords(top_k="num_top_k", device_buffer_size="hot_buffer_size")
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: HiSparseTokenToKVPoolAllocator,
                 device_pool: HiSparseC4DevicePool, *, num_top_k: int, hot_buffer_size: int,
                 host_pool: DeepSeekV4PagedHostPool | None = None, streams: StreamFactory | None = None,
                 tp_group=None, swap_in_block_size: int | None = None, collect_counters: bool = False,
                 resident_index: bool = False, swap_in_policy: str | tuple[int, int] = "lru") -> None:
        if not isinstance(allocator, HiSparseTokenToKVPoolAllocator):
            raise TypeError(f"sparsekv: argument `allocator` must be a HiSparseTokenToKVPoolAllocator, got "
                            f"{type(allocator).__name__}")
        index_table(getattr(req_to_token_pool, "req_to_token", None), "req_to_token_pool.req_to_token", ndim=2)
        num_top_k = int_in(num_top_k, "num_top_k", 1)
        hot_buffer_size = int_in(hot_buffer_size, "hot_buffer_size", 1)
        if swap_in_block_size is not None:
            swap_in_block_size = int_in(swap_in_block_size, "swap_in_block_size", 1)
        collect_counters = as_bool(collect_counters, "collect_counters")
        resident_index = as_bool(resident_index, "resident_index")
        try:
            policy_protections(swap_in_policy)
        except ValueError as e:
            raise ValueError(str(e).replace("argument `policy`", "argument `swap_in_policy`")) from None
        self.swap_in_policy = swap_in_policy
        if hot_buffer_size < num_top_k:
            raise ValueError(f"sparsekv: argument `hot_buffer_size` ({hot_buffer_size}) must be >= `num_top_k` "
                             f"({num_top_k})")
        if device_pool.allocator is not allocator:
            raise ValueError("sparsekv: argument `device_pool` must be the pool of `allocator`")
        self.req_to_token = req_to_token_pool.req_to_token
        self.allocator = allocator
        self.device_pool = device_pool
        self.num_top_k = num_top_k
        self.hot_buffer_size = hot_buffer_size
        self.compress_ratio = allocator.compress_ratio
        self.page_slots = allocator.page_slots  # C4 slots per page, on the device and the host
        self.padded_buffer_size = hot_buffer_size + self.page_slots
        self.item_size_bytes = V4.bytes_per_token
        self.swap_in_block_size = swap_in_block_size
        self.tp_group = tp_group
        device = device_pool.device
        num_reqs, max_context = self.req_to_token.shape
        if host_pool is None:
            host_pages = -(-allocator.size_full // self.compress_ratio // self.page_slots)
            host_pool = DeepSeekV4PagedHostPool("dsv4_hisparse_c4", device_pool.kv_buffer, host_pages,
                                                page_slots=self.page_slots)
        host_pool.guard_device_writes(allocator.device_alloc)
        self.mem_pool_host = host_pool
        layers, padded, hot = device_pool.layer_num, self.padded_buffer_size, hot_buffer_size

        max_entries = -(-max_context // self.compress_ratio) + self.page_slots
        self.req_to_host_pool = torch.full((num_reqs, max_entries), -1, dtype=torch.int64, device=device)
        self.req_to_host_pool_allocated_len = torch.zeros(num_reqs, dtype=torch.int64)
        self.req_to_device_buffer = torch.full((num_reqs, padded), -1, dtype=torch.int64, device=device)
        self.req_device_buffer_tokens = torch.full((layers, num_reqs, padded), -1, dtype=torch.int32, device=device)
        self.req_device_buffer_token_locs = torch.full((layers, num_reqs, padded), -1, dtype=torch.int32,
                                                       device=device)
        self.lru_slots = torch.arange(hot, dtype=torch.int16, device=device).repeat(layers, num_reqs, 1)
        self.top_k_device_locs_buffer = torch.full((num_reqs, num_top_k), -1, dtype=torch.int32, device=device)
        # The swap-in's miss plan (host slot, device slot, count per row): given one, the GPU copies
        # every miss of the batch in a second launch, all in flight at once, instead of each request's
        # block copying its own misses a few at a time.
        self.miss_src_buffer = torch.empty((num_reqs, num_top_k), dtype=torch.int64, device=device)
        self.miss_dst_buffer = torch.empty((num_reqs, num_top_k), dtype=torch.int32, device=device)
        self.miss_count_buffer = torch.empty(num_reqs, dtype=torch.int32, device=device)
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device) if collect_counters else None
        # Columns of req_to_host_pool: the C4 positions a request can reach.
        self.resident_indexes = [ResidentIndex.empty(num_reqs, max_entries, hot, device=device)
                                 for _ in range(layers)] if resident_index else None

        self.streams = streams if streams is not None else make_streams(device)
        self.write_staging_stream = self.streams.new()
        self.decode_backup_stream = self.streams.new()
        self.ack_staging_queue: list[tuple[Event, Request]] = []
        self._pending_backup: Event | None = None
        self._reqs: dict[int, _ReqState] = {}

    # ---- sizes ------------------------------------------------------------------------

    def host_token_len(self, kv_allocated_len: int) -> int:
        """C4 entries of ``kv_allocated_len`` full tokens: ``len // 4`` (one per 4 tokens).

        Raises
        ------
        TypeError, ValueError
            ``kv_allocated_len`` is not a non-negative int.
        """
        return int_in(kv_allocated_len, "kv_allocated_len", 0) // self.compress_ratio

    # ---- validation -------------------------------------------------------------------

    def _check_req(self, req: Request, allowed: tuple[Phase | None, ...], action: str) -> int:
        """``req``'s row after checking its fields and that its phase allows ``action``.

        Raises ``TypeError`` / ``IndexError`` / ``ValueError`` for bad fields and
        :class:`RequestStateError` for a phase not in ``allowed``.
        """
        for field in ("req_pool_idx", "kv_allocated_len"):
            if not hasattr(req, field):
                raise TypeError(f"sparsekv: argument `req` must have a `{field}` (a scheduler request), got "
                                f"{type(req).__name__}")
        rows, width = self.req_to_token.shape
        rid = index_in(req.req_pool_idx, "req.req_pool_idx", rows)
        int_in(req.kv_allocated_len, "req.kv_allocated_len", 0, width)
        self._check_phase(rid, allowed, action)
        return rid

    def _check_phase(self, rid: int, allowed: tuple[Phase | None, ...], action: str) -> _ReqState | None:
        state = self._reqs.get(rid)
        phase = state.phase if state is not None else None
        if phase not in allowed:
            raise RequestStateError(f"sparsekv: request row {rid} is {_PHASE_WORDS[phase]}; it cannot be {action}")
        return state

    def _compressed_locs(self, req: Request) -> torch.Tensor:
        return self.allocator.compressed_locs(self.req_to_token[req.req_pool_idx, : req.kv_allocated_len].cpu())

    def _check_admitted_length(self, rid: int, length: int) -> None:
        """Refuse an admission of ``length`` tokens when they are not exactly what the allocator
        gave row ``rid``: a location outside the row's logical pages (a stale, too-long length of
        a reused row would read another request's locations, and free its device pages at the
        finish), a logical page beyond them, or a C4 entry on the device in the rest of their last
        page (what the coordinator is not told of it could never free)."""
        full = self.req_to_token[rid, :length].cpu()
        page = self.allocator.page_size
        logical = self.allocator.logical
        pages = full // page
        in_space = (full >= 0) & (pages < logical.num_pages)
        foreign = ~in_space
        foreign[in_space] = logical.owners(pages[in_space]) != rid
        # What alloc_extend / alloc_decode write: position i at offset i % page of the page of its
        # group of `page` positions, one page per group, no page twice (a stale entry may name one
        # of the row's own pages again).
        positions = torch.arange(length)
        group_pages = pages[::page]
        misplaced = (full % page != positions % page) | (pages != group_pages[positions // page])
        sorted_pages, order = torch.sort(group_pages, stable=True)
        repeated = torch.zeros_like(group_pages, dtype=torch.bool)  # a group whose page an earlier group has
        repeated[order[1:]] = sorted_pages[1:] == sorted_pages[:-1]
        misplaced |= repeated.repeat_interleave(page)[:length]
        bad = foreign | misplaced
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0])
            owner = self.allocator.logical_row(int(full[pos])) if bool(in_space[pos]) else -1
            whose = "no request's" if owner < 0 else f"request row {owner}'s"
            where = f"is in {whose} page" if bool(foreign[pos]) else "is not where alloc_extend put that position"
            raise RequestStateError(f"sparsekv: `req.kv_allocated_len` = {length} is beyond the logical pages of "
                                    f"request row {rid}: req_to_token[{rid}, {pos}] = {int(full[pos])} {where} "
                                    "(a stale length of a reused row?)")
        beyond = self.allocator.logical_pages_of_row(rid) - set((full // page).tolist())
        tail = torch.empty(0, dtype=torch.int64)
        if length % page:
            last_page = int(full[-1]) // page
            tail = self.allocator.compressed_locs(last_page * page + torch.arange(int(full[-1]) % page + 1, page))
        mapping = self.allocator.full_to_hisparse_device_index_mapping
        if beyond or bool((mapping[tail.to(mapping.device)] >= 0).any()):
            raise RequestStateError(f"sparsekv: request row {rid} was allocated more than `req.kv_allocated_len` = "
                                    f"{length} tokens (logical pages {sorted(beyond)} beyond them, or C4 entries on "
                                    "the device past them): admit it with its whole allocated length")

    def _check_finishing_length(self, rid: int, state: _ReqState, req: Request) -> None:
        # Longer is fine (tokens allocated for a step the coordinator refused or never saw hold
        # nothing of its); shorter says the scheduler lost track of what was admitted.
        if req.kv_allocated_len < state.length:
            raise RequestStateError(f"sparsekv: request row {rid} finishes with `req.kv_allocated_len` = "
                                    f"{req.kv_allocated_len}, but the coordinator admitted (or last decoded) "
                                    f"{state.length} tokens; nothing was freed")

    # ---- admission --------------------------------------------------------------------

    def admit_request_into_staging(self, req: Request) -> None:
        """Back a prefilled request's C4 entries up to the host, asynchronously.

        The prefill's entries sit in device slots (``allocator.alloc_extend``). Host pages for
        all of them are allocated and an all-layer copy is queued on ``write_staging_stream``
        after the compute stream's work so far; :meth:`collect_ready_reqs` reports the request
        once the copy has completed.

        Raises
        ------
        TypeError, IndexError
            ``req.req_pool_idx`` is not a row, or ``req.kv_allocated_len`` not an int.
        RequestStateError
            The row is already admitted (staging or decoding) or holds direct-transfer host slots.
        ValueError
            Some of the request's C4 entries are not on the device (a prefill allocated with
            ``with_device=False`` is admitted with :meth:`admit_request_direct`), or
            ``req.kv_allocated_len`` is beyond the table; nothing changed.
        HostPoolExhaustedError
            Not enough host pages; nothing changed.
        Exception
            Whatever submitting the backup raised; the host pages allocated for it are freed again
            and the request is not admitted (its prefill slots stay the caller's).
        """
        rid = self._check_req(req, (None,), "admitted into staging")
        self._check_admitted_length(rid, req.kv_allocated_len)
        locs = self._compressed_locs(req)
        device_idx = self.allocator.device_slots(locs)
        if bool((device_idx.tensor < 0).any()):
            raise ValueError(f"sparsekv: request row {rid} has C4 entries that are not on the device; a prefill "
                             "allocated with with_device=False is admitted with admit_request_direct")
        allocated_before = int(self.req_to_host_pool_allocated_len[rid])
        host_idx = self.mem_pool_host.alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, rid, 0, locs.numel())
        try:
            self.write_staging_stream.wait_event(self.streams.current().record_event())
            self.write_staging_stream.submit(
                lambda: self.mem_pool_host.backup_from_device_all_layer(host_idx, device_idx),
                uses=(host_idx.tensor, device_idx.tensor))
        except BaseException:
            self._free_host_slots(rid, keep=allocated_before)
            raise
        self.ack_staging_queue.append((self.write_staging_stream.record_event(), req))
        self._reqs[rid] = _ReqState("staging", req.kv_allocated_len, locs=locs, device=device_idx)
        self.allocator.hold_row(rid, "staging")

    def collect_ready_reqs(self) -> list[Request]:
        """Requests whose staging backup has completed, in admission order, now ready to decode.

        Only the completed prefix of the queue counts, agreed on across the TP group (MIN), so
        every rank admits the same requests. Each gets its hot buffer (:meth:`_install_buffer`)
        and leaves the queue, one at a time. A hot buffer the device allocator cannot hold yet
        stops the collection: that request and the ones behind it stay queued for a later call
        (every TP rank's allocator holds the same pages, so every rank stops at the same request).

        Raises
        ------
        ValueError
            A completed request's C4 entries are no longer on the device (its slots were freed
            outside the coordinator). Checked for every completed request before any hot buffer is
            installed, so nothing changed and the queue stays as it was.
        """
        ready = 0
        for event, _ in self.ack_staging_queue:
            if not event.query():
                break
            ready += 1
        if self.tp_group is not None:
            import torch.distributed as dist

            count = torch.tensor([ready], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.tp_group)
            ready = int(count)
        for _, req in self.ack_staging_queue[:ready]:
            state = self._reqs[req.req_pool_idx]
            slots = self.allocator.device_slots(state.locs).tensor
            pages = self.allocator.device_alloc.pages_of(slots)
            if not torch.equal(slots, state.device.tensor) or not self.allocator.device_alloc.all_allocated(pages):
                raise ValueError(f"sparsekv: request row {req.req_pool_idx} was staged, but its C4 entries are no "
                                 "longer in allocated device slots (freed outside the coordinator?)")
        collected = []
        while len(collected) < ready:
            _, req = self.ack_staging_queue[0]
            try:
                self._install_buffer(req, self._reqs[req.req_pool_idx].locs, resident=True)
            except AllocatorExhaustedError:
                break
            self.ack_staging_queue.pop(0)
            collected.append(req)
        return collected

    def alloc_direct_host_slots(self, req: Request, num_entries: int) -> HostSlots:
        """Host slots for a PD direct-to-host transfer of ``num_entries`` C4 entries (positions 0..).

        The transfer engine writes the entries there; then call :meth:`admit_request_direct` (or
        :meth:`request_finished` to abandon the transfer). The row is in its transfer phase from now.

        Raises
        ------
        TypeError, IndexError
            A bad ``req`` (see :meth:`admit_request_into_staging`) or ``num_entries`` not an int.
        RequestStateError
            The row is staging or decoding.
        ValueError
            ``num_entries`` is negative or more than a row of the host table holds.
        HostPoolExhaustedError
            Not enough host pages; nothing changed.
        """
        rid = self._check_req(req, (None, "transfer"), "given direct-transfer host slots")
        num_entries = int_in(num_entries, "num_entries", 0, self.req_to_host_pool.shape[1] - self.page_slots)
        slots = self.mem_pool_host.alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, rid, 0, num_entries)
        self._reqs.setdefault(rid, _ReqState("transfer")).length = req.kv_allocated_len
        self.allocator.hold_row(rid, "transfer")
        return slots

    def admit_request_direct(self, req: Request) -> None:
        """Admit a request whose C4 KV was written straight into the host pool (PD decode side).

        With ``n = host_token_len(req.kv_allocated_len)`` entries: if ``n <= H`` every entry is
        preloaded into its own hot slot (the kernel's fast path never loads); otherwise the hot
        slots start empty, so every lookup misses, and only the newest entry is loaded, into the
        reserved column ``H``. The first decode step's backup is skipped (the host has it all).

        Raises
        ------
        TypeError, IndexError
            A bad ``req`` (see :meth:`admit_request_into_staging`).
        RequestStateError
            The row is staging or already decoding.
        ValueError
            ``req.kv_allocated_len`` needs more C4 entries than the row's host slots hold
            (:meth:`alloc_direct_host_slots`), or some of its entries are on the device (a prefill
            with device slots is admitted with :meth:`admit_request_into_staging`); nothing changed.
        AllocatorExhaustedError
            The hot buffer does not fit in the device pool; nothing changed.
        """
        rid = self._check_req(req, (None, "transfer"), "admitted directly")
        self._check_admitted_length(rid, req.kv_allocated_len)
        n = self.host_token_len(req.kv_allocated_len)
        held = int(self.req_to_host_pool_allocated_len[rid])
        if n > held:
            raise ValueError(f"sparsekv: argument `req.kv_allocated_len` = {req.kv_allocated_len} needs {n} C4 "
                             f"entries, but request row {rid} holds {held} host slots (alloc_direct_host_slots)")
        if bool((self.allocator.device_slots(self._compressed_locs(req)).tensor >= 0).any()):
            raise ValueError(f"sparsekv: request row {rid} has C4 entries on the device; a prefill allocated with "
                             "device slots is admitted with admit_request_into_staging")
        self._install_buffer(req, torch.empty(0, dtype=torch.int64), resident=n <= self.hot_buffer_size)
        host = self.req_to_host_pool[rid, :n]
        buffer = self.req_to_device_buffer[rid]
        hot = self.hot_buffer_size
        if n <= hot:
            host_idx, device_idx = HostSlots(host.clone()), DeviceSlots(buffer[:n].clone())
        else:
            host_idx, device_idx = HostSlots(host[n - 1 :].clone()), DeviceSlots(buffer[hot : hot + 1].clone())
        for layer in range(self.device_pool.layer_num):
            self.mem_pool_host.load_to_device_per_layer(host_idx, device_idx, layer, owner=rid)

    def _install_buffer(self, req: Request, compressed_locs: torch.Tensor, *, resident: bool) -> None:
        """Allocate the hot buffer and reset the request's rows: slot ``i`` holds position ``i``
        (``resident``) or nothing; column ``H`` is the newest entry's slot; LRU ``0..H-1``."""
        rid, hot = req.req_pool_idx, self.hot_buffer_size
        buffer = self.allocator.alloc_device_buffer(compressed_locs, self.padded_buffer_size, rid=rid).tensor
        self.req_to_device_buffer[rid] = buffer.to(self.req_to_device_buffer.device)
        self.req_device_buffer_token_locs[:, rid] = buffer.to(torch.int32).to(self.req_device_buffer_token_locs.device)
        self.req_device_buffer_tokens[:, rid] = -1
        if resident:
            self.req_device_buffer_tokens[:, rid, :hot] = torch.arange(hot, dtype=torch.int32)
        self.lru_slots[:, rid] = torch.arange(hot, dtype=torch.int16)
        self._rebuild_resident_index(rid)
        self._reqs[rid] = _ReqState("decode", req.kv_allocated_len, skip_first_backup=True)
        self.allocator.hold_row(rid, "decode")

    def _rebuild_resident_index(self, rid: int) -> None:
        """Row ``rid`` of every layer's resident index, from its (just reset) slot tokens and LRU."""
        for layer, index in enumerate(self.resident_indexes or ()):
            index.rebuild_rows([rid], self.req_device_buffer_tokens[layer], self.lru_slots[layer])

    # ---- decode -----------------------------------------------------------------------

    def map_last_loc_to_buffer(self, req_pool_indices: list[int], seq_lens: list[int],
                               out_cache_loc: list[int]) -> None:
        """Once per decode step, before the forward: route new C4 entries into the hot buffers and
        back up the entry produced by the previous step.

        For request ``rid`` with ``seq_len`` tokens (the new one at full location ``out_cache_loc``):

        * the previous step produced C4 entry ``p = (seq_len - 1) // 4 - 1`` when
          ``(seq_len - 1) % 4 == 0``; it is copied from hot slot ``min(p, H)`` to a new host slot
          on ``decode_backup_stream`` (skipped on the first step after admission);
        * if this token produces entry ``q = seq_len // 4 - 1`` (``seq_len % 4 == 0``), the
          compressor writes it to hot slot ``min(q, H)``: its own slot while it fits, else the
          reserved column ``H``.

        The compute stream waits for the previous step's backup first: entry ``p`` stays in slot
        ``H`` for at least three more steps, so that backup is never overtaken.

        Raises
        ------
        TypeError
            An argument is not a sequence of ints (a bool or a float included).
        IndexError
            A row outside the tables, or a location outside the logical space (a negative one included).
        RequestStateError
            A row is not admitted for decode (unknown, staging, or holding transfer slots).
        ValueError
            The three lists differ in length; a row appears twice; a sequence length outside
            ``[1, max_context]`` or one that skips C4 entries the host never received; a location
            outside the row's logical pages (those ``alloc_extend`` / ``alloc_decode`` gave it), or
            one that does not produce the C4 entry its sequence length says it does. Nothing changed.
        HostPoolExhaustedError
            The step's backups need more host pages than are free; nothing changed.
        """
        req_pool_indices = _int_list(req_pool_indices, "req_pool_indices")
        seq_lens = _int_list(seq_lens, "seq_lens")
        out_cache_loc = _int_list(out_cache_loc, "out_cache_loc")
        if not len(req_pool_indices) == len(seq_lens) == len(out_cache_loc):
            raise ValueError(f"sparsekv: arguments `req_pool_indices`, `seq_lens` and `out_cache_loc` must have equal "
                             f"lengths, got {len(req_pool_indices)}, {len(seq_lens)} and {len(out_cache_loc)}")
        if len(set(req_pool_indices)) != len(req_pool_indices):
            raise ValueError(f"sparsekv: argument `req_pool_indices` names a request row twice: {req_pool_indices}")
        ratio, hot = self.compress_ratio, self.hot_buffer_size
        # Every row is checked, and the host pages of all backups counted, before any row changes:
        # a row failing halfway would leave earlier rows with host slots no backup fills and with
        # their first-backup skip spent.
        rows, pages_needed = [], 0
        num_rows, width = self.req_to_token.shape
        locs_end = (self.allocator.full_to_hisparse_device_index_mapping.numel() - 1) * ratio
        for i, (rid, seq_len, out_loc) in enumerate(zip(req_pool_indices, seq_lens, out_cache_loc)):
            index_in(rid, f"req_pool_indices[{i}]", num_rows)
            state = self._reqs.get(rid)
            if state is None or state.phase != "decode":
                raise RequestStateError(f"sparsekv: request row {rid} is not admitted for decode (it is "
                                        f"{_PHASE_WORDS[state.phase if state else None]})")
            int_in(seq_len, f"seq_lens[{i}]", 1, width)
            # The mapping's last entry is the -1 sentinel that padded writes read: never a target.
            if not 0 <= out_loc < locs_end:
                raise IndexError(f"sparsekv: argument `out_cache_loc[{i}]` = {out_loc} is out of range [0, {locs_end})")
            owner = self.allocator.logical_row(out_loc)
            if owner != rid:
                raise ValueError(f"sparsekv: argument `out_cache_loc[{i}]` = {out_loc} is not in a logical page of "
                                 f"request row {rid} " + ("(not allocated)" if owner < 0 else f"(row {owner}'s)"))
            if (seq_len % ratio == 0) != ((out_loc + 1) % ratio == 0):
                raise ValueError(f"sparsekv: argument `out_cache_loc[{i}]` = {out_loc} is not the location of token "
                                 f"{seq_len - 1} (of `seq_lens[{i}]`): one produces a C4 entry, the other does not")
            completed = seq_len > 1 and (seq_len - 1) % ratio == 0  # the previous token produced an entry
            backup = (seq_len - 1) // ratio - 1 if completed and not state.skip_first_backup else None
            if backup is not None:
                held = int(self.req_to_host_pool_allocated_len[rid])
                if backup > held:
                    raise ValueError(f"sparsekv: argument `seq_lens[{i}]` = {seq_len} backs up C4 entry {backup} of "
                                     f"request row {rid}, whose host slots end at {held}: entries would be skipped")
                pages_needed += self.mem_pool_host.host_pages_needed(backup, 1, held)
            produced = seq_len // ratio - 1 if seq_len % ratio == 0 else None
            rows.append((rid, state, backup, produced, out_loc, seq_len))
        if pages_needed > self.mem_pool_host.available_pages:
            raise HostPoolExhaustedError(f"sparsekv: this step's decode backups need {pages_needed} host pages, "
                                         f"{self.mem_pool_host.available_pages} free")

        compute = self.streams.current()
        if self._pending_backup is not None:
            compute.wait_event(self._pending_backup)
            self._pending_backup = None
        mapping = self.allocator.full_to_hisparse_device_index_mapping
        host_ids, device_ids = [], []
        for rid, state, p, q, out_loc, seq_len in rows:
            if p is not None:
                host_ids.append(self.mem_pool_host.alloc_paged_token_slots(
                    self.req_to_host_pool, self.req_to_host_pool_allocated_len, rid, p, 1).tensor)
                device_ids.append(self.req_to_device_buffer[rid, min(p, hot)].reshape(1))
            state.skip_first_backup = False
            state.length = seq_len
            if q is not None:
                mapping[out_loc // ratio] = self.req_to_device_buffer[rid, min(q, hot)]
        if host_ids:
            host_idx, device_idx = HostSlots(torch.cat(host_ids)), DeviceSlots(torch.cat(device_ids))
            self.decode_backup_stream.wait_event(compute.record_event())
            self.decode_backup_stream.submit(
                lambda: self.mem_pool_host.backup_from_device_all_layer(host_idx, device_idx),
                uses=(host_idx.tensor, device_idx.tensor))
            self._pending_backup = self.decode_backup_stream.record_event()

    def swap_in_selected_pages(self, req_pool_indices: torch.Tensor, compressed_seq_lens: torch.Tensor,
                               top_k_result: torch.Tensor, layer_id: int,
                               num_real_reqs: torch.Tensor | None = None) -> torch.Tensor:
        """Device slots of one C4 layer's top-k, loading the misses from the host (launch only).

        Parameters
        ----------
        req_pool_indices, compressed_seq_lens : torch.Tensor
            int32 or int64 ``[bs]`` on the pools' device: request rows and C4 lengths. Several rows
            may name one request (MTP draft tokens, speculative decoding): they go through the
            speculative swap-in, which serves them in batch order as if one call after another.
        top_k_result : torch.Tensor
            int32 ``[bs, num_top_k]``: C4 positions (-1 or out of range: none).
        layer_id : int
            C4 layer index (into the device pool's layers).
        num_real_reqs : torch.Tensor, optional
            int32 ``[1]`` for CUDA-graph padded batches; default: every row is real.

        Returns
        -------
        torch.Tensor
            int32 ``[bs, num_top_k]`` device slots (a view of ``top_k_device_locs_buffer``), -1 for none.

        Raises
        ------
        TypeError
            ``layer_id`` is not an int (a bool included); tensors of the wrong dtype (the kernel's checks).
        IndexError
            ``layer_id`` is not a C4 layer (a negative one included).
        ValueError
            More rows than the coordinator's tables, or the kernel's shape and device checks.
        RequestStateError
            With ``SPARSEKV_CHECK_INDICES=1`` and host-readable ``req_pool_indices``: a (real) row
            that is not decoding. Otherwise no row is read back, so the call traces under
            ``torch.compile(fullgraph=True)`` and is captured in a CUDA graph on every device: a
            row that is not decoding has every slot column at -1 (reset at finish, set only at
            admission, where the phases are checked), so the kernel loads nothing into it and
            returns -1 for it.
        """
        layer_id = index_in(layer_id, "layer_id", self.device_pool.layer_num)
        if env.check_indices() and isinstance(req_pool_indices, torch.Tensor) and \
                req_pool_indices.device.type == "cpu" and (num_real_reqs is None or num_real_reqs.device.type == "cpu"):
            real = req_pool_indices.tolist()[: int(num_real_reqs[0]) if num_real_reqs is not None else None]
            for r in real:
                state = self._reqs.get(r)
                if state is None or state.phase != "decode":
                    raise RequestStateError(f"sparsekv: request row {r} is "
                                            f"{_PHASE_WORDS[state.phase if state else None]}; it cannot be swapped in")
        if not isinstance(top_k_result, torch.Tensor) or top_k_result.dim() != 2:
            raise TypeError("sparsekv: argument `top_k_result` must be a 2-D tensor")
        bs = top_k_result.shape[0]
        if bs > self.top_k_device_locs_buffer.shape[0]:
            raise ValueError(f"sparsekv: argument `top_k_result` has {bs} rows, the coordinator holds "
                             f"{self.top_k_device_locs_buffer.shape[0]} requests")
        out = self.top_k_device_locs_buffer[:bs]
        load_cache_to_device_buffer_dsv4_mla(
            top_k_result, self.req_device_buffer_tokens[layer_id], self.req_to_host_pool,
            self.req_device_buffer_token_locs[layer_id], self.mem_pool_host.kv_buffer[layer_id],
            self.device_pool.kv_buffer[layer_id], out, req_pool_indices, compressed_seq_lens,
            self.lru_slots[layer_id], self.item_size_bytes, self.num_top_k, self.hot_buffer_size,
            num_real_reqs=num_real_reqs, miss_src=self.miss_src_buffer[:bs], miss_dst=self.miss_dst_buffer[:bs],
            miss_count=self.miss_count_buffer[:bs], counters=self.counters, block_size=self.swap_in_block_size,
            page_slots=self.page_slots, speculative=True, policy=self.swap_in_policy,
            resident_index=self.resident_indexes[layer_id] if self.resident_indexes else None)
        return out

    # ---- release ----------------------------------------------------------------------

    def request_finished(self, req: Request) -> None:
        """Release everything the coordinator holds for ``req``: its device slots (hot buffer, or
        the prefill while staging), its host pages, its mapping entries; reset its rows.

        In-flight copies that touch the request (its staging backup, the last decode backup)
        are waited for first, so no freed page is still being read or written.

        Raises
        ------
        TypeError, IndexError
            A bad ``req`` (see :meth:`admit_request_into_staging`); nothing changed.
        RequestStateError
            The request row is not admitted (unknown or already finished); nothing changed.
        ValueError
            An allocator refuses a free (a page it does not hold as allocated). The request stays
            admitted then, and a retry frees only what is left.
        """
        rid = self._check_req(req, ("transfer", "staging", "decode"), "finished")
        state = self._reqs[rid]
        self._check_finishing_length(rid, state, req)
        # The request's own release: the allocator lets its row's pages go (and holds the row
        # again if a free raises, for a retry).
        self.allocator.release_row(rid)
        try:
            self._release(rid, state)
        except BaseException:
            self.allocator.hold_row(rid, state.phase)
            raise

    def _release(self, rid: int, state: _ReqState) -> None:
        if state.phase == "transfer":  # an abandoned direct transfer: only its host slots are held
            self._free_host_slots(rid)
            del self._reqs[rid]
            return
        for event, queued in list(self.ack_staging_queue):
            if queued.req_pool_idx == rid:
                event.synchronize()
                self.ack_staging_queue.remove((event, queued))
        if self._pending_backup is not None:
            self._pending_backup.synchronize()
            self._pending_backup = None
        # Each free (all or nothing) is followed by clearing the record it was read from, and the
        # state goes last: when a free raises, a retry finds only what is still held. What is freed
        # is what was recorded (the staged prefill's slots, or the hot buffer), and the mapping loses
        # exactly the entries naming those slots: the scheduler's tables are not read again (a row
        # whose logical pages went to another request must not free or unmap that one's).
        mapping = self.allocator.full_to_hisparse_device_index_mapping
        if state.phase == "staging":
            slots = state.device.tensor
            self.allocator.free_device_buffer(state.device, rid=rid)
            state.device = DeviceSlots(torch.empty(0, dtype=torch.int64))
        else:
            slots = self.req_to_device_buffer[rid].cpu().clone()  # the row is reset below
            self.allocator.free_device_buffer(DeviceSlots(slots), rid=rid)
            self.req_to_device_buffer[rid] = -1
        mapping[torch.isin(mapping, slots.to(mapping.device)) & (mapping >= 0)] = -1
        self._free_host_slots(rid)
        self.req_device_buffer_tokens[:, rid] = -1
        self.req_device_buffer_token_locs[:, rid] = -1
        self.lru_slots[:, rid] = torch.arange(self.hot_buffer_size, dtype=torch.int16)
        self._rebuild_resident_index(rid)
        del self._reqs[rid]

    def _free_host_slots(self, rid: int, *, keep: int = 0) -> None:
        """Free request ``rid``'s host pages past its first ``keep`` slots (a multiple of the page
        size) and clear them from its row."""
        allocated = int(self.req_to_host_pool_allocated_len[rid])
        self.mem_pool_host.free(self.mem_pool_host.allocated_host_indices(
            self.req_to_host_pool[:, keep:], rid, allocated - keep), owner=rid)
        self.req_to_host_pool[rid, keep:] = -1
        self.req_to_host_pool_allocated_len[rid] = keep

    # ---- observability ----------------------------------------------------------------

    def read_counters(self, *, reset: bool = False) -> dict[str, int]:
        """The swap-in counters accumulated so far (reading them waits for the device).

        Raises
        ------
        TypeError
            ``reset`` is not a bool.
        RuntimeError
            The coordinator was built without ``collect_counters=True``.
        """
        reset = as_bool(reset, "reset")
        if self.counters is None:
            raise RuntimeError("sparsekv: HiSparseCoordinator was built without collect_counters=True")
        values = dict(zip(COUNTERS, self.counters.tolist()))
        if reset:
            self.counters.zero_()
        return values

    def get_token_stats(self) -> dict[str, int]:
        """Device and host usage in C4 slots."""
        return {
            "device_used": len(self.allocator.device_alloc.used_pages) * self.page_slots,
            "device_total": (self.allocator.num_device_pages - 1) * self.page_slots,
            "host_used": (self.mem_pool_host.num_pages - self.mem_pool_host.available_pages) * self.page_slots,
            "host_total": self.mem_pool_host.size,
        }


def _int_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    """A sequence (or 1-D tensor or array) of ints as a list of Python ints (bools and floats refused)."""
    if hasattr(values, "tolist") and hasattr(values, "ndim"):  # a tensor or a numpy array
        if values.ndim != 1:
            raise TypeError(f"sparsekv: argument `{name}` must be 1-D, got shape {list(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"sparsekv: argument `{name}` must be a sequence of ints, got {type(values).__name__}")
    return [as_int(v, f"{name}[{i}]") for i, v in enumerate(values)]

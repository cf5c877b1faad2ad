"""HiSparse allocators: logical full-token slots, device hot-pool slots, and the map between them.

With HiSparse the scheduler sees a *logical* full-token space ``host_to_device_ratio`` times larger
than what the device holds: ``size_full = size * host_to_device_ratio``. Every token gets a logical
location (a paged allocator, ``loc % page_size`` = position in the page); the compressed entries
(C4: one per 4 tokens, produced at full location ``loc`` with ``(loc + 1) % 4 == 0`` and addressed
as ``loc // 4``) get *device* slots only while they must be on the device: the whole prefill until
it is backed up to the host, then a per-request hot buffer (:meth:`alloc_device_buffer`).
``full_to_hisparse_device_index_mapping[loc // ratio]`` is the device slot where the entry of that
logical location is written; -1 when it is not on the device.

Both spaces are allocated in whole pages, and every page has one owner: :class:`PagedAllocator`
(the host pool's allocator too) refuses a double free, so a leak or a double ownership shows up as
an error or in :attr:`PagedAllocator.used_pages`. Each page also records the request row it was
allocated for, and a free that names another row (or none) is refused, naming the owner: one
request cannot free another's pages. The rows a coordinator holds (staging, decoding, holding
transfer slots) are marked with :meth:`HiSparseTokenToKVPoolAllocator.hold_row`: their pages are
freed only by the coordinator's own release, and ``alloc_extend`` does not rewrite a row that is
staging or decoding.
"""

from __future__ import annotations

import torch

from sparsekv.checks import as_bool, as_int, index_in, int_in
from sparsekv.srt.checks import id_tensor, index_table, int_tensor
from sparsekv.srt.errors import RequestStateError
from sparsekv.srt.mem_cache.ids import DevicePages, DeviceSlots


def compressed_locs_of(full_locs: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """Compressed locations produced by full locations: entry ``k`` is produced at the last position
    of its group, ``(loc + 1) % ratio == 0``, and stored at ``loc // ratio``; other locations
    produce nothing and are dropped."""
    produced = full_locs[(full_locs + 1) % compress_ratio == 0]
    return torch.div(produced, compress_ratio, rounding_mode="floor")


#: The owner of a page that no request owns (free, reserved, or allocated without ``owner=``).
NO_OWNER = -1


class AllocatorExhaustedError(RuntimeError):
    """Not enough free pages for an allocation; nothing was allocated (admission should retry later)."""


class PagedAllocator:
    """Whole pages of one id space, each with one owner: the logical, device and host pools' allocator.

    Pages are handed out from the front of a free list (at first every page, lowest ids first) and
    freed pages join its back, sorted, so a freed page is reused only after every page that was free
    before it. With ``deferred_reuse`` freed pages first wait in a release list and join the free list
    (all of them, sorted together) only when an allocation needs them: the host pool's pages may
    still be read by in-flight copies of the step that freed them.

    The free list is an int64 tensor, so an allocation slices it and a free checks its pages with
    one vectorized test; ownership is one byte per page (a ``bytearray``, read per page by
    :meth:`is_allocated` without building a tensor, and viewed as a bool tensor for the vectorized
    checks). Each page also records its owner, the request row it was allocated for (``owner=`` of
    :meth:`alloc`, :data:`NO_OWNER` without one): an int64 tensor with a numpy view for per-page reads.
    A free (or a write a pool guards with :meth:`check_owner`) of a page owned by a row other than
    the caller's ``owner=`` is refused with :class:`~sparsekv.srt.errors.RequestStateError` naming
    that row.

    Parameters
    ----------
    num_pages : int
        Pages of the space, page 0 included.
    page_size : int
        Slots per page (:meth:`pages_of`).
    name : str
        For messages (``"device"`` reads "sparsekv: device allocator needs ...").
    reserve_page_0 : bool
        Page 0 is the reserved padding page, never handed out (default True, the logical space's and
        the device pool's convention); False hands out every page (the host pool).
    deferred_reuse : bool
        Freed pages wait until an allocation needs them (default False: they join the free list at once).
    exhausted_error : type of Exception
        What an allocation beyond the available pages raises (default :class:`AllocatorExhaustedError`).

    Raises
    ------
    TypeError, ValueError
        ``num_pages`` or ``page_size`` is not an int >= 1, or a flag is not a bool.
    """

    def __init__(self, num_pages: int, page_size: int, name: str, *, reserve_page_0: bool = True,
                 deferred_reuse: bool = False, exhausted_error: type[Exception] = AllocatorExhaustedError) -> None:
        num_pages, page_size = int_in(num_pages, "num_pages", 1), int_in(page_size, "page_size", 1)
        self.num_pages = num_pages
        self.page_size = page_size
        self.name = name
        self.deferred_reuse = as_bool(deferred_reuse, "deferred_reuse")
        self.exhausted_error = exhausted_error
        self._free = torch.arange(int(as_bool(reserve_page_0, "reserve_page_0")), num_pages, dtype=torch.int64)
        self._released: list[torch.Tensor] = []
        self._owned = bytearray(num_pages)
        self._owned_mask = torch.frombuffer(self._owned, dtype=torch.bool)
        self._owner = torch.full((num_pages,), NO_OWNER, dtype=torch.int64)
        self._owner_np = self._owner.numpy()  # per-page reads without building a tensor

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get (free, plus released with ``deferred_reuse``)."""
        return self._free.numel() + sum(t.numel() for t in self._released)

    @property
    def used_pages(self) -> set[int]:
        """Pages currently allocated."""
        return set(torch.nonzero(self._owned_mask).reshape(-1).tolist())

    def is_allocated(self, page: int) -> bool:
        """Whether ``page`` is an allocated page (False for the reserved page and out-of-range ids)."""
        return 0 <= page < self.num_pages and self._owned[page] == 1

    def owner_of(self, page: int) -> int:
        """The request row ``page`` was allocated for; :data:`NO_OWNER` when it has none (not
        allocated, allocated without an owner, or out of range)."""
        return int(self._owner_np[page]) if 0 <= page < self.num_pages else NO_OWNER

    def owners(self, pages: torch.Tensor) -> torch.Tensor:
        """int64 owners of ``pages`` (an integer tensor of page ids in range), :data:`NO_OWNER` for none.

        Raises
        ------
        TypeError
            ``pages`` is not an integer tensor.
        IndexError
            A page id out of range.
        """
        return self._owner[id_tensor(pages, "pages", size=self.num_pages)]

    def pages_owned_by(self, owner: int) -> torch.Tensor:
        """The allocated pages whose owner is request row ``owner``, ascending (int64)."""
        return torch.nonzero(self._owner == as_int(owner, "owner")).reshape(-1)

    def check_owner(self, pages: torch.Tensor, owner: int | None, action: str, *, name: str = "pages") -> None:
        """Refuse pages that belong to a request row other than ``owner`` (``None``: any row).

        Pages without an owner pass; ids outside the space are the caller's to refuse.

        Parameters
        ----------
        pages : torch.Tensor
            int64 page ids on the CPU.
        owner : int or None
            The request row on whose behalf the caller acts.
        action : str
            What the caller does to the pages, for the message ("freed", "written").
        name : str
            The argument that named the pages.

        Raises
        ------
        RequestStateError
            A page owned by another row; the message names the page and its owner.
        """
        caller = NO_OWNER if owner is None else owner
        ids = pages[(pages >= 0) & (pages < self.num_pages)]
        own = self._owner[ids]
        foreign = (own != NO_OWNER) & (own != caller)
        if bool(foreign.any()):
            i = int(torch.nonzero(foreign)[0])
            who = "without naming an owner" if owner is None else f"for request row {owner}"
            raise RequestStateError(
                f"sparsekv: argument `{name}` names {self.name} page {int(ids[i])}, which belongs to request row "
                f"{int(own[i])}; it cannot be {action} {who} (only that request's own release frees it)")

    def _owner_id(self, owner: int | None) -> int:
        return NO_OWNER if owner is None else int_in(owner, "owner", 0)

    def all_allocated(self, pages: torch.Tensor) -> bool:
        """Whether every page of ``pages`` (an integer tensor, any shape and device) is allocated (True
        for no pages).

        Raises
        ------
        TypeError
            ``pages`` is not an integer tensor (a bool tensor would index as a mask, not as pages).
        """
        return self._all_owned(id_tensor(pages, "pages", allow_negative=True))

    def _all_owned(self, ids: torch.Tensor) -> bool:
        """:meth:`all_allocated` of int64 CPU ``ids`` (a negative id must not index from the end)."""
        in_range = bool(((ids >= 0) & (ids < self.num_pages)).all())
        return in_range and bool(self._owned_mask[ids].all())

    def alloc(self, num_pages: int, *, owner: int | None = None) -> torch.Tensor:
        """Allocate ``num_pages`` pages from the front of the free list, for request row ``owner``
        (default: no owner).

        Returns
        -------
        torch.Tensor
            int64 ``[num_pages]`` page ids on the CPU.

        Raises
        ------
        TypeError
            ``num_pages`` or ``owner`` is not an int (a bool or a float included).
        ValueError
            ``num_pages`` or ``owner`` is negative.
        AllocatorExhaustedError
            Fewer pages are available (or the ``exhausted_error`` given); nothing changed, the
            released pages included.
        """
        num_pages = int_in(num_pages, "num_pages", 0)
        owner_id = self._owner_id(owner)
        if num_pages == 0:  # most decode tokens start no page: no slicing, no mask write
            return torch.empty(0, dtype=torch.int64)
        if num_pages > self.available_pages:
            raise self.exhausted_error(f"sparsekv: {self.name} allocator needs {num_pages} pages, "
                                       f"{self.available_pages} free")
        if num_pages > self._free.numel():
            self._reuse_released()
        pages, self._free = self._free[:num_pages], self._free[num_pages:]
        self._owned_mask[pages] = True
        self._owner[pages] = owner_id
        return pages.clone()

    def free(self, pages: torch.Tensor, *, owner: int | None = None) -> None:
        """Return ``pages`` (each allocated, each named once), on behalf of request row ``owner``.

        Raises
        ------
        TypeError
            ``pages`` is not an integer tensor (float ids are never truncated), or ``owner`` not an int.
        ValueError
            A page that is not allocated (a double free, the reserved page, out of range) or named
            twice; nothing is freed then.
        RequestStateError
            A page owned by a request row other than ``owner`` (any row, without ``owner``); nothing
            is freed then.
        """
        ids = id_tensor(pages, "pages", allow_negative=True)
        owner = None if owner is None else self._owner_id(owner)
        if ids.numel() == 0:
            return
        if not self._all_owned(ids) or torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"sparsekv: argument `pages` names pages the {self.name} allocator has not allocated "
                             f"(or names one twice): {ids.tolist()}")
        self.check_owner(ids, owner, "freed")
        self._owned_mask[ids] = False
        self._owner[ids] = NO_OWNER
        self._released.append(ids.clone())
        if not self.deferred_reuse:
            self._reuse_released()

    def _reuse_released(self) -> None:
        """The released pages join the back of the free list, sorted."""
        self._free = torch.cat([self._free, torch.sort(torch.cat(self._released)).values])
        self._released = []

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The distinct pages holding ``slots`` (an integer tensor; negative slots ignored), ascending."""
        slots = id_tensor(slots, "slots", allow_negative=True)
        return torch.unique(slots[slots >= 0] // self.page_size)


#: How a message names each phase a coordinator holds a row in.
_HELD_WORDS = {"transfer": "holding direct-transfer host slots in the coordinator",
               "staging": "staging in the coordinator", "decode": "decoding in the coordinator"}


class HiSparseTokenToKVPoolAllocator:
    """Logical full-token allocator plus the device allocator of the HiSparse hot pool.

    Parameters
    ----------
    size : int
        Full tokens the device pool is sized for; the logical space holds
        ``size_full = size * host_to_device_ratio`` of them.
    page_size : int
        Full tokens per logical page (256 for DSV4); a multiple of ``compress_ratio``.
    host_to_device_ratio : int
        Logical over device capacity (default 2).
    compress_ratio : int
        Full tokens per device entry: 4 for DSV4 C4, 1 for an uncompressed (DSA-style) pool.
    device : torch.device or str
        Where :attr:`full_to_hisparse_device_index_mapping` lives.

    Attributes
    ----------
    page_slots : int
        Device slots per page: ``page_size // compress_ratio`` (64 for DSV4).
    num_device_pages : int
        Device pages, the reserved page 0 included (the device pool's page count).
    full_to_hisparse_device_index_mapping : torch.Tensor
        int64 ``[size_full // compress_ratio + page_slots + 1]``: device slot of each logical
        compressed location, -1 when it is not on the device (the last entry always -1).

    Examples
    --------
    >>> a = HiSparseTokenToKVPoolAllocator(size=1024, page_size=256)
    >>> req_to_token = torch.zeros(4, 2048, dtype=torch.int64)
    >>> full = a.alloc_extend(req_to_token, 0, 0, 300)          # a 300-token prefill
    >>> a.device_slots(a.compressed_locs(full)).tensor.numel()  # its 75 C4 entries are on the device
    75
    """

    def __init__(self, size: int, page_size: int, *, host_to_device_ratio: int = 2, compress_ratio: int = 4,
                 device: torch.device | str = "cpu") -> None:
        size, page_size = int_in(size, "size", 0), int_in(page_size, "page_size", 1)
        compress_ratio = int_in(compress_ratio, "compress_ratio", 1)
        host_to_device_ratio = int_in(host_to_device_ratio, "host_to_device_ratio", 1)
        if page_size % compress_ratio:
            raise ValueError(f"sparsekv: argument `page_size` ({page_size}) must be a multiple of `compress_ratio` "
                             f"({compress_ratio})")
        self.size = size
        self.size_full = size * host_to_device_ratio
        self.page_size = page_size
        self.compress_ratio = compress_ratio
        self.page_slots = page_size // compress_ratio
        # Each logical and device page's owner is the request row it was allocated for: a row may
        # continue only its own last page, never one a stale row entry points into.
        self.logical = PagedAllocator(self.size_full // page_size + 1, page_size, "logical")
        # Rows a coordinator holds, by phase ("transfer", "staging", "decode"): see hold_row.
        self._held_rows: dict[int, str] = {}
        self.num_device_pages = size // compress_ratio // self.page_slots + 1
        self.device_alloc = PagedAllocator(self.num_device_pages, self.page_slots, "device")
        self.full_to_hisparse_device_index_mapping = torch.full(
            (self.size_full // compress_ratio + self.page_slots + 1,), -1, dtype=torch.int64, device=device)

    # ---- logical space ------------------------------------------------------------------

    def available_size(self) -> int:
        """Full tokens that can still be admitted: the smaller of the logical and device budgets."""
        return min(self.logical.available_pages * self.page_size,
                   self.device_alloc.available_pages * self.page_slots * self.compress_ratio)

    def logical_row(self, loc: int) -> int:
        """The request row whose allocation took the logical page of location ``loc``; -1 when that
        page is not allocated (or ``loc`` is outside the logical space)."""
        return self.logical.owner_of(as_int(loc, "loc") // self.page_size)

    def logical_pages_of_row(self, rid: int) -> set[int]:
        """The allocated logical pages whose allocation was for request row ``rid``."""
        return set(self.logical.pages_owned_by(rid).tolist())

    # ---- rows a coordinator holds -------------------------------------------------------

    def hold_row(self, rid: int, phase: str) -> None:
        """Mark request row ``rid`` as held by a coordinator in ``phase`` (``"transfer"``,
        ``"staging"`` or ``"decode"``; the coordinator calls this at each change of phase).

        While a row is held, :meth:`free_logical` and :meth:`free_device_buffer` refuse it (the
        coordinator's release frees its pages, after :meth:`release_row`), and while it is staging
        or decoding :meth:`alloc_extend` refuses it (its table row is the coordinator's record).
        """
        self._held_rows[as_int(rid, "rid")] = phase

    def release_row(self, rid: int) -> None:
        """Row ``rid`` is no longer held (its coordinator is releasing or has released it)."""
        self._held_rows.pop(as_int(rid, "rid"), None)

    def held_phase(self, rid: int) -> str | None:
        """The phase a coordinator holds row ``rid`` in; None when it is not held."""
        return self._held_rows.get(rid)

    def _refuse_held(self, rid: int, action: str, phases: tuple[str, ...] = ("transfer", "staging", "decode")) -> None:
        phase = self._held_rows.get(rid)
        if phase in phases:
            raise RequestStateError(f"sparsekv: request row {rid} is {_HELD_WORDS[phase]}; {action}")

    def compressed_locs(self, full_locs: torch.Tensor) -> torch.Tensor:
        """Logical compressed locations produced by ``full_locs`` (an integer tensor): keep
        ``(loc + 1) % ratio == 0``, store at ``loc // ratio``."""
        int_tensor(full_locs, "full_locs")
        return compressed_locs_of(full_locs, self.compress_ratio)

    def _check_row(self, req_to_token: torch.Tensor, rid: int, prefix_len: int, seq_len: int,
                   with_device: bool, prefix_name: str = "prefix_len") -> tuple[int, int, int]:
        """Validate an extend of row ``rid`` from ``prefix_len`` to ``seq_len`` (nothing allocated yet).

        A prefix ending inside a logical page continues that page, so its last location must be in a
        page this allocator holds; with device slots, a prefix whose last C4 entry ends inside a
        device page continues that page too, so the entry must be on the device.
        """
        index_table(req_to_token, "req_to_token", ndim=2)
        rows, width = req_to_token.shape
        rid = index_in(rid, "rid", rows)
        prefix_len = int_in(prefix_len, prefix_name, 0, width)
        seq_len = int_in(seq_len, "seq_len", prefix_len, width)
        if prefix_len % self.page_size:
            last = int(req_to_token[rid, prefix_len - 1])
            owner = self.logical_row(last)
            if owner < 0:
                raise ValueError(f"sparsekv: argument `{prefix_name}` = {prefix_len} continues a logical page, but "
                                 f"req_to_token[{rid}, {prefix_len - 1}] = {last} is not in an allocated page")
            if owner != rid:
                raise ValueError(f"sparsekv: argument `{prefix_name}` = {prefix_len} continues logical page "
                                 f"{last // self.page_size}, which belongs to request row {owner}, not row {rid}")
            first_entry = prefix_len // self.compress_ratio
            if with_device and seq_len // self.compress_ratio > first_entry and first_entry % self.page_slots:
                locs = self.compressed_locs(req_to_token[rid, :prefix_len].cpu())
                slot = int(self.full_to_hisparse_device_index_mapping[locs[-1]]) if locs.numel() else -1
                dpage = slot // self.page_slots
                if not self.device_alloc.is_allocated(dpage):
                    raise ValueError(f"sparsekv: argument `{prefix_name}` = {prefix_len} continues a device page, but "
                                     f"the prefix's last C4 entry of row {rid} is not on the device")
        return rid, prefix_len, seq_len

    def _logical_locs(self, req_to_token: torch.Tensor, rid: int, prefix_len: int, seq_len: int) -> torch.Tensor:
        """Full locations for positions ``[prefix_len, seq_len)``, continuing the last logical page."""
        page = self.page_size
        new_pages = -(-seq_len // page) - -(-prefix_len // page)
        pages = self.logical.alloc(new_pages, owner=rid)
        if prefix_len % page:
            last = int(req_to_token[rid, prefix_len - 1]) // page
            pages = torch.cat([torch.tensor([last]), pages])
        first_page_pos = prefix_len // page * page
        positions = torch.arange(prefix_len, seq_len)
        return pages[(positions - first_page_pos) // page] * page + positions % page

    def alloc_extend(self, req_to_token: torch.Tensor, rid: int, prefix_len: int, seq_len: int, *,
                     with_device: bool = True) -> torch.Tensor:
        """Allocate a prefill (chunk): logical locations for positions ``[prefix_len, seq_len)`` of
        request row ``rid``, and device slots for the compressed entries they produce.

        ``req_to_token[rid, prefix_len:seq_len]`` receives the full locations and the mapping the
        entries' device slots (position-ordered inside the request's device pages). With
        ``with_device=False`` only logical locations are allocated: the KV goes straight into the
        host pool (PD direct-to-host).

        Returns
        -------
        torch.Tensor
            int64 full locations of the new positions.

        Raises
        ------
        TypeError
            ``req_to_token`` is not an integer tensor, or an int argument is not an int.
        IndexError
            ``rid`` is not a row of ``req_to_token``.
        ValueError
            Not ``0 <= prefix_len <= seq_len <= req_to_token.shape[1]``, or a prefix ending inside a
            page that the row does not hold (its last location is not allocated or was allocated
            to another row, or its last C4 entry is not on the device when device slots are
            wanted); nothing was allocated.
        RequestStateError
            The row is staging or decoding in a coordinator (:meth:`hold_row`): its table row is
            the coordinator's record, and a decoding row grows by :meth:`alloc_decode`.
        AllocatorExhaustedError
            Not enough logical or device pages; nothing was allocated.
        """
        with_device = as_bool(with_device, "with_device")
        rid, prefix_len, seq_len = self._check_row(req_to_token, rid, prefix_len, seq_len, with_device)
        self._refuse_held(rid, "alloc_extend cannot rewrite its req_to_token row (a decoding row grows by "
                          "alloc_decode)", ("staging", "decode"))
        page, dpage, ratio = self.page_size, self.page_slots, self.compress_ratio
        logical_pages = -(-seq_len // page) - -(-prefix_len // page)
        first_entry, end_entry = prefix_len // ratio, seq_len // ratio
        if not with_device:
            end_entry = first_entry
        device_pages = -(-end_entry // dpage) - -(-first_entry // dpage)
        if logical_pages > self.logical.available_pages or device_pages > self.device_alloc.available_pages:
            raise AllocatorExhaustedError(
                f"sparsekv: a {seq_len - prefix_len}-token extend needs {logical_pages} logical and {device_pages} "
                f"device pages; {self.logical.available_pages} and {self.device_alloc.available_pages} are free")
        full = self._logical_locs(req_to_token, rid, prefix_len, seq_len)
        req_to_token[rid, prefix_len:seq_len] = full.to(req_to_token.device)
        if end_entry > first_entry:
            pages = self.device_alloc.alloc(device_pages, owner=rid)
            if first_entry % dpage:
                last_loc = self.compressed_locs(req_to_token[rid, :prefix_len].cpu())[-1]
                last = int(self.full_to_hisparse_device_index_mapping[last_loc]) // dpage
                pages = torch.cat([torch.tensor([last]), pages])
            entries = torch.arange(first_entry, end_entry)
            slots = pages[(entries - first_entry // dpage * dpage) // dpage] * dpage + entries % dpage
            mapping = self.full_to_hisparse_device_index_mapping
            mapping[self.compressed_locs(full).to(mapping.device)] = slots.to(mapping.device)
        return full

    def alloc_decode(self, req_to_token: torch.Tensor, rid: int, seq_len: int) -> int:
        """The logical location of position ``seq_len - 1`` (a decode token); logical space only,
        since a decode token's compressed entry lands in the request's hot buffer.

        Raises
        ------
        TypeError, IndexError, ValueError
            As :meth:`alloc_extend` (``seq_len >= 1``).
        AllocatorExhaustedError
            The token starts a page and no logical page is free.
        """
        seq_len = int_in(seq_len, "seq_len", 1)
        rid, _, seq_len = self._check_row(req_to_token, rid, seq_len - 1, seq_len, False, "seq_len - 1")
        loc = int(self._logical_locs(req_to_token, rid, seq_len - 1, seq_len)[0])
        req_to_token[rid, seq_len - 1] = loc
        return loc

    def free_logical(self, full_locs: torch.Tensor, *, rid: int) -> None:
        """Free the logical pages of a finished request row ``rid`` (``full_locs``: all its locations).

        Raises
        ------
        TypeError
            ``full_locs`` is not an integer tensor, or ``rid`` not an int.
        ValueError
            A page that is not allocated; nothing is freed then.
        RequestStateError
            A page of another request row, or row ``rid`` is still held by a coordinator
            (``request_finished`` first); nothing is freed then.
        """
        rid = int_in(rid, "rid", 0)
        pages = self.logical.pages_of(id_tensor(full_locs, "full_locs", allow_negative=True))
        self.logical.check_owner(pages, rid, "freed", name="full_locs")
        self._refuse_held(rid, "free_logical must wait for its request_finished")
        self.logical.free(pages, owner=rid)

    # ---- device space -------------------------------------------------------------------

    def device_slots(self, compressed_locs: torch.Tensor) -> DeviceSlots:
        """Device slots of logical compressed locations, through the mapping.

        Raises
        ------
        TypeError
            ``compressed_locs`` is not an integer tensor.
        IndexError
            A location outside the mapping (a negative one included).
        """
        mapping = self.full_to_hisparse_device_index_mapping
        locs = id_tensor(compressed_locs, "compressed_locs", size=mapping.numel())
        return DeviceSlots(mapping[locs.to(mapping.device)].cpu())

    def alloc_device_buffer(self, compressed_locs: torch.Tensor, need: int, *, rid: int) -> DeviceSlots:
        """Turn request row ``rid``'s device slots into its hot buffer of ``need`` slots (new pages
        are allocated for ``rid``).

        ``compressed_locs`` are the request's entries in position order (its whole prefill after
        staging; empty when the KV came straight into the host pool). ``need`` is the hot buffer
        plus one page, ``H + page_slots``; slot ``H`` is reserved for the newest entry.

        * More entries than ``H + 1``: the newest entry's slot is swapped into position ``H``, the
          first ``need`` slots are kept and the pages holding none of them are freed.
        * Fewer than ``need``: the rest of the last page, then new pages, fill up the buffer.

        Afterwards the mapping names buffer slot ``p`` for positions ``p < H``, slot ``H`` for
        the newest entry, and -1 for every other entry of the request (it lives on the host now).

        Returns
        -------
        DeviceSlots
            ``need`` device slots: buffer column -> slot; position ``p < min(P, H)`` keeps its slot.

        Raises
        ------
        TypeError
            ``compressed_locs`` is not an integer tensor, or ``need`` or ``rid`` not an int.
        IndexError
            A location outside the mapping.
        ValueError
            An entry is not on the device (or its slot is in a page the allocator does not hold), an
            entry named twice, or ``need`` is not ``H + page_slots`` with ``H >= 1``; nothing changed.
        RequestStateError
            An entry's slot is in a device page of another request row; nothing changed.
        AllocatorExhaustedError
            A top-up needs more pages than are free; nothing changed.
        """
        dpage = self.page_slots
        need = as_int(need, "need")
        rid = int_in(rid, "rid", 0)
        hot = need - dpage
        if hot < 1:
            raise ValueError(f"sparsekv: argument `need` ({need}) must be a hot buffer plus one page of {dpage}")
        mapping = self.full_to_hisparse_device_index_mapping
        cpu_locs = id_tensor(compressed_locs, "compressed_locs", size=mapping.numel())
        if torch.unique(cpu_locs).numel() != cpu_locs.numel():
            raise ValueError("sparsekv: argument `compressed_locs` names an entry twice")
        locs = cpu_locs.to(mapping.device)
        slots = mapping[locs].cpu().clone()
        if bool((slots < 0).any()):
            raise ValueError("sparsekv: argument `compressed_locs` names entries that are not on the device")
        if not self.device_alloc.all_allocated(self.device_alloc.pages_of(slots)):
            raise ValueError("sparsekv: argument `compressed_locs` names entries in unallocated device pages")
        count = slots.numel()
        owned = self.device_alloc.pages_of(slots)
        self.device_alloc.check_owner(owned, rid, "made a hot buffer", name="compressed_locs")
        # Entries fill their pages in position order, so only the newest entry's page has spare
        # slots; read it before the swap below moves that entry to column H.
        newest_page = int(slots[-1]) // dpage if count else 0
        if count > hot + 1:
            slots[[hot, count - 1]] = slots[[count - 1, hot]]
        if count >= need:
            buffer = slots[:need]
        else:
            tail = count % dpage
            spare_slots = newest_page * dpage + torch.arange(tail, dpage) if tail else \
                torch.empty(0, dtype=torch.int64)
            missing = need - count - spare_slots.numel()
            new_pages = (self.device_alloc.alloc(-(-missing // dpage), owner=rid) if missing > 0
                         else torch.empty(0, dtype=torch.int64))
            new_slots = (new_pages[:, None] * dpage + torch.arange(dpage)).reshape(-1)
            buffer = torch.cat([slots, spare_slots, new_slots])[:need]
        surplus = owned[~torch.isin(owned, self.device_alloc.pages_of(buffer))]
        self.device_alloc.free(surplus, owner=rid)
        mapping[locs] = -1
        kept = min(count, hot)
        mapping[locs[:kept]] = buffer[:kept].to(mapping.device)
        if count > hot:
            mapping[locs[count - 1]] = int(buffer[hot])
        return DeviceSlots(buffer)

    def free_device_buffer(self, slots: DeviceSlots, *, rid: int) -> None:
        """Free the pages of request row ``rid``'s device slots (its hot buffer, or its prefill).

        Raises
        ------
        TypeError
            ``slots`` is not :class:`DeviceSlots`, or ``rid`` not an int.
        ValueError
            A page that is not allocated; nothing is freed then.
        RequestStateError
            A page of another request row, or row ``rid`` is held by a coordinator (whose
            ``request_finished`` frees it); nothing is freed then.
        """
        pages = self.device_alloc.pages_of(DeviceSlots.require(slots, "slots").tensor)
        rid = int_in(rid, "rid", 0)
        self.device_alloc.check_owner(pages, rid, "freed", name="slots")
        self._refuse_held(rid, "its device slots are freed by its request_finished")
        self.device_alloc.free(pages, owner=rid)

    def device_pages_of(self, slots: DeviceSlots) -> DevicePages:
        """The distinct device pages holding ``slots``."""
        return DevicePages(self.device_alloc.pages_of(DeviceSlots.require(slots, "slots").tensor))

"""``HiSparseHostPoolMixin``: page-granular allocation of a host pool, addressed per token.

HiSparse keeps every token of a request in the host pool and copies single tokens to the device,
but allocates (and frees) whole host pages, so whole-page backups can move opaque page rows.
A request's host slots live in a table ``req_to_host_pool[req, position]`` (-1 = none yet) with
``allocated_len[req]`` slots allocated so far, always a multiple of the page size.

Each page records the request row it was allocated for (``alloc_paged_token_slots`` allocates for
its ``req_pool_idx``): a free that names another row, or none, is refused naming the owner.

Freeing is lazy: freed pages wait in a release list and join the free list only when an
allocation needs them, so a page freed during a step is not handed out again within it while
in-flight copies may still read it.
"""

from __future__ import annotations

import torch

from sparsekv.checks import index_in, int_in
from sparsekv.srt.checks import index_table
from sparsekv.srt.mem_cache.allocators import PagedAllocator
from sparsekv.srt.mem_cache.ids import HostPages, HostSlots


class HostPoolExhaustedError(RuntimeError):
    """The host pool has fewer free pages than an allocation needs (admission should retry later)."""


class HiSparseHostPoolMixin:
    """Page-granular allocation of ``num_pages`` host pages of ``page_slots`` slots, addressed per token.

    The pages come from a :class:`~sparsekv.srt.mem_cache.allocators.PagedAllocator` (``page_alloc``:
    every page usable, freed pages reused lazily). The host class calls :meth:`_init_page_allocator`
    once it knows its geometry (``page_slots`` and ``num_pages`` attributes).
    """

    page_slots: int
    num_pages: int

    def _init_page_allocator(self) -> None:
        self.page_alloc = PagedAllocator(self.num_pages, self.page_slots, "host pool", reserve_page_0=False,
                                         deferred_reuse=True, exhausted_error=HostPoolExhaustedError)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can still get (free plus lazily released)."""
        return self.page_alloc.available_pages

    def alloc_page(self, num_pages: int, *, owner: int | None = None) -> HostPages:
        """Allocate ``num_pages`` host pages for request row ``owner`` (default none)
        (:meth:`PagedAllocator.alloc <sparsekv.srt.mem_cache.allocators.PagedAllocator.alloc>`).

        Raises
        ------
        TypeError
            ``num_pages`` or ``owner`` is not an int (a bool or a float included).
        ValueError
            ``num_pages`` or ``owner`` is negative.
        HostPoolExhaustedError
            Fewer pages are available; nothing changed (the lazily released pages stay where they are).
        """
        return HostPages(self.page_alloc.alloc(num_pages, owner=owner))

    def free_pages(self, pages: HostPages, *, owner: int | None = None) -> None:
        """Return pages to the pool on behalf of request row ``owner``, lazily: they are reused only
        when the free list runs dry (:meth:`PagedAllocator.free
        <sparsekv.srt.mem_cache.allocators.PagedAllocator.free>`).

        Raises
        ------
        TypeError
            ``pages`` is not :class:`HostPages`, or ``owner`` not an int.
        ValueError
            A page is not allocated (a double free) or named twice; nothing is freed then.
        RequestStateError
            A page owned by a request row other than ``owner`` (any row, without ``owner``);
            nothing is freed then.
        """
        self.page_alloc.free(HostPages.require(pages, "pages").tensor, owner=owner)

    def host_pages_needed(self, start_pos: int, num_tokens: int, allocated_len: int) -> int:
        """Pages :meth:`alloc_paged_token_slots` would allocate for this request (admission pre-check).

        Raises
        ------
        TypeError, ValueError
            An argument is not a non-negative int.
        """
        start_pos, num_tokens = int_in(start_pos, "start_pos", 0), int_in(num_tokens, "num_tokens", 0)
        allocated_len = int_in(allocated_len, "allocated_len", 0)
        page_end = -(-(start_pos + num_tokens) // self.page_slots) * self.page_slots
        return max(0, page_end - allocated_len) // self.page_slots

    def alloc_paged_token_slots(self, req_to_host_pool: torch.Tensor, allocated_len: torch.Tensor,
                                req_pool_idx: int, start_pos: int, num_tokens: int) -> HostSlots:
        """Host slots for positions ``[start_pos, start_pos + num_tokens)`` of request ``req_pool_idx``.

        Whole pages are allocated (for row ``req_pool_idx``) up to the page holding the last position and recorded in
        ``req_to_host_pool[req_pool_idx, allocated:page_end]``; ``allocated_len[req_pool_idx]``
        becomes ``page_end``.

        Parameters
        ----------
        req_to_host_pool : torch.Tensor
            int64 ``[max_reqs, max_positions]`` host slot table (-1 = unallocated), any device.
        allocated_len : torch.Tensor
            int64 ``[max_reqs]`` on the CPU: slots allocated per request (a multiple of ``page_slots``).
        req_pool_idx, start_pos, num_tokens : int
            The request row and the positions wanted.

        Returns
        -------
        HostSlots
            ``num_tokens`` host slots (a copy of the table's entries).

        Raises
        ------
        TypeError
            A table that is not an integer tensor, or an int argument that is not an int.
        IndexError
            ``req_pool_idx`` is not a row of both tables.
        ValueError
            ``start_pos`` is beyond the allocated length (positions would be skipped), ``num_tokens``
            is negative, the table is too narrow, or the row's allocated length is not a multiple of
            the page size within the table; nothing changed.
        HostPoolExhaustedError
            Not enough free pages; nothing was allocated.
        """
        req_pool_idx = self._check_row(req_to_host_pool, allocated_len, req_pool_idx)
        allocated = int(allocated_len[req_pool_idx])
        start_pos = int_in(start_pos, "start_pos", 0)
        if start_pos > allocated:
            raise ValueError(f"sparsekv: argument `start_pos` = {start_pos} must be in [0, {allocated}], the "
                             f"slots allocated to request {req_pool_idx}")
        num_tokens = int_in(num_tokens, "num_tokens", 0)
        page_end = -(-(start_pos + num_tokens) // self.page_slots) * self.page_slots
        if page_end > req_to_host_pool.shape[1]:
            raise ValueError(f"sparsekv: argument `req_to_host_pool` has {req_to_host_pool.shape[1]} positions per "
                             f"request, {page_end} needed")
        if page_end > allocated:
            new_pages = self.alloc_page((page_end - allocated) // self.page_slots, owner=req_pool_idx)
            slots = new_pages.slots(self.page_slots).tensor
            req_to_host_pool[req_pool_idx, allocated:page_end] = slots.to(req_to_host_pool.device)
            allocated_len[req_pool_idx] = page_end
        return HostSlots(req_to_host_pool[req_pool_idx, start_pos : start_pos + num_tokens].clone())

    def _check_row(self, req_to_host_pool: torch.Tensor, allocated_len: torch.Tensor, req_pool_idx: int) -> int:
        """Validate a request row of the two tables (see :meth:`alloc_paged_token_slots`); its index."""
        index_table(req_to_host_pool, "req_to_host_pool", ndim=2)
        index_table(allocated_len, "allocated_len", ndim=1)
        if allocated_len.device.type != "cpu":
            raise ValueError(f"sparsekv: argument `allocated_len` must be on the CPU, got {allocated_len.device}")
        rows = min(req_to_host_pool.shape[0], allocated_len.shape[0])
        req_pool_idx = index_in(req_pool_idx, "req_pool_idx", rows)
        allocated = int(allocated_len[req_pool_idx])
        if allocated < 0 or allocated % self.page_slots or allocated > req_to_host_pool.shape[1]:
            raise ValueError(f"sparsekv: argument `allocated_len`[{req_pool_idx}] = {allocated} must be a multiple "
                             f"of {self.page_slots} in [0, {req_to_host_pool.shape[1]}]")
        return req_pool_idx

    def allocated_host_indices(self, req_to_host_pool: torch.Tensor, req_pool_idx: int,
                               allocated_len: int) -> HostSlots:
        """Every host slot allocated to a request (whole pages), e.g. to free them.

        Raises
        ------
        TypeError
            ``req_to_host_pool`` is not an integer tensor, or an int argument is not an int.
        IndexError
            ``req_pool_idx`` is not a row of the table.
        ValueError
            ``allocated_len`` is negative.
        """
        index_table(req_to_host_pool, "req_to_host_pool", ndim=2)
        req_pool_idx = index_in(req_pool_idx, "req_pool_idx", req_to_host_pool.shape[0])
        allocated_len = int_in(allocated_len, "allocated_len", 0)
        row = req_to_host_pool[req_pool_idx, :allocated_len]
        return HostSlots(row[row >= 0].clone())

    def free(self, slots: HostSlots, *, owner: int | None = None) -> None:
        """Free the pages of ``slots``, which must be whole aligned pages (as allocated), on behalf
        of request row ``owner``.

        Raises
        ------
        TypeError
            ``slots`` is not :class:`HostSlots`.
        ValueError
            ``slots`` is not made of whole pages, or a page is not allocated.
        RequestStateError
            A page owned by a request row other than ``owner``; nothing is freed then.
        """
        pages = HostSlots.require(slots, "slots").whole_pages(self.page_slots)
        if pages is None:
            if len(slots) == 0:
                return
            raise ValueError(f"sparsekv: argument `slots` must be whole aligned host pages of {self.page_slots} slots")
        self.free_pages(pages, owner=owner)

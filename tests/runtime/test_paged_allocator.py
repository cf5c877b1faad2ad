"""The one page allocator of the logical, device and host pools (``PagedAllocator``), on its own.

A hypothesis state machine draws the allocator's flavour (page 0 reserved or not, freed pages reused
at once or deferred until an allocation needs them) and interleaves allocations, frees and misuse
(double frees, the reserved page, out-of-range and repeated ids, bools and floats for counts,
float ids, allocations beyond the available pages, a page freed for a request row other than its
owner or for none). It holds the allocator to the documented order
(pages from the front of the free list; a free's pages, or with deferred reuse everything released
since the last allocation that needed them, sorted to its back), each page to one owner, and every
refused call to no change at all. The runtime's machine (test_runtime_state_machine.py) runs the
three allocators inside the coordinator.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparsekv.srt.errors import RequestStateError
from sparsekv.srt.mem_cache.allocators import NO_OWNER, AllocatorExhaustedError, PagedAllocator
from sparsekv.srt.mem_cache.hisparse_host_pool import HostPoolExhaustedError
from sparsekv.testing.profiles import scaled_examples


class PagedAllocatorMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(1, 9), reserve=st.booleans(), deferred=st.booleans())
    def make(self, num_pages, reserve, deferred):
        self.error = HostPoolExhaustedError if deferred else AllocatorExhaustedError
        self.alloc = PagedAllocator(num_pages, 4, "test", reserve_page_0=reserve, deferred_reuse=deferred,
                                    exhausted_error=self.error)
        self.reserved = {0} if reserve else set()
        self.deferred = deferred
        # The documented order: hand out from the front of `free`; released batches join its back sorted.
        self.free = [p for p in range(num_pages) if p not in self.reserved]
        self.released: list[int] = []
        self.owned: set[int] = set()
        self.owner: dict[int, int | None] = {}  # page -> the request row it was allocated for

    def state(self):
        a = self.alloc
        return a._free.clone(), [t.clone() for t in a._released], a._owned_mask.clone(), a._owner.clone()

    def refused(self, call, error):
        before = self.state()
        with pytest.raises(error):
            call()
        after = self.state()
        assert all(torch.equal(before[i], after[i]) for i in (0, 2, 3))
        assert len(before[1]) == len(after[1]) and all(torch.equal(x, y) for x, y in zip(before[1], after[1]))

    @rule(data=st.data())
    def alloc_pages(self, data):
        available = len(self.free) + len(self.released)
        n = data.draw(st.integers(0, available), label="pages")
        if n > len(self.free):
            self.free += sorted(self.released)
            self.released = []
        expected, self.free = self.free[:n], self.free[n:]
        owner = data.draw(st.sampled_from([None, 0, 1, 2]), label="owner")
        got = self.alloc.alloc(n, owner=owner)
        assert got.dtype == torch.int64 and got.tolist() == expected
        self.owned |= set(expected)
        self.owner |= dict.fromkeys(expected, owner)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_pages(self, data):
        owner = self.owner[data.draw(st.sampled_from(sorted(self.owned)), label="owner's page")]
        mine = sorted(p for p in self.owned if self.owner[p] == owner)
        pages = data.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True), label="freed")
        self.alloc.free(torch.tensor(pages, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))),
                        owner=owner)
        self.owned -= set(pages)
        if self.deferred:
            self.released += pages
        else:
            self.free += sorted(pages)

    @rule(data=st.data())
    def misuse(self, data):
        a, n = self.alloc, self.alloc.num_pages
        unowned = [p for p in range(-1, n + 2) if p not in self.owned]
        calls = {
            "alloc beyond the available pages": (lambda: a.alloc(a.available_pages + 1), self.error),
            "alloc a bool": (lambda: a.alloc(True), TypeError),
            "alloc a float": (lambda: a.alloc(1.0), TypeError),
            "alloc a negative count": (lambda: a.alloc(-1), ValueError),
            "free float ids": (lambda: a.free(torch.tensor([0.0])), TypeError),
            "free bool ids": (lambda: a.free(torch.tensor([True])), TypeError),
            "free a page not allocated": (lambda: a.free(torch.tensor([data.draw(st.sampled_from(unowned))])),
                                          ValueError),
        }
        if self.owned:
            page = min(self.owned)
            calls["free a page twice in one call"] = (lambda: a.free(torch.tensor([page, page])), ValueError)
            calls["free an owned page with one that is not"] = (
                lambda: a.free(torch.tensor([page, unowned[0]]), owner=self.owner[page]), ValueError)
            owned_by_rows = sorted(p for p in self.owned if self.owner[p] is not None)
            if owned_by_rows:  # a page of a request row, freed for another row or for none
                victim = owned_by_rows[0]
                thief = data.draw(st.sampled_from([None] + [r for r in (0, 1, 2) if r != self.owner[victim]]))
                calls["free another row's page"] = (lambda: a.free(torch.tensor([victim]), owner=thief),
                                                    RequestStateError)
            calls["free with a bool owner"] = (lambda: a.free(torch.tensor([page]), owner=True), TypeError)
        kind = data.draw(st.sampled_from(sorted(calls)), label="misuse")
        self.refused(*calls[kind])

    @invariant()
    def pages_have_one_owner_in_the_documented_order(self):
        a = self.alloc
        assert a._free.tolist() == self.free
        assert sorted(torch.cat([torch.empty(0, dtype=torch.int64), *a._released]).tolist()) == sorted(self.released)
        assert a.used_pages == self.owned and a.available_pages == len(self.free) + len(self.released)
        assert [a.is_allocated(p) for p in range(-1, a.num_pages + 1)] == \
            [p in self.owned for p in range(-1, a.num_pages + 1)]
        assert a.all_allocated(torch.tensor(sorted(self.owned), dtype=torch.int64))
        assert [a.owner_of(p) for p in range(-1, a.num_pages + 1)] == \
            [NO_OWNER if self.owner.get(p) is None or p not in self.owned else self.owner[p]
             for p in range(-1, a.num_pages + 1)]


TestPagedAllocator = PagedAllocatorMachine.TestCase
TestPagedAllocator.settings = settings(settings.default, max_examples=scaled_examples(30), stateful_step_count=30)


def test_pages_of_are_the_distinct_pages_of_the_slots_ascending():
    a = PagedAllocator(8, 64, "device")
    assert a.pages_of(torch.tensor([300, -1, 64, 65, 0, 127])).tolist() == [0, 1, 4]
    with pytest.raises(TypeError, match="slots"):
        a.pages_of(torch.tensor([1.5]))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_pages": 0}, ValueError, "num_pages"), ({"page_size": 2.0}, TypeError, "page_size"),
    ({"reserve_page_0": 1}, TypeError, "reserve_page_0"), ({"deferred_reuse": "no"}, TypeError, "deferred_reuse"),
])
def test_the_allocator_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        PagedAllocator(**{"num_pages": 4, "page_size": 64, "name": "test", **kwargs})


def test_all_allocated_reads_any_integer_ids_and_refuses_others_naming_the_argument():
    a = PagedAllocator(6, 4, "device")
    pages = a.alloc(3)
    for dtype in (torch.int16, torch.int32, torch.int64):
        assert a.all_allocated(pages.to(dtype)) and a.all_allocated(pages.to(dtype).reshape(3, 1))
        assert not a.all_allocated(torch.tensor([1, 4], dtype=dtype))
        assert not a.all_allocated(torch.tensor([-5, 1], dtype=dtype))  # never read as "from the end"
    # A bool tensor is not a list of pages (indexing would read it as a mask over all of them).
    for ids in (torch.tensor([1.0]), torch.tensor([False, True, True, True, False, False])):
        with pytest.raises(TypeError, match="`pages`"):
            a.all_allocated(ids)


def test_a_free_keeps_its_own_copy_of_the_pages_it_defers():
    a = PagedAllocator(6, 4, "host", reserve_page_0=False, deferred_reuse=True)
    pages = a.alloc(4)
    a.free(pages[:2])  # a view of the caller's tensor, which the caller then reuses
    pages.fill_(5)
    assert a.alloc(4).tolist() == [4, 5, 0, 1] and a.used_pages == {0, 1, 2, 3, 4, 5}

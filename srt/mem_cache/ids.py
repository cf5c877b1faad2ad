"""Typed id vectors: host-pool and device-pool ids, slots and pages, are four different namespaces.

Host slot 0 and device slot 0 are different tokens, and a page id is not a slot id: mixing them up
moves plausible-looking wrong bytes instead of failing (sglang once lost a token to exactly this, an
off-by-one between the host and device slot spaces). So the pools never take a bare tensor: a
transfer takes :class:`HostSlots` and :class:`DeviceSlots`, the host allocator returns
:class:`HostPages` / :class:`HostSlots`, and passing one kind where another is expected raises
``TypeError``. A slot is ``page * page_slots + offset`` in its own pool.

Example
-------
>>> pages = HostPages(torch.tensor([3]))
>>> pages.slots(64).tensor[:2]
tensor([192, 193])
"""

from __future__ import annotations

import torch

from sparsekv.checks import int_in

_INDEX_DTYPES = (torch.int32, torch.int64)


class _Ids:
    """A 1-D int32/int64 tensor of ids of one namespace (the subclass)."""

    __slots__ = ("tensor",)
    _kind = "ids"

    def __init__(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, _Ids):
            raise TypeError(f"sparsekv: {type(tensor).__name__} cannot become {type(self).__name__}: "
                            "host/device slots and pages are different id spaces")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INDEX_DTYPES or tensor.dim() != 1:
            raise TypeError(f"sparsekv: {type(self).__name__} wraps a 1-D int32/int64 tensor, got "
                            f"{tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__}"
                            f"{list(tensor.shape) if isinstance(tensor, torch.Tensor) else ''}")
        self.tensor = tensor

    def __len__(self) -> int:
        return self.tensor.numel()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tensor.tolist() if len(self) <= 8 else f'<{len(self)} ids>'})"

    @classmethod
    def require(cls, value: object, name: str) -> _Ids:
        """``value`` if it is of this kind, else a ``TypeError`` naming the argument and the kind it got."""
        if not isinstance(value, cls):
            got = type(value).__name__
            raise TypeError(f"sparsekv: argument `{name}` must be {cls.__name__} ({cls._kind}), got {got}"
                            + ("; wrap the tensor in the id type of its pool" if got == "Tensor" else ""))
        return value


class _Slots(_Ids):
    _pages_type: type[_Ids]

    def whole_pages(self, page_slots: int) -> _Ids | None:
        """The page ids, when these slots are whole aligned pages in order (``[64p, 64p + 64)`` runs
        for 64-slot pages); None otherwise (a token-granular set). ``page_slots``: a positive int."""
        page_slots = int_in(page_slots, "page_slots", 1)
        n = len(self)
        if n == 0 or n % page_slots:
            return None
        runs = self.tensor.reshape(-1, page_slots)
        first = runs[:, 0]
        offsets = torch.arange(page_slots, device=runs.device, dtype=runs.dtype)
        if bool((first % page_slots).any()) or not bool((runs == first[:, None] + offsets).all()):
            return None
        return self._pages_type(torch.div(first, page_slots, rounding_mode="floor"))


class _Pages(_Ids):
    _slots_type: type[_Ids]

    def slots(self, page_slots: int) -> _Ids:
        """Every slot of these pages, page by page (``page_slots``: a positive int)."""
        page_slots = int_in(page_slots, "page_slots", 1)
        offsets = torch.arange(page_slots, device=self.tensor.device, dtype=self.tensor.dtype)
        return self._slots_type((self.tensor[:, None] * page_slots + offsets).reshape(-1))


class HostPages(_Pages):
    """Page ids of a host pool (row ``p`` of each host layer buffer)."""

    _kind = "host-pool page ids"


class HostSlots(_Slots):
    """Token slot ids of a host pool (page ``s // page_slots``, offset ``s % page_slots``)."""

    _kind = "host-pool token slots"
    _pages_type = HostPages


class DevicePages(_Pages):
    """Page ids of a device pool."""

    _kind = "device-pool page ids"


class DeviceSlots(_Slots):
    """Token slot ids of a device pool."""

    _kind = "device-pool token slots"
    _pages_type = DevicePages


HostPages._slots_type = HostSlots
DevicePages._slots_type = DeviceSlots

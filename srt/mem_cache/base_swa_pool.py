"""``BaseSWAKVPool``: a token-to-KV pool with a sliding-window (SWA) part.

The radix tree and ``req_to_token`` hold full-token locations only; the SWA allocator owns a
``full_to_swa_index_mapping`` that gives each full location its SWA slot. A pool of this kind
takes that mapping, translates through it, and lists its SWA-addressed state for PD transfer
(``get_state_buf_infos``): disaggregation routes every ``BaseSWAKVPool`` as SWA state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from sparsekv.srt.checks import index_table, int_tensor


class BufInfos(NamedTuple):
    """Registered memory regions: base pointers, byte lengths and the bytes of one item each.

    An item is what one transfer index addresses (one page row, one state ring).
    """

    data_ptrs: list[int]
    data_lens: list[int]
    item_lens: list[int]

    @classmethod
    def of(cls, buffers: list[torch.Tensor], item_lens: list[int]) -> BufInfos:
        """Regions of ``buffers`` (contiguous tensors) with the given item sizes."""
        return cls([b.data_ptr() for b in buffers], [b.nbytes for b in buffers], list(item_lens))

    def __add__(self, other: BufInfos) -> BufInfos:  # type: ignore[override]
        return BufInfos(self.data_ptrs + other.data_ptrs, self.data_lens + other.data_lens,
                        self.item_lens + other.item_lens)


class BaseSWAKVPool(ABC):
    """A KV pool with an SWA sub-pool addressed through ``full_to_swa_index_mapping``."""

    full_to_swa_index_mapping: torch.Tensor | None = None

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        """Adopt the SWA allocator's full -> SWA location table (int64, -1 for "no SWA slot").

        Raises
        ------
        TypeError
            The table is not an integer tensor (a bool one included).
        ValueError
            The table is not one-dimensional.
        """
        index_table(full_to_swa_index_mapping, "full_to_swa_index_mapping", ndim=1)
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, full_loc: torch.Tensor) -> torch.Tensor:
        """SWA locations of full locations ``full_loc`` (any shape).

        Raises
        ------
        TypeError
            ``full_loc`` is not an integer tensor.
        RuntimeError
            No mapping was registered.
        """
        int_tensor(full_loc, "full_loc")
        if self.full_to_swa_index_mapping is None:
            raise RuntimeError("register_mapping() must be called before translating full -> SWA locations")
        return self.full_to_swa_index_mapping[full_loc]

    @abstractmethod
    def get_contiguous_buf_infos(self) -> BufInfos:
        """The page-addressed KV regions (one transfer index = one full-token page)."""

    @abstractmethod
    def get_state_buf_infos(self) -> BufInfos:
        """The SWA-addressed regions (one transfer index = one SWA page)."""

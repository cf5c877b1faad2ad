"""``HostKVCache``: the base of host-memory mirrors of a device KV pool.

A host pool owns host buffers and moves tokens between them and a device pool's buffers; the
kernels doing the moves know nothing of pools (``srt`` calls ``jit_kernel``, never the reverse).
This base holds what every host pool shares: geometry, host allocation (pinned when CUDA is
present, so the GPU can read it directly; plain otherwise), the transfer-index check and the
abstract transfer API.

Lifecycle: construct (allocates and zero-fills the host buffers), then any number of
``backup_from_device_all_layer`` / ``load_to_device_per_layer`` calls; buffers live as long as
the pool object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from sparsekv.checks import int_in
from sparsekv.deprecation import renamed_keywords
from sparsekv.srt.mem_cache.base_swa_pool import BufInfos
from sparsekv.srt.mem_cache.ids import DeviceSlots, HostSlots


class HostKVCache(ABC):
    """Host mirror of a device KV pool.

    Parameters
    ----------
    layer_num : int
        Layers held.
    page_slots : int
        Token slots per page; formerly ``page_size=``, which still works for one release (with a
        ``DeprecationWarning``).
    num_pages : int
        Host pages; the pool holds ``size = num_pages * page_slots`` token slots.
    pin_memory : bool, optional
        Pin the host buffers (default: exactly when CUDA is available).
    device : torch.device, optional
        Where the mirrored device buffers live (default: the CPU).

    Raises
    ------
    TypeError
        A size that is not an int (a bool or a float included).
    ValueError
        A non-positive size, ``pin_memory=True`` without CUDA, or ``pin_memory=False`` for CUDA
        device buffers.
    """

    @renamed_keywords(page_size="page_slots")
    def __init__(self, *, layer_num: int, page_slots: int, num_pages: int, pin_memory: bool | None = None,
                 device: torch.device | str = "cpu") -> None:
        layer_num, page_slots = int_in(layer_num, "layer_num", 1), int_in(page_slots, "page_slots", 1)
        num_pages = int_in(num_pages, "num_pages", 1)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise ValueError("sparsekv: argument `pin_memory` is True, but pinning host memory needs CUDA")
        if not pin_memory and torch.device(device).type == "cuda":
            # The copy kernels run on the GPU and address the host buffers directly; pageable
            # memory is not mapped for the device, so the first copy would fault.
            raise ValueError(f"sparsekv: argument `pin_memory` is False, but the device buffers are on {device}: "
                             "GPU kernels can only read and write pinned host memory")
        self.layer_num = layer_num
        self.page_slots = page_slots
        self.num_pages = num_pages
        self.size = num_pages * page_slots
        self.pin_memory = pin_memory

    def _alloc_host(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-filled uint8 host tensor, pinned when the pool pins."""
        return torch.zeros(shape, dtype=torch.uint8, pin_memory=self.pin_memory)

    @staticmethod
    def _has_transfer_indices(host_indices: HostSlots | None, device_indices: DeviceSlots | None) -> bool:
        """Whether a transfer has anything to move.

        Returns
        -------
        bool
            False when either side is None or empty, True otherwise.

        Raises
        ------
        TypeError
            ``host_indices`` is not :class:`HostSlots` or ``device_indices`` not :class:`DeviceSlots`
            (a bare tensor, or ids of the other pool).
        ValueError
            The two sides have different lengths.
        """
        if host_indices is None or device_indices is None:
            return False
        HostSlots.require(host_indices, "host_indices")
        DeviceSlots.require(device_indices, "device_indices")
        if len(host_indices) != len(device_indices):
            raise ValueError(f"sparsekv: arguments `host_indices` ({len(host_indices)} slots) and "
                             f"`device_indices` ({len(device_indices)} slots) must have the same length")
        return len(host_indices) > 0

    @abstractmethod
    def get_size_per_token(self) -> int:
        """Host bytes per token slot, page padding included."""

    @abstractmethod
    def get_contiguous_buf_infos(self) -> BufInfos:
        """Per-layer host regions for direct writes by a transfer engine."""

    @abstractmethod
    def backup_from_device_all_layer(self, host_indices: HostSlots, device_indices: DeviceSlots) -> None:
        """Copy device slots ``device_indices[i]`` to host slots ``host_indices[i]``, every layer."""

    @abstractmethod
    def load_to_device_per_layer(self, host_indices: HostSlots, device_indices: DeviceSlots, layer_id: int, *,
                                 owner: int | None = None) -> None:
        """Copy host slots ``host_indices[i]`` to device slots ``device_indices[i]`` of one layer, on
        behalf of request row ``owner``."""

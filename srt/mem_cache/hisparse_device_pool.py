"""``HiSparseC4DevicePool``: the device C4 pool of a HiSparse DSV4 model.

With HiSparse the C4 KV of each request lives in the host pool; the device keeps only the hot
buffers (and each prefill until it is backed up). The pool is a per-layer stack of V4 page rows
(:data:`sparsekv.kv_layout.V4`, 64 slots, 37,440 bytes per page), exactly the host
pool's rows, so whole pages and single tokens move with the same addressing on both sides.

Writes are addressed through the allocator's ``full_to_hisparse_device_index_mapping``: the
compressor's C4 entry for full location ``loc`` (produced where ``(loc + 1) % 4 == 0``) goes to
device slot ``mapping[loc // 4]``.
"""

from __future__ import annotations

import torch

from sparsekv.checks import int_in
from sparsekv.kv_layout import V4
from sparsekv.srt.mem_cache.allocators import HiSparseTokenToKVPoolAllocator
from sparsekv.srt.mem_cache.ids import DeviceSlots

COMPRESS_RATIO = 4


class HiSparseC4DevicePool:
    """Per-layer V4 page buffers of the HiSparse hot pool.

    Parameters
    ----------
    allocator : HiSparseTokenToKVPoolAllocator
        The allocator of this pool (``compress_ratio=4``); its device pages size the buffers and
        its mapping addresses the writes.
    num_layers : int
        C4 layers.
    device : torch.device or str
        Where the buffers live.

    Attributes
    ----------
    kv_buffer : list of torch.Tensor
        Per layer, uint8 ``[num_pages, 37440]``; page 0 is the reserved padding page.

    Raises
    ------
    TypeError
        ``allocator`` is not a :class:`HiSparseTokenToKVPoolAllocator` or ``num_layers`` not an int.
    ValueError
        The allocator is not a C4 (ratio 4) allocator, or ``num_layers < 1``.
    """

    def __init__(self, allocator: HiSparseTokenToKVPoolAllocator, num_layers: int, device: torch.device | str) -> None:
        if not isinstance(allocator, HiSparseTokenToKVPoolAllocator):
            raise TypeError(f"sparsekv: argument `allocator` must be a HiSparseTokenToKVPoolAllocator, got "
                            f"{type(allocator).__name__}")
        if allocator.compress_ratio != COMPRESS_RATIO:
            raise ValueError(f"sparsekv: HiSparseC4DevicePool needs a compress_ratio {COMPRESS_RATIO} allocator, got "
                             f"{allocator.compress_ratio}")
        num_layers = int_in(num_layers, "num_layers", 1)
        self.allocator = allocator
        self.page_slots = allocator.page_slots
        self.page_bytes = V4.page_bytes(self.page_slots)
        self.num_pages = allocator.num_device_pages
        self.size = (self.num_pages - 1) * self.page_slots
        self.device = torch.device(device)
        self.kv_buffer = [torch.zeros(self.num_pages, self.page_bytes, dtype=torch.uint8, device=self.device)
                          for _ in range(num_layers)]

    @property
    def layer_num(self) -> int:
        """C4 layers held."""
        return len(self.kv_buffer)

    def translate_loc_from_full_to_compressed(self, full_loc: torch.Tensor) -> torch.Tensor:
        """Logical C4 locations produced by full locations: keep ``(loc + 1) % 4 == 0``, store at ``loc // 4``."""
        return self.allocator.compressed_locs(full_loc)

    def translate_loc_to_hisparse_device(self, compressed_loc: torch.Tensor) -> DeviceSlots:
        """Device slots of logical C4 locations (-1 where the entry is not on the device)."""
        return self.allocator.device_slots(compressed_loc)

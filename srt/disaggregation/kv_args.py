"""``KVArgs``: the regions one side of a PD transfer registers, and ``StateType``.

The KV part is the pool's page-addressed regions (``get_contiguous_buf_infos``: one transfer
index = one full-token page, the same page id in every region). The state part is a list of
*components*, one per :class:`StateType` occurrence, each with its own regions and index space;
both sides list the components in the same order (:func:`~.state_routing.setup_state_kv_args`
decides them, for the prefill and the decode side alike; :func:`~.state_routing.kv_args_of` builds
a pool's ``KVArgs``).

Every region also carries a *label* naming what it holds (``"c4_kv:5"``: the C4 KV of layer 5;
``"state:3"`` for pools without a layer layout). The two sides match regions by label, never by
position, so a PP stage writes exactly its own layers into a decode pool holding all of them, and
a region the other side lacks is an error, not a shifted write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

MEM_KINDS = ("DRAM", "VRAM")


class StateType(str, Enum):
    """Kinds of per-request state sent beside the KV pages, with their wire names.

    ``SWA``: sliding-window KV pages plus whatever is addressed by SWA page (DSV4: the C4
    attention and indexer compressor rings); index = SWA page. ``C128_STATE``: request-scoped
    state (DSV4: the C128 compressor rings); index = request slot. ``MAMBA``: linear-attention
    state of hybrid-linear models; index = state slot. ``DSA``: the sparse-attention indexer keys
    of DSA models; index = full-token page.
    """

    SWA = "swa"
    C128_STATE = "c128_state"
    MAMBA = "mamba"
    DSA = "dsa"


@dataclass
class KVArgs:
    """Registered regions and parallel layout of one side (one PP stage, one attention TP rank).

    Attributes
    ----------
    kv_data_ptrs, kv_data_lens, kv_item_lens : list of int
        KV regions: base address, bytes, bytes of one item (one page row).
    kv_labels : list of str
        What each KV region holds (see the module docstring).
    kv_mem_kinds : list of str
        ``"DRAM"`` or ``"VRAM"`` per KV region.
    state_types : list of StateType
        One per state component, in wire order.
    state_data_ptrs, state_data_lens, state_item_lens : list of list of int
        Per component, its regions (parallel to ``state_types``).
    state_labels, state_mem_kinds : list of list of str
        Per component, per region.
    mla_compression_ratios : list of int, optional
        Per layer of ``layers``: 0 (SWA only), 4 or 128; None for pools without compressed layers.
    layers : tuple of int
        The layers ``[start, end)`` this side holds.
    page_size : int
        Full tokens per KV page.
    attn_tp_size, attn_tp_rank : int
        Attention tensor parallelism of this side.
    is_mla : bool
        Whether the KV is MLA (one latent per token, replicated over TP ranks).
    owners : list
        The objects owning the regions (pools, host pools), kept alive as long as these args: the
        pointers are raw, and a transfer engine writing into a collected pool's memory would
        fault or corrupt whatever reused it.
    """

    kv_data_ptrs: list[int] = field(default_factory=list)
    kv_data_lens: list[int] = field(default_factory=list)
    kv_item_lens: list[int] = field(default_factory=list)
    kv_labels: list[str] = field(default_factory=list)
    kv_mem_kinds: list[str] = field(default_factory=list)
    state_types: list[StateType] = field(default_factory=list)
    state_data_ptrs: list[list[int]] = field(default_factory=list)
    state_data_lens: list[list[int]] = field(default_factory=list)
    state_item_lens: list[list[int]] = field(default_factory=list)
    state_labels: list[list[str]] = field(default_factory=list)
    state_mem_kinds: list[list[str]] = field(default_factory=list)
    mla_compression_ratios: list[int] | None = None
    layers: tuple[int, int] = (0, 0)
    page_size: int = 1
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    is_mla: bool = True
    owners: list = field(default_factory=list, repr=False)

    def add_state(self, state_type: StateType, infos, labels: list[str], mem_kind: str) -> None:
        """Append one state component (``infos``: ``(ptrs, lens, item_lens)`` of its regions).

        Raises
        ------
        ValueError
            ``labels`` does not name every region once, or ``mem_kind`` is not DRAM/VRAM.
        """
        ptrs, lens, item_lens = (list(x) for x in infos)
        check_region_list(f"{StateType(state_type).value} state", ptrs, lens, item_lens, labels, mem_kind)
        self.state_types.append(StateType(state_type))
        self.state_data_ptrs.append(ptrs)
        self.state_data_lens.append(lens)
        self.state_item_lens.append(item_lens)
        self.state_labels.append(list(labels))
        self.state_mem_kinds.append([mem_kind] * len(ptrs))

    def clear_state(self) -> None:
        """Drop every state component."""
        for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_labels",
                     "state_mem_kinds"):
            setattr(self, name, [])

    def regions(self) -> list[tuple[int, int, str]]:
        """Every region ``(ptr, bytes, mem_kind)``, KV first: what a transfer backend registers."""
        out = list(zip(self.kv_data_ptrs, self.kv_data_lens, self.kv_mem_kinds))
        for ptrs, lens, kinds in zip(self.state_data_ptrs, self.state_data_lens, self.state_mem_kinds):
            out += list(zip(ptrs, lens, kinds))
        return out


def check_region_list(what: str, ptrs, lens, item_lens, labels, mem_kind: str) -> None:
    if not len(ptrs) == len(lens) == len(item_lens) == len(labels):
        raise ValueError(f"sparsekv: {what}: {len(ptrs)} pointers, {len(lens)} lengths, {len(item_lens)} item "
                         f"lengths and {len(labels)} labels must be equal in number")
    if len(set(labels)) != len(labels):
        raise ValueError(f"sparsekv: {what}: region labels must be unique, got {labels}")
    if mem_kind not in MEM_KINDS:
        raise ValueError(f"sparsekv: argument `mem_kind` must be one of {MEM_KINDS}, got {mem_kind!r}")
    for label, length, item in zip(labels, lens, item_lens):
        if item <= 0 or length < item:
            raise ValueError(f"sparsekv: {what}: region {label!r} of {length} B cannot hold one {item}-B item")


def mem_kind_of(pool) -> str:
    """``"VRAM"`` for a pool on a CUDA device, ``"DRAM"`` otherwise."""
    device = getattr(pool, "device", None)
    return "VRAM" if device is not None and str(device).startswith("cuda") else "DRAM"

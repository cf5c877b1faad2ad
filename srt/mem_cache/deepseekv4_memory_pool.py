"""``DeepSeekV4TokenToKVPool``: the device buffers of one PP stage of a DSV4 model.

Built from the :class:`~sparsekv.srt.model_executor.pool_configurator.MemoryPoolConfig` that the
stage's :class:`~sparsekv.srt.model_executor.pool_configurator.DSV4PoolConfigurator` sized, with
the byte geometry of :mod:`sparsekv.srt.model_executor.dsv4_geometry`, so what is allocated is
what was budgeted: per component, within the one reserved page per layer.

Sub-pools (``L`` = stage layers, ``L4`` / ``L128`` = its C4 / C128 layers):

============================  ======  =======================  =================================
pool                          layers  entries                  one page / item
============================  ======  =======================  =================================
SWA KV (FlashMLA V4)          L       ``swa``                  ``page_size`` slots, 584 B each
C4 KV                         L4      ``c4`` (HiSparse: 1/r)   ``page_size // 4`` slots
C4 indexer keys (FP8)         L4      ``full // 4``            ``page_size // 4`` x 132 B
C128 KV                       L128    ``c128``                 ``page_size // 128`` slots
C4 attention / indexer state  L4      ``c4_state`` ring slots  one ring per SWA page
C128 state (request-scoped)   L128    slots x 128-slot ring    one ring per request slot
============================  ======  =======================  =================================

Addressing: full-token locations come from a paged allocator (``loc % page_size`` is the position
in the page), so a compressed entry needs no allocator of its own: C4 entry ``k`` of a sequence is
written at full location ``4k + 3`` and stored at ``loc // 4`` (C128 alike), and one page id names
the same positions in the full, C4, indexer and C128 pools. Page 0 of every paged pool is the
reserved padding page.
"""

from __future__ import annotations

import torch

from sparsekv.checks import as_int
from sparsekv.srt.checks import int_tensor
from sparsekv.srt.mem_cache.allocators import compressed_locs_of
from sparsekv.srt.mem_cache.base_swa_pool import BaseSWAKVPool, BufInfos
from sparsekv.srt.model_executor import dsv4_geometry as geo
from sparsekv.srt.model_executor.pool_configurator import DSV4PoolConfigurator, MemoryPoolConfig

STATE_DTYPES = {4: torch.float32, 2: torch.bfloat16}


class PagedBufferPool:
    """Per-layer ``[num_pages, page_bytes]`` uint8 buffers of a paged pool.

    ``num_pages = size // page_slots + 1``: every whole page of ``size`` entries plus page 0,
    the reserved padding page.
    """

    def __init__(self, size: int, page_slots: int, page_bytes: int, num_layers: int, device: torch.device):
        self.size = size
        self.page_slots = page_slots
        self.page_bytes = page_bytes
        self.num_pages = size // page_slots + 1
        self.buffers = [
            torch.zeros(self.num_pages, page_bytes, dtype=torch.uint8, device=device) for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's buffer."""
        return sum(b.nbytes for b in self.buffers)

    def buf_infos(self) -> BufInfos:
        """One region per layer; an item is one page row."""
        return BufInfos.of(self.buffers, [self.page_bytes] * len(self.buffers))


class CompressStatePool:
    """Per-layer ``[rows, row_values]`` compressor states: a ``(kv, score)`` pair per row.

    The first half of a row holds kv (cleared to 0), the second half the scores (cleared to
    ``-inf``). ``scratch_row`` absorbs the writes of padded tokens.
    """

    def __init__(self, rows: int, ring_size: int, row_values: int, scratch_row: int, num_layers: int,
                 dtype: torch.dtype, device: torch.device):
        self.rows = rows
        self.ring_size = ring_size
        self.row_values = row_values
        self.scratch_row = scratch_row
        self.buffers = [torch.zeros(rows, row_values, dtype=dtype, device=device) for _ in range(num_layers)]
        for buffer in self.buffers:
            buffer[:, row_values // 2 :] = float("-inf")

    @property
    def row_bytes(self) -> int:
        """Bytes of one state row."""
        return self.row_values * (self.buffers[0].element_size() if self.buffers else 0)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's buffer."""
        return sum(b.nbytes for b in self.buffers)

    def buf_infos(self) -> BufInfos:
        """One region per layer; an item is one ring (one SWA page, or one request slot)."""
        return BufInfos.of(self.buffers, [self.row_bytes * self.ring_size] * len(self.buffers))


class DeepSeekV4TokenToKVPool(BaseSWAKVPool):
    """Every KV, indexer and compressor-state buffer of one PP stage of a DSV4 model.

    Parameters
    ----------
    config : MemoryPoolConfig
        The stage's finalized sizes (``max_running_requests`` resolved).
    configurator : DSV4PoolConfigurator
        The configurator that sized ``config``: it fixes the stage's layers, page size, rings,
        head sizes, state dtype and request slots.
    device : torch.device or str
        Where to allocate (``"cpu"`` in tests); required, nothing is inferred.

    Raises
    ------
    TypeError
        ``configurator`` is not a DSV4 configurator or ``config`` not a ``MemoryPoolConfig``.
    ValueError
        ``config`` is not finalized or not a DSV4 plan, or the model's head is not the 584-byte
        FlashMLA V4 layout (448 nope + 64 rope).

    Examples
    --------
    >>> from sparsekv.srt.model_executor.model_spec import ParallelSpec, ServerSpec, dsv4_preset
    >>> from sparsekv.srt.model_executor.pool_planner import plan_pipeline
    >>> model = dsv4_preset("dsv4-flash", num_hidden_layers=4)
    >>> rank = plan_pipeline(model, ServerSpec(max_running_requests=2), 64 << 20).ranks[0]
    >>> pool = DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device="cpu")
    >>> pool.swa_kv_pool.page_bytes
    149760
    """

    def __init__(self, config: MemoryPoolConfig, configurator: DSV4PoolConfigurator, device: str | torch.device):
        self._check_inputs(config, configurator)
        c = configurator
        self.device = torch.device(device)
        self.page_size = c.page_size
        self.start_layer, self.end_layer = c.layers
        self.stage_compress_ratios = c.stage_compress_ratios
        self.size = config.full_max_total_num_tokens
        self.max_running_requests = config.max_running_requests
        self.num_req_slots = c.num_req_slots(config.max_running_requests)
        self.ring_sizes = dict(c.ring_sizes)
        state_dtype = STATE_DTYPES[c.state_dtype_bytes]

        # layer id -> (ratio, index among the stage's layers of that ratio)
        self.layer_mapping: dict[int, tuple[int, int]] = {}
        seen = {0: 0, 4: 0, 128: 0}
        for layer_id, ratio in zip(range(self.start_layer, self.end_layer), self.stage_compress_ratios):
            self.layer_mapping[layer_id] = (ratio, seen[ratio])
            seen[ratio] += 1
        num_c4, num_c128 = seen[4], seen[128]

        page = self.page_size
        self.swa_kv_pool = PagedBufferPool(
            config.swa_max_total_num_tokens, page, geo.kv_page_bytes(page), len(self.stage_compress_ratios), self.device
        )
        c4_page_slots = geo.kv_page_slots(page, 4)
        self.c4_kv_pool = PagedBufferPool(
            config.c4_max_total_num_tokens, c4_page_slots, geo.kv_page_bytes(c4_page_slots), num_c4, self.device
        )
        # The indexer scores every logical C4 entry, so HiSparse never shrinks it.
        self.c4_indexer_pool = PagedBufferPool(
            self.size // 4, c4_page_slots, c4_page_slots * geo.indexer_bytes_per_entry(c.index_head_dim), num_c4,
            self.device
        )
        c128_page_slots = geo.kv_page_slots(page, 128)
        self.c128_kv_pool = PagedBufferPool(
            config.c128_max_total_num_tokens, c128_page_slots, geo.kv_page_bytes(c128_page_slots), num_c128, self.device
        )
        # SWA-addressed rings: ring 0 belongs to the reserved SWA page 0 and doubles as scratch.
        ring4 = self.ring_sizes.get(4, 0)
        c4_rows = config.c4_state_pool_size + ring4
        self.c4_state_pool = CompressStatePool(
            c4_rows, ring4, geo.compress_state_row_values(4, c.attn_head_dim), 0, num_c4, state_dtype, self.device
        )
        self.c4_indexer_state_pool = CompressStatePool(
            c4_rows, ring4, geo.indexer_state_row_values(c.index_head_dim), 0, num_c4, state_dtype, self.device
        )
        # Request-addressed rings: the configurator's fixed-cost rows; the last row is scratch.
        c128_rows = c.c128_state_rows(config.max_running_requests)
        self.c128_state_pool = CompressStatePool(
            c128_rows, self.ring_sizes.get(128, 0), geo.compress_state_row_values(128, c.attn_head_dim),
            c128_rows - 1, num_c128, state_dtype, self.device,
        )

    @staticmethod
    def _check_inputs(config: MemoryPoolConfig, configurator: DSV4PoolConfigurator) -> None:
        if not isinstance(configurator, DSV4PoolConfigurator):
            raise TypeError(f"configurator must be a DSV4PoolConfigurator, got {type(configurator).__name__}")
        if not isinstance(config, MemoryPoolConfig):
            raise TypeError(f"config must be a MemoryPoolConfig, got {type(config).__name__}")
        if config.max_running_requests is None:
            raise ValueError("config.max_running_requests is unset: finalize the plan before building the pool")
        if config.full_max_total_num_tokens is None or config.swa_max_total_num_tokens is None:
            raise ValueError("config is not a DSV4 plan: full_max_total_num_tokens / swa_max_total_num_tokens unset")
        nope = configurator.attn_head_dim - configurator.qk_rope_head_dim
        token_bytes = nope + 2 * configurator.qk_rope_head_dim + nope // 64 + 1
        if token_bytes != geo.KV_BYTES_PER_TOKEN:
            raise ValueError(
                f"the FlashMLA V4 layout stores {geo.KV_BYTES_PER_TOKEN} B per token (448 fp8 nope + 64 bf16 rope "
                f"+ 8 scale bytes); head_dim={configurator.attn_head_dim}, "
                f"qk_rope_head_dim={configurator.qk_rope_head_dim} gives {token_bytes}"
            )

    # ---- layers -----------------------------------------------------------------------

    def _layer(self, layer_id: int) -> tuple[int, int]:
        """(ratio, index among the stage's layers of that ratio) of ``layer_id``; ``TypeError`` for a
        non-int (``22.0`` and ``True`` would hash like ints), ``IndexError`` outside the stage."""
        layer_id = as_int(layer_id, "layer_id")
        if layer_id not in self.layer_mapping:
            raise IndexError(f"sparsekv: argument `layer_id`: layer {layer_id} is not in this stage's layers "
                             f"[{self.start_layer},{self.end_layer})")
        return self.layer_mapping[layer_id]

    def get_swa_kv_buffer(self, layer_id: int) -> torch.Tensor:
        """The SWA KV page buffer of ``layer_id``: uint8 ``[num_pages, page_bytes]``."""
        self._layer(layer_id)
        return self.swa_kv_pool.buffers[layer_id - self.start_layer]

    def get_compressed_kv_buffer(self, layer_id: int) -> torch.Tensor | None:
        """The C4 or C128 KV page buffer of ``layer_id``, ``None`` for an SWA-only layer."""
        ratio, index = self._layer(layer_id)
        if ratio == 0:
            return None
        return (self.c4_kv_pool if ratio == 4 else self.c128_kv_pool).buffers[index]

    def get_indexer_buffer(self, layer_id: int) -> torch.Tensor | None:
        """The C4 indexer key buffer of ``layer_id``, ``None`` unless it is a C4 layer."""
        ratio, index = self._layer(layer_id)
        return self.c4_indexer_pool.buffers[index] if ratio == 4 else None

    def get_compress_state(self, layer_id: int) -> torch.Tensor | None:
        """The attention compressor state of ``layer_id`` (C4 or C128), ``None`` for SWA-only."""
        ratio, index = self._layer(layer_id)
        if ratio == 0:
            return None
        return (self.c4_state_pool if ratio == 4 else self.c128_state_pool).buffers[index]

    def get_indexer_state(self, layer_id: int) -> torch.Tensor | None:
        """The C4 indexer compressor state of ``layer_id``, ``None`` unless it is a C4 layer."""
        ratio, index = self._layer(layer_id)
        return self.c4_indexer_state_pool.buffers[index] if ratio == 4 else None

    # ---- locations --------------------------------------------------------------------

    @staticmethod
    def translate_loc_from_full_to_compressed(full_loc: torch.Tensor, compress_ratio: int) -> torch.Tensor:
        """Compressed locations produced by full locations ``full_loc`` (1-D); see
        :func:`~sparsekv.srt.mem_cache.allocators.compressed_locs_of`.

        Raises
        ------
        TypeError
            ``full_loc`` is not an integer tensor or ``compress_ratio`` not an int.
        ValueError
            ``compress_ratio`` is not 4 or 128.
        """
        int_tensor(full_loc, "full_loc")
        if as_int(compress_ratio, "compress_ratio") not in geo.COMPRESS_RATIOS:
            raise ValueError(f"compress_ratio must be one of {geo.COMPRESS_RATIOS}, got {compress_ratio}")
        return compressed_locs_of(full_loc, compress_ratio)

    def c4_state_loc(self, swa_loc: torch.Tensor) -> torch.Tensor:
        """Ring rows of SWA locations (an integer tensor): ``(swa_loc // page) * ring + swa_loc % ring``;
        -1 stays -1."""
        int_tensor(swa_loc, "swa_loc")
        ring = self.ring_sizes.get(4, 0)
        rows = swa_loc // self.page_size * ring + swa_loc % max(ring, 1)
        return torch.where(swa_loc < 0, torch.full_like(swa_loc, -1), rows)

    def c128_state_loc(self, req_pool_idx: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Ring rows of request slots and positions (integer tensors): ``req * ring + position % ring``."""
        int_tensor(req_pool_idx, "req_pool_idx")
        int_tensor(position, "position")
        ring = self.ring_sizes.get(128, 0)
        return req_pool_idx * ring + position % max(ring, 1)

    # ---- disaggregation ---------------------------------------------------------------

    def get_contiguous_buf_infos(self) -> BufInfos:
        """C4 KV, then C4 indexer, then C128 KV regions, one per layer; an item is one page row.

        The order is the PD wire layout. The SWA KV is not here: it is SWA state.
        """
        return self.c4_kv_pool.buf_infos() + self.c4_indexer_pool.buf_infos() + self.c128_kv_pool.buf_infos()

    def get_state_buf_infos(self) -> BufInfos:
        """SWA KV pages (one per stage layer), then the C4 attention and indexer state rings.

        One SWA page index addresses an SWA KV page and, at the same index, its ring in every C4
        state pool.
        """
        return self.swa_kv_pool.buf_infos() + self.c4_state_pool.buf_infos() + self.c4_indexer_state_pool.buf_infos()

    def get_request_state_buf_infos(self) -> BufInfos:
        """The request-scoped C128 state rings, one region per C128 layer; an item is one slot's ring."""
        return self.c128_state_pool.buf_infos()

    # ---- accounting -------------------------------------------------------------------

    def _components(self) -> dict[str, PagedBufferPool | CompressStatePool]:
        return {
            "swa_kv": self.swa_kv_pool,
            "c4_kv": self.c4_kv_pool,
            "c4_indexer": self.c4_indexer_pool,
            "c128_kv": self.c128_kv_pool,
            "c4_state": self.c4_state_pool,
            "c4_indexer_state": self.c4_indexer_state_pool,
            "c128_state": self.c128_state_pool,
        }

    def component_nbytes(self) -> dict[str, int]:
        """Allocated bytes per component, keyed as ``DSV4PoolConfigurator.component_bytes``."""
        return {name: pool.nbytes for name, pool in self._components().items()}

    def component_page_bytes(self) -> dict[str, int]:
        """Bytes of one page (paged pools) or one ring (state pools) of one layer, per component."""
        pages = {}
        for name, pool in self._components().items():
            pages[name] = pool.page_bytes if isinstance(pool, PagedBufferPool) else pool.row_bytes * pool.ring_size
        return pages

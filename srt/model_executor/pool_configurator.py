"""Memory pool configurators: how many KV tokens of each pool fit in a byte budget.

Every configurator models the budget as ``available_bytes = tokens * coeff + bias`` and has two
entry points over one core computation:

* ``calculate_pool_sizes(available_bytes, page_size)``: the profiling path, bytes -> tokens;
* ``calculate_pool_sizes_from_max_tokens(max_total_num_tokens, page_size)``: the constraint path,
  used when a user cap or the MIN over pipeline ranks shrinks the token count; it re-derives every
  sub-pool from the smaller count (the fixed pools are not re-subtracted).

``finalize_with_max_running_requests(config)`` sizes what depends on the request count once the
consumer has resolved it (DSV4's request-scoped C128 compressor state).

The numbers follow sglang 0.5.23's configurators (its DSV4, hybrid-SWA and default ones), including
its float arithmetic, so that a plan computed here equals the one an sglang server derives. Pure
planning: nothing here imports torch or touches a device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sparsekv.checks import int_in

from . import dsv4_geometry as geo
from .model_spec import (
    DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO,
    DSV4ModelSpec,
    MHAModelSpec,
    ParallelSpec,
    ServerSpec,
    SpeculativeSpec,
)

logger = logging.getLogger(__name__)

ModelSpec = DSV4ModelSpec | MHAModelSpec


@dataclass
class MemoryPoolConfig:
    """Resolved pool sizes of one rank.

    ``max_running_requests`` is filled in by the consumer, not by the configurator. For hybrid SWA
    and DSV4 models ``max_total_num_tokens`` equals the full pool.

    Raises
    ------
    RuntimeError
        If ``max_total_num_tokens <= 0``: the budget holds no KV at all.
    """

    max_total_num_tokens: int
    max_running_requests: int | None = None
    full_max_total_num_tokens: int | None = None
    swa_max_total_num_tokens: int | None = None
    c4_max_total_num_tokens: int = 0
    c128_max_total_num_tokens: int = 0
    c4_state_pool_size: int = 0
    c128_state_pool_size: int = 0

    def __post_init__(self) -> None:
        if self.max_total_num_tokens <= 0:
            raise RuntimeError(
                f"Not enough memory for the KV cache: max_total_num_tokens={self.max_total_num_tokens}. "
                "Increase the KV budget (in sglang: --mem-fraction-static)."
            )


class MemoryPoolConfigurator:
    """Base class: sizes pools from a byte budget or from a token count.

    Both sizing paths return a :class:`MemoryPoolConfig` with ``max_running_requests`` unset.
    """

    #: PP stage layers ``[start, end)`` this configurator sizes.
    layers: tuple[int, int]

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        """Profiling path: size every pool from ``available_bytes`` of this rank."""
        raise NotImplementedError

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        """Constraint path: re-size every pool from a (smaller) full-pool token count."""
        raise NotImplementedError

    def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
        """Size what depends on ``config.max_running_requests``; the base class has nothing."""
        return config

    @staticmethod
    def validate_swa_pool_size(swa_tokens: int, sliding_window_size: int | None, page_size: int) -> None:
        """Reject an SWA pool too small to ever admit a request.

        Prefill charges up to a window plus a page of SWA slots per request, so a pool at or below
        that floor rejects every request and the server would spin at warmup instead of failing.

        Raises
        ------
        ValueError
            If ``sliding_window_size + page_size >= swa_tokens``.
        """
        if sliding_window_size is None:
            return
        if sliding_window_size + page_size >= swa_tokens:
            raise ValueError(
                f"SWA pool ({swa_tokens} tokens) cannot hold even one request: the prefill admission "
                f"floor is sliding_window_size ({sliding_window_size}) + page_size ({page_size}). "
                "Increase swa_full_tokens_ratio or the total KV budget."
            )


def _align_down(x: int, page_size: int) -> int:
    return x // page_size * page_size


def _log_stage(name: str, parallel: ParallelSpec, layers: tuple[int, int], total: int) -> None:
    if parallel.pp_size > 1:
        logger.info(
            "%s PP slice: rank=%d layers=[%d,%d) local=%d/%d",
            name, parallel.pp_rank, layers[0], layers[1], layers[1] - layers[0], total,
        )


class DefaultPoolConfigurator(MemoryPoolConfigurator):
    """Plain MHA: ``coeff`` = K+V bytes of one token over this stage's layers, ``bias`` = 0."""

    def __init__(self, model: MHAModelSpec, parallel: ParallelSpec, server: ServerSpec):
        self.layers = parallel.layer_range(model.num_layers)
        _log_stage("Default pool", parallel, self.layers, model.num_layers)
        num_layers = self.layers[1] - self.layers[0]
        self.cell_size = model.kv_heads * (2 * model.head_dim) * num_layers * model.dtype_bytes

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        tokens = max(available_bytes, 0) // self.cell_size
        return MemoryPoolConfig(max_total_num_tokens=_align_down(tokens, page_size))

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        return MemoryPoolConfig(max_total_num_tokens=_align_down(max_total_num_tokens, page_size))


class HybridSWAPoolConfigurator(MemoryPoolConfigurator):
    """Hybrid sliding-window MHA: one budget split between the full and the SWA pool.

    ``coeff`` per full token = ``F * n_full + ratio * S * n_swa`` (F, S: K+V bytes of one token in
    one full / SWA layer), so the SWA pool is ``ratio`` times the full pool. A stage without full
    layers ("all SWA") prices SWA tokens alone and ignores the ratio. Layer counts are the stage's
    own.
    """

    def __init__(self, model: MHAModelSpec, parallel: ParallelSpec, server: ServerSpec):
        self.layers = parallel.layer_range(model.num_layers)
        _log_stage("Hybrid SWA pool", parallel, self.layers, model.num_layers)
        stage = range(*self.layers)
        self.swa_layers_num = sum(1 for i in stage if model.is_swa_layer(i))
        self.full_layers_num = len(stage) - self.swa_layers_num
        if self.swa_layers_num == 0:
            raise ValueError(
                f"PP rank {parallel.pp_rank} (layers [{self.layers[0]},{self.layers[1]})) holds no SWA layer; "
                "sglang's hybrid-SWA configurator requires at least one per stage"
            )
        self.swa_full_tokens_ratio = server.swa_full_tokens_ratio
        self.sliding_window_size = model.swa_window
        self.page_size = server.page_size
        self.full_per_token = model.kv_heads * (2 * model.head_dim) * model.dtype_bytes
        self.swa_per_token = self.full_per_token
        if self.full_layers_num == 0:
            self.cell_size = self.swa_per_token * self.swa_layers_num
        else:
            self.cell_size = (
                self.full_per_token * self.full_layers_num
                + self.swa_full_tokens_ratio * self.swa_per_token * self.swa_layers_num
            )

    def _solve_pool_sizes(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        if self.full_layers_num == 0:
            swa_tokens = _align_down(max_total_num_tokens, page_size)
            return MemoryPoolConfig(
                max_total_num_tokens=swa_tokens, full_max_total_num_tokens=0, swa_max_total_num_tokens=swa_tokens
            )
        full_tokens = _align_down(max_total_num_tokens, page_size)
        swa_tokens = _align_down(int(full_tokens * self.swa_full_tokens_ratio), page_size)
        self.validate_swa_pool_size(swa_tokens, self.sliding_window_size, self.page_size)
        return MemoryPoolConfig(
            max_total_num_tokens=full_tokens, full_max_total_num_tokens=full_tokens, swa_max_total_num_tokens=swa_tokens
        )

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        return self._solve_pool_sizes(int(available_bytes // self.cell_size), page_size)

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        return self._solve_pool_sizes(max_total_num_tokens, page_size)


def spec_alloc_len_per_decode(spec: SpeculativeSpec, page_size: int) -> int:
    """KV slots one request allocates per speculative decode step (spec v2, overlap schedule on).

    ``max(steps * topk, draft_tokens)``: the draft chain and the verify block share the
    allocation. A top-k > 1 tree on pages > 1 instead reserves, for every branch, the pages its
    chain can touch when it starts one slot short of a page boundary.
    """
    if page_size == 1 or spec.eagle_topk == 1:
        return max(spec.num_steps * spec.eagle_topk, spec.num_draft_tokens)
    pages_per_branch = geo.ceil_div(page_size - 1 + spec.num_steps, page_size)
    return max(pages_per_branch * page_size * spec.eagle_topk, spec.num_draft_tokens)


def decode_alloc_per_request(server: ServerSpec) -> int:
    """KV slots one running request may hold for its next decode step.

    A page without speculative decoding. With it: spec v1 (overlap schedule off) reserves the
    draft steps per top-k branch and the verify block, each rounded up to pages (a branch of a
    top-k > 1 tree on pages > 1 also gets the partial page it may start in); spec v2 keeps two
    :func:`spec_alloc_len_per_decode` allocations outstanding.
    """
    spec = server.speculative
    if spec is None:
        return server.page_size
    if not server.disable_overlap_schedule:
        return 2 * spec_alloc_len_per_decode(spec, server.page_size)
    page = server.page_size
    if page == 1:
        return max(spec.num_steps * spec.eagle_topk, spec.num_draft_tokens)
    steps = spec.num_steps + page if spec.eagle_topk > 1 else spec.num_steps
    return max(geo.ceil_align(steps, page) * spec.eagle_topk, geo.ceil_align(spec.num_draft_tokens, page))


def compute_swa_request_cap(*, page_size: int, window: int, attn_dp_size: int, server: ServerSpec) -> int:
    """Worst-case SWA slots the scheduler holds live at ``max_running_requests``.

    Per request: the window, the tokens decoded between two SWA evictions, a page of padding to
    keep the eviction point page aligned, and the next decode allocation. On top: the chunked
    prefills in flight (two with the overlap schedule) plus a page, or on a PD decode server the
    pre-allocated slots, each holding a window and a page.
    """
    draft_tokens = server.speculative.num_draft_tokens if server.speculative else 1
    trailing = window + server.swa_eviction_interval * draft_tokens + page_size
    per_request = trailing + decode_alloc_per_request(server)
    num_reqs = server.max_running_requests // attn_dp_size
    if server.disaggregation_mode == "decode":
        return per_request * num_reqs + (window + page_size) * server.disaggregation_decode_extra_slots
    chunks_in_flight = 1 if server.disable_overlap_schedule else 2
    return per_request * num_reqs + chunks_in_flight * server.chunked_prefill_size + page_size


class SWARequestCapPoolConfigurator(HybridSWAPoolConfigurator):
    """Hybrid SWA with the SWA pool sized by the request cap, the rest given to the full pool.

    Applies when ``max_running_requests`` is set, the radix cache is off, chunked prefill is on
    and the stage has a full layer (see :meth:`is_applicable`).
    """

    def __init__(self, model: MHAModelSpec, parallel: ParallelSpec, server: ServerSpec):
        super().__init__(model, parallel, server)
        self.swa_cap = compute_swa_request_cap(
            page_size=server.page_size, window=model.swa_window, attn_dp_size=parallel.attn_dp_size, server=server
        )

    @staticmethod
    def is_applicable(model: MHAModelSpec, parallel: ParallelSpec, server: ServerSpec) -> bool:
        """True when the SWA pool can be sized from an explicit request count."""
        if server.max_running_requests is None or not server.disable_radix_cache:
            return False
        if server.chunked_prefill_size is None or model.swa_window is None:
            return False
        start, end = parallel.layer_range(model.num_layers)
        return any(not model.is_swa_layer(i) for i in range(start, end))

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        swa_tokens = geo.ceil_align(self.swa_cap, page_size)
        fixed_swa_bytes = swa_tokens * self.swa_per_token * self.swa_layers_num
        full_cell_size = self.full_per_token * self.full_layers_num
        full_tokens = _align_down(int((available_bytes - fixed_swa_bytes) // full_cell_size), page_size)
        if full_tokens <= 0:
            raise RuntimeError(
                f"SWA pool cap ({swa_tokens} tokens, {fixed_swa_bytes / (1 << 30):.2f} GiB) leaves no room for "
                f"the full KV pool within the available {available_bytes / (1 << 30):.2f} GiB. Reduce "
                "max_running_requests or increase the KV budget."
            )
        return MemoryPoolConfig(
            max_total_num_tokens=full_tokens, full_max_total_num_tokens=full_tokens, swa_max_total_num_tokens=swa_tokens
        )

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        swa_tokens = geo.ceil_align(self.swa_cap, page_size)
        full_tokens = _align_down(max_total_num_tokens, page_size)
        return MemoryPoolConfig(
            max_total_num_tokens=full_tokens,
            full_max_total_num_tokens=full_tokens,
            swa_max_total_num_tokens=min(swa_tokens, max_total_num_tokens),
        )


@dataclass(frozen=True)
class DSV4TokenBytes:
    """DSV4 bytes per token by component over a stage's layers, before speculative inflation.

    Per SWA token (``swa_kv``, ``c4_state``, ``c4_indexer_state``): the page-padded SWA KV slot
    of every layer and the C4 compressor state rings (a ring per SWA page). Per full token
    (``c4_kv``, ``c4_indexer``, ``c128_kv``): the compressed entries it produces. A full token also
    costs ``swa_ratio_in_full`` SWA tokens (0 in cap mode, where SWA is a fixed cost), and the
    whole is scaled by ``spec_inflation`` = ``(L + 1) / L`` under speculative decoding.
    """

    swa_kv: float
    c4_state: float
    c4_indexer_state: float
    c4_kv: float
    c4_indexer: float
    c128_kv: float
    swa_ratio_in_full: float
    spec_inflation: float


class DSV4PoolConfigurator(MemoryPoolConfigurator):
    """DSV4 compressed attention: full / SWA / C4 / C128 KV, C4 indexer and compressor states.

    ``coeff`` = bytes per full token over this PP stage's layers ``compress_ratios[start:end]``
    (never the whole model: a stage's numbers depend only on its own layers), inflated by
    ``(L + 1) / L`` under speculative decoding for the one-layer draft worker. ``bias`` = the
    request-scoped C128 compressor state (``max_running_requests + 1`` slots, plus the PD decode
    extra slots, times a 128-slot ring), charged first, and in cap mode the SWA pool.

    SWA sizing:

    * ratio mode: ``swa = ratio * full`` (the operator's ratio, else the DSV4 default 0.1);
    * cap mode (the operator set no ratio, ``max_running_requests`` is known, chunked prefill is on
      or the server is a PD decode): the SWA pool is the request cap plus 4 cached prefix tails per
      request, each a window plus a page, a fixed cost; the full pool gets the rest.

    Under HiSparse only every ``host_to_device_ratio``-th C4 KV entry stays on the device.
    """

    def __init__(self, model: DSV4ModelSpec, parallel: ParallelSpec, server: ServerSpec):
        self._check_page_size(server.page_size)
        self.layers = parallel.layer_range(model.num_layers)
        self.stage_compress_ratios = model.compress_ratios[self.layers[0] : self.layers[1]]
        _log_stage("DSV4 pool", parallel, self.layers, len(model.compress_ratios))
        self.page_size = server.page_size
        self.sliding_window_size = model.sliding_window
        self.attn_head_dim = model.head_dim
        self.qk_rope_head_dim = model.qk_rope_head_dim
        self.index_head_dim = model.index_head_dim
        self.context_len = model.context_len
        self.state_dtype_bytes = server.compress_state_bytes
        self.operator_swa_ratio = server.swa_full_tokens_ratio
        self.swa_ratio = (
            self.operator_swa_ratio if self.operator_swa_ratio is not None else DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO
        )
        self.is_speculative = server.speculative is not None
        self.requested_max_running_requests_per_worker = (
            max(1, server.max_running_requests // parallel.attn_dp_size)
            if server.max_running_requests is not None
            else None
        )
        self.disaggregation_mode = server.disaggregation_mode
        self.disaggregation_decode_extra_slots = server.disaggregation_decode_extra_slots
        self.c4_shrink_factor = server.hisparse_host_to_device_ratio if server.enable_hisparse else 1

        self.num_layers_total = len(self.stage_compress_ratios)
        self.num_layers_by_ratio = {r: self.stage_compress_ratios.count(r) for r in geo.COMPRESS_RATIOS}
        # A stage without layers of a ratio keeps no state for it (ring 0).
        self.ring_sizes = {
            r: geo.compress_state_ring_size(r, self.is_speculative)
            for r in geo.COMPRESS_RATIOS
            if self.num_layers_by_ratio[r]
        }
        if server.speculative is not None:
            self._check_rings_serve_draft_tokens(server.speculative.num_draft_tokens)

        self.swa_prefix_tails = self._resolve_swa_prefix_tails(server)
        self.swa_cap_tokens = self._resolve_swa_cap_tokens(server, parallel)
        self.token_bytes = self._token_bytes()
        self.bytes_per_swa_token = self._bytes_per_swa_token()
        self.bytes_per_full_token = self._bytes_per_full_token()
        if self.bytes_per_full_token == 0:
            # Cap mode on a stage of SWA-only layers: nothing scales with full tokens, so the
            # full pool has no size to solve for (sglang divides by zero here).
            raise ValueError(
                f"PP stage layers [{self.layers[0]},{self.layers[1]}) hold only SWA-only layers and the SWA pool "
                "is sized by the request cap: no per-token cost to size the full pool from. Set "
                "swa_full_tokens_ratio or give the stage a compressed layer."
            )
        if self.is_speculative:
            self.bytes_per_full_token *= self.token_bytes.spec_inflation
            self.bytes_per_swa_token *= self.token_bytes.spec_inflation

    # ---- construction helpers -------------------------------------------------------------

    def _check_rings_serve_draft_tokens(self, num_draft_tokens: int) -> None:
        # A verify batch writes its whole optimistic tail into the ring, so the ring bounds drafts.
        for ratio, ring in self.ring_sizes.items():
            limit = geo.compress_state_write_pad(ratio, ring)
            if num_draft_tokens > limit:
                raise ValueError(
                    f"speculative.num_draft_tokens={num_draft_tokens} exceeds what the C{ratio} compressor "
                    f"state ring (ring_size={ring}) keeps resident: at most {limit} draft tokens"
                )

    def _resolve_swa_prefix_tails(self, server: ServerSpec) -> int:
        # A cached prefix stays reusable only while its last window of tokens holds SWA slots.
        if server.swa_prefix_tails is not None:
            return server.swa_prefix_tails
        if server.disable_radix_cache:
            return 0
        mrr = self.requested_max_running_requests_per_worker
        return 4 * mrr if mrr is not None else 0

    def _resolve_swa_cap_tokens(self, server: ServerSpec, parallel: ParallelSpec) -> int | None:
        if self.operator_swa_ratio is not None:
            return None
        if self.requested_max_running_requests_per_worker is None:
            return None
        if self.disaggregation_mode != "decode" and not server.chunked_prefill_enabled:
            return None
        cap = compute_swa_request_cap(
            page_size=self.page_size,
            window=self.sliding_window_size,
            attn_dp_size=parallel.attn_dp_size,
            server=server,
        )
        headroom = self.swa_prefix_tails * (self.sliding_window_size + self.page_size)
        return geo.ceil_align(cap + headroom, self.page_size)

    def _token_bytes(self) -> DSV4TokenBytes:
        s = self.state_dtype_bytes
        num_c4 = self.num_layers_by_ratio[4]
        c4_state_ratio = self.ring_sizes.get(4, 0) / self.page_size
        return DSV4TokenBytes(
            swa_kv=geo.paged_kv_bytes_per_token(self.page_size) * self.num_layers_total,
            c4_state=c4_state_ratio * geo.compress_state_row_values(4, self.attn_head_dim) * s * num_c4,
            c4_indexer_state=c4_state_ratio * geo.indexer_state_row_values(self.index_head_dim) * s * num_c4,
            c4_kv=1 / (4 * self.c4_shrink_factor) * geo.paged_kv_bytes_per_token(self.page_size, 4) * num_c4,
            c4_indexer=1 / 4 * geo.indexer_bytes_per_entry(self.index_head_dim) * num_c4,
            c128_kv=1 / 128 * geo.paged_kv_bytes_per_token(self.page_size, 128) * self.num_layers_by_ratio[128],
            swa_ratio_in_full=0 if self.swa_cap_tokens is not None else self.swa_ratio,
            spec_inflation=(self.num_layers_total + 1) / self.num_layers_total if self.is_speculative else 1.0,
        )

    def _bytes_per_swa_token(self) -> float:
        # Evaluated in sglang's order so that the float result, and so every token count, matches.
        s = self.state_dtype_bytes
        state_bytes = (
            geo.compress_state_row_values(4, self.attn_head_dim) * s
            + geo.indexer_state_row_values(self.index_head_dim) * s
        )
        c4_state_ratio = self.ring_sizes.get(4, 0) / self.page_size
        return geo.paged_kv_bytes_per_token(self.page_size) * self.num_layers_total + (
            c4_state_ratio * state_bytes * self.num_layers_by_ratio[4]
        )

    def _compressed_bytes_per_full_token(self, ratio: int) -> float:
        if ratio == 4:
            return 1 / (4 * self.c4_shrink_factor) * geo.paged_kv_bytes_per_token(
                self.page_size, 4
            ) + 1 / 4 * geo.indexer_bytes_per_entry(self.index_head_dim)
        return 1 / 128 * geo.paged_kv_bytes_per_token(self.page_size, 128)

    def _bytes_per_full_token(self) -> float:
        compressed = sum(
            self._compressed_bytes_per_full_token(r) * self.num_layers_by_ratio[r]
            for r in geo.COMPRESS_RATIOS
            if self.num_layers_by_ratio[r]
        )
        return self.token_bytes.swa_ratio_in_full * self.bytes_per_swa_token + compressed

    # ---- fixed (request-scoped) bytes ------------------------------------------------------

    def num_req_slots(self, max_running_requests: int) -> int:
        """Request slots of the request-scoped pools (PD decode adds its pre-allocated slots)."""
        extra = self.disaggregation_decode_extra_slots if self.disaggregation_mode == "decode" else 0
        return max_running_requests + extra + 1

    def c128_state_rows(self, max_running_requests: int) -> int:
        """Rows of one C128 compressor state pool (0 when the stage has no C128 layer)."""
        if not self.num_layers_by_ratio[128]:
            return 0
        ring = self.ring_sizes[128]
        return geo.compress_state_rows(self.num_req_slots(max_running_requests) * ring, ring, 128)

    def c128_state_fixed_bytes(self, max_running_requests: int) -> int:
        """Bytes of the C128 compressor states of every C128 layer of the stage."""
        row_bytes = geo.compress_state_row_values(128, self.attn_head_dim) * self.state_dtype_bytes
        return self.c128_state_rows(max_running_requests) * row_bytes * self.num_layers_by_ratio[128]

    def component_bytes(self, config: MemoryPoolConfig) -> dict[str, float]:
        """Bytes the byte model charges each pool of this stage at ``config``'s sizes.

        SWA-priced components are charged per SWA token, the others per full token; the C128
        state is its fixed request-scoped size. The speculative draft worker's share is not
        included (it is a separate pool).
        """
        b = self.token_bytes
        full, swa = config.full_max_total_num_tokens, config.swa_max_total_num_tokens
        mrr = config.max_running_requests
        return {
            "swa_kv": swa * b.swa_kv,
            "c4_kv": full * b.c4_kv,
            "c4_indexer": full * b.c4_indexer,
            "c128_kv": full * b.c128_kv,
            "c4_state": swa * b.c4_state,
            "c4_indexer_state": swa * b.c4_indexer_state,
            "c128_state": 0 if mrr is None else self.c128_state_fixed_bytes(mrr),
        }

    def swa_fixed_bytes(self) -> float:
        """Bytes of the SWA pool charged up front in cap mode (0 in ratio mode)."""
        return 0 if self.swa_cap_tokens is None else self.swa_cap_tokens * self.bytes_per_swa_token

    def budgeted_max_running_requests(self, available_bytes: int) -> int:
        """The request count the fixed C128 state is sized for.

        The operator's value per attention-DP worker, else sglang's estimate from a first-pass
        capacity (an over-estimate is safe: more fixed bytes give fewer tokens).
        """
        if self.requested_max_running_requests_per_worker is not None:
            return self.requested_max_running_requests_per_worker
        full_token = int(available_bytes / self.bytes_per_full_token)
        estimated = max(min(int(full_token / self.context_len * 512), 4096), 2048)
        return min(estimated, full_token // 2)

    # ---- sizing --------------------------------------------------------------------------

    def _compute_sizes(self, full_token: int, page_size: int) -> MemoryPoolConfig:
        full_token = _align_down(full_token, page_size)
        if self.swa_cap_tokens is None:
            swa_tokens = _align_down(int(full_token * self.swa_ratio), page_size)
            # Only ratio sizing can under-size a request; the cap is sized from the request floor.
            self.validate_swa_pool_size(swa_tokens, self.sliding_window_size, page_size)
        else:
            swa_tokens = self.swa_cap_tokens
        return MemoryPoolConfig(
            max_total_num_tokens=full_token,
            full_max_total_num_tokens=full_token,
            swa_max_total_num_tokens=swa_tokens,
            c4_max_total_num_tokens=full_token // (4 * self.c4_shrink_factor),
            c128_max_total_num_tokens=full_token // 128,
            # Ring rows per SWA page: a state slot is addressed by its SWA page.
            c4_state_pool_size=swa_tokens // page_size * self.ring_sizes.get(4, 0),
            c128_state_pool_size=0,
        )

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        self._check_page_size(page_size)
        fixed_bytes = self.c128_state_fixed_bytes(self.budgeted_max_running_requests(available_bytes))
        fixed_bytes = fixed_bytes + self.swa_fixed_bytes()
        full_token = int(max(available_bytes - fixed_bytes, 0) / self.bytes_per_full_token)
        if full_token <= 0 and self.swa_cap_tokens is not None:
            raise RuntimeError(
                f"The DSV4 SWA pool cap ({self.swa_cap_tokens} tokens, {self.swa_fixed_bytes() / (1 << 30):.2f} GiB) "
                f"leaves no room for the full KV pool within the available {available_bytes / (1 << 30):.2f} GiB. "
                "Reduce max_running_requests, lower swa_prefix_tails, or increase the KV budget."
            )
        return self._compute_sizes(full_token, page_size)

    def calculate_pool_sizes_from_max_tokens(self, max_total_num_tokens: int, page_size: int) -> MemoryPoolConfig:
        # A token count, not a byte budget: the fixed pools are not re-subtracted.
        self._check_page_size(page_size)
        return self._compute_sizes(max_total_num_tokens, page_size)

    def finalize_with_max_running_requests(self, config: MemoryPoolConfig) -> MemoryPoolConfig:
        if config.max_running_requests is None:
            raise ValueError("finalize_with_max_running_requests needs config.max_running_requests")
        config.c128_state_pool_size = self.num_req_slots(config.max_running_requests) * self.ring_sizes.get(128, 0)
        return config

    @staticmethod
    def _check_page_size(page_size: int) -> None:
        if int_in(page_size, "page_size", 1) % 128 != 0:
            raise ValueError(f"sparsekv: argument `page_size` must be a multiple of 128 for DSV4 compressed attention, "
                             f"got {page_size}")


def create_memory_pool_configurator(
    model: ModelSpec, parallel: ParallelSpec, server: ServerSpec
) -> MemoryPoolConfigurator:
    """Pick the configurator for ``model`` on PP rank ``parallel.pp_rank``.

    DSV4 -> :class:`DSV4PoolConfigurator`; hybrid-SWA MHA -> the request-cap variant when it
    applies, else :class:`HybridSWAPoolConfigurator`; plain MHA -> :class:`DefaultPoolConfigurator`.
    """
    if isinstance(model, DSV4ModelSpec):
        return DSV4PoolConfigurator(model, parallel, server)
    if not isinstance(model, MHAModelSpec):
        raise TypeError(f"model must be a DSV4ModelSpec or an MHAModelSpec, got {type(model).__name__}")
    if model.is_hybrid_swa:
        if SWARequestCapPoolConfigurator.is_applicable(model, parallel, server):
            return SWARequestCapPoolConfigurator(model, parallel, server)
        return HybridSWAPoolConfigurator(model, parallel, server)
    return DefaultPoolConfigurator(model, parallel, server)

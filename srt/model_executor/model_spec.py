"""Typed descriptions of a model, its pipeline slice and its server settings for pool planning.

These small frozen dataclasses are all a configurator reads: no global server-args state, no
environment variables. Each validates its fields on construction and names the offending field in
a ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.checks import as_float, as_int, int_in

# DSV4's model hook sizes SWA at 0.1 of the full pool when the operator sets no ratio and the
# request-cap sizing cannot apply.
DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO = 0.1
# sglang's SGLANG_SWA_EVICTION_INTERVAL default: decode steps between SWA evictions.
DEFAULT_SWA_EVICTION_INTERVAL = 128
DISAGGREGATION_MODES = ("null", "prefill", "decode")
COMPRESS_STATE_DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def pp_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of PP rank ``pp_rank``: an even split, earlier ranks take the rest."""
    base, rem = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, rem)
    return start, start + base + (1 if pp_rank < rem else 0)


@dataclass(frozen=True)
class DSV4ModelSpec:
    """A DeepSeek-V4-class model as the pools see it.

    Parameters
    ----------
    num_hidden_layers : int
        Target layers ``L`` (the MTP layer is not counted).
    compress_ratios : tuple of int
        Per-layer ratio, 0 (SWA only), 4 (C4, "CSA") or 128 (C128, "HCA"); at least ``L``
        entries (the config's trailing MTP entry is allowed and never sliced into a stage).
    head_dim, qk_rope_head_dim, index_head_dim, sliding_window, context_len : int
        Attention head (nope + rope), its rope part, indexer head, SWA window, max context.
    """

    num_hidden_layers: int
    compress_ratios: tuple[int, ...]
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    sliding_window: int = 128
    context_len: int = 1048576

    def __post_init__(self) -> None:
        int_in(self.num_hidden_layers, "num_hidden_layers", 1)
        for name in ("head_dim", "index_head_dim", "sliding_window", "context_len"):
            int_in(getattr(self, name), name, 1)
        int_in(self.qk_rope_head_dim, "qk_rope_head_dim", 0)
        if self.qk_rope_head_dim >= self.head_dim:
            raise ValueError(
                f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be < head_dim ({self.head_dim})"
            )
        if not isinstance(self.compress_ratios, (tuple, list)):
            raise TypeError(f"compress_ratios must be a list of integers, got {self.compress_ratios!r}")
        for i, ratio in enumerate(self.compress_ratios):
            as_int(ratio, f"compress_ratios[{i}]")
            if ratio not in (0, 4, 128):
                raise ValueError(f"compress_ratios[{i}] must be 0, 4 or 128 (FlashMLA V4), got {ratio}")
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries, fewer than "
                f"num_hidden_layers ({self.num_hidden_layers})"
            )
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))

    @property
    def qk_nope_head_dim(self) -> int:
        """The FP8-quantized part of the head."""
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_layers(self) -> int:
        """Layers split across PP ranks."""
        return self.num_hidden_layers


DSV4_PRESETS = {
    # 2 SWA-only, 21 C4, 20 C128 layers, then the MTP entry.
    "dsv4-flash": dict(num_hidden_layers=43, compress_ratios=(0, 0) + (4, 128) * 20 + (4, 0)),
    # 30 C4, 31 C128 layers, then the MTP entry.
    "dsv4-pro": dict(num_hidden_layers=61, compress_ratios=(128, 128) + (4, 128) * 29 + (4, 0)),
}


def dsv4_preset(name: str, **overrides) -> DSV4ModelSpec:
    """Build a DSV4 preset (``dsv4-flash`` or ``dsv4-pro``) with any field overridden."""
    if name not in DSV4_PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(DSV4_PRESETS)}")
    return DSV4ModelSpec(**{**DSV4_PRESETS[name], **overrides})


@dataclass(frozen=True)
class MHAModelSpec:
    """A plain or hybrid sliding-window MHA model (the last ``swa_layers`` layers are SWA).

    Parameters
    ----------
    num_layers, kv_heads, head_dim : int
        Layers, KV heads and head size (K and V alike).
    dtype_bytes : int
        Bytes per KV element.
    swa_layers : int
        Trailing layers that use sliding-window attention (0: a plain model).
    swa_window : int or None
        The sliding window; required when ``swa_layers > 0``.
    context_len : int
        Max context, used to estimate ``max_running_requests`` when it is unset.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    swa_layers: int = 0
    swa_window: int | None = None
    context_len: int = 131072

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "dtype_bytes", "context_len"):
            int_in(getattr(self, name), name, 1)
        int_in(self.swa_layers, "swa_layers", 0)
        if self.swa_layers > self.num_layers:
            raise ValueError(f"swa_layers ({self.swa_layers}) must be <= num_layers ({self.num_layers})")
        if self.swa_layers > 0:
            if self.swa_window is None:
                raise ValueError("swa_window is required when swa_layers > 0")
            int_in(self.swa_window, "swa_window", 1)

    @property
    def is_hybrid_swa(self) -> bool:
        """True when some layers use sliding-window attention."""
        return self.swa_layers > 0

    def is_swa_layer(self, layer_id: int) -> bool:
        """True for the trailing ``swa_layers`` layers."""
        return layer_id >= self.num_layers - self.swa_layers


@dataclass(frozen=True)
class ParallelSpec:
    """Where a configurator runs: its PP rank and the attention data-parallel width."""

    pp_size: int = 1
    pp_rank: int = 0
    attn_dp_size: int = 1

    def __post_init__(self) -> None:
        int_in(self.pp_size, "pp_size", 1)
        int_in(self.pp_rank, "pp_rank", 0)
        int_in(self.attn_dp_size, "attn_dp_size", 1)
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank ({self.pp_rank}) must be < pp_size ({self.pp_size})")

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """This rank's layers ``[start, end)``."""
        if self.pp_size > num_layers:
            raise ValueError(f"pp_size ({self.pp_size}) must be <= the model's layers ({num_layers})")
        return pp_layer_range(num_layers, self.pp_size, self.pp_rank)


@dataclass(frozen=True)
class SpeculativeSpec:
    """EAGLE (MTP) speculative decoding.

    A DSV4 server runs it with top-k 1 (sglang's DSV4 launch hook enforces that), but the pool
    formulas are defined for any top-k and sglang's configurator applies them as given, so a
    wider draft tree is priced, not rejected.
    """

    algorithm: str = "EAGLE"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if self.algorithm != "EAGLE":
            raise ValueError(f"speculative.algorithm must be 'EAGLE', got {self.algorithm!r}")
        int_in(self.num_steps, "speculative.num_steps", 1)
        int_in(self.eagle_topk, "speculative.eagle_topk", 1)
        int_in(self.num_draft_tokens, "speculative.num_draft_tokens", 1)


@dataclass(frozen=True)
class ServerSpec:
    """The server settings that shape the pools.

    Parameters
    ----------
    page_size : int
        Full-pool page (DSV4: a multiple of 128).
    swa_full_tokens_ratio : float or None
        SWA pool size relative to the full pool, as set by the operator; ``None`` means "not
        set", which lets DSV4 size SWA by the request cap (else its default 0.1).
    max_running_requests : int or None
        ``None`` estimates it from capacity.
    chunked_prefill_size : int or None
        ``None`` or ``<= 0`` disables chunked prefill.
    disable_overlap_schedule, disable_radix_cache : bool
    max_total_tokens : int or None
        The operator's cap on the full pool.
    enable_hisparse : bool
    hisparse_host_to_device_ratio : int
        Logical C4 entries per device C4 entry under HiSparse.
    hisparse_resident_index : int or None
        Hot-buffer slots per request (``H``) of the indexed swap-in, whose resident-token index
        (``kv_layout.resident_index_bytes`` per request and C4 layer) counts in the device bytes;
        ``None``: the scanning swap-in, no index.
    speculative : SpeculativeSpec or None
    disaggregation_mode : str
        ``"null"`` (none), ``"prefill"`` or ``"decode"``.
    disaggregation_decode_extra_slots : int
        Pre-allocated request slots of a PD decode server.
    compress_state_dtype : str
        ``"fp32"`` or ``"bf16"`` compressor state rows.
    swa_prefix_tails : int or None
        Cached prefix tails the SWA cap keeps addressable (``None``: 4 per request, 0 without
        radix cache).
    swa_eviction_interval : int
        Decode steps between SWA evictions.
    """

    page_size: int = 256
    swa_full_tokens_ratio: float | None = DSV4_DEFAULT_SWA_FULL_TOKENS_RATIO
    max_running_requests: int | None = 256
    chunked_prefill_size: int | None = 8192
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False
    max_total_tokens: int | None = None
    enable_hisparse: bool = False
    hisparse_host_to_device_ratio: int = 2
    hisparse_resident_index: int | None = None
    speculative: SpeculativeSpec | None = None
    disaggregation_mode: str = "null"
    disaggregation_decode_extra_slots: int = 0
    compress_state_dtype: str = "fp32"
    swa_prefix_tails: int | None = None
    swa_eviction_interval: int = DEFAULT_SWA_EVICTION_INTERVAL

    def __post_init__(self) -> None:
        int_in(self.page_size, "page_size", 1)
        if self.swa_full_tokens_ratio is not None:
            object.__setattr__(
                # 0 is a valid setting, not a malformed one: sglang accepts it and then rejects the
                # empty SWA pool it sizes (a ValueError at planning time, like any too-small SWA pool).
                self, "swa_full_tokens_ratio",
                as_float(self.swa_full_tokens_ratio, "swa_full_tokens_ratio", finite=True, lo=0),
            )
        if self.max_running_requests is not None:
            int_in(self.max_running_requests, "max_running_requests", 1)
        if self.chunked_prefill_size is not None:
            int_in(self.chunked_prefill_size, "chunked_prefill_size")
        for name in ("disable_overlap_schedule", "disable_radix_cache", "enable_hisparse"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.max_total_tokens is not None:
            int_in(self.max_total_tokens, "max_total_tokens", 1)
        int_in(self.hisparse_host_to_device_ratio, "hisparse_host_to_device_ratio", 1)
        if self.hisparse_resident_index is not None:
            int_in(self.hisparse_resident_index, "hisparse_resident_index", 1)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeSpec):
            raise TypeError(f"speculative must be a SpeculativeSpec or None, got {self.speculative!r}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}"
            )
        int_in(self.disaggregation_decode_extra_slots, "disaggregation_decode_extra_slots", 0)
        if self.compress_state_dtype not in COMPRESS_STATE_DTYPE_BYTES:
            raise ValueError(
                f"compress_state_dtype must be one of {sorted(COMPRESS_STATE_DTYPE_BYTES)}, "
                f"got {self.compress_state_dtype!r}"
            )
        if self.swa_prefix_tails is not None:
            int_in(self.swa_prefix_tails, "swa_prefix_tails", 0)
        int_in(self.swa_eviction_interval, "swa_eviction_interval", 1)

    @property
    def compress_state_bytes(self) -> int:
        """Bytes per compressor state element."""
        return COMPRESS_STATE_DTYPE_BYTES[self.compress_state_dtype]

    @property
    def chunked_prefill_enabled(self) -> bool:
        """True when prefill runs in chunks."""
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0


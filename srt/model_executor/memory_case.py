"""A memory-planning case: the JSON object ``sparsekv plan-memory --case`` answers.

The schema is documented in ``docs/memory_cases.md`` (and the cases shipped with the package are
in :mod:`sparsekv.srt.model_executor.cases`). :func:`parse_case` turns one case object into typed
specs, rejecting malformed input with a ``ValueError`` / ``TypeError`` that names the field
(``model.head_dim``, ``server.page_size``...) before anything is planned. Numbers outside
:data:`LIMITS` are malformed input too: a 400-digit ``head_dim`` is a typo, not a plan.
:func:`rank_answer` renders a plan as the expected-answer JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparsekv.checks import as_int, int_in

from .model_spec import (
    DSV4_PRESETS,
    DSV4ModelSpec,
    MHAModelSpec,
    ServerSpec,
    SpeculativeSpec,
    dsv4_preset,
)
from .pool_configurator import MemoryPoolConfigurator
from .pool_planner import PoolPlan, create_stage_configurators, plan_stages

DSV4_MODEL_OVERRIDES = (
    "num_hidden_layers", "compress_ratios", "head_dim", "qk_rope_head_dim",
    "index_head_dim", "sliding_window", "context_len",
)
MHA_MODEL_FIELDS = ("num_layers", "kv_heads", "head_dim", "dtype_bytes", "swa_layers", "swa_window", "context_len")
MHA_REQUIRED = ("num_layers", "kv_heads", "head_dim")
SERVER_FIELDS = (
    "page_size", "swa_sizing", "swa_full_tokens_ratio", "max_running_requests", "chunked_prefill_size",
    "disable_overlap_schedule", "disable_radix_cache", "max_total_tokens", "enable_hisparse",
    "hisparse_host_to_device_ratio", "hisparse_resident_index", "speculative", "disaggregation_mode",
    "disaggregation_decode_extra_slots",
    "compress_state_dtype", "attn_dp_size", "swa_prefix_tails",
)
SPECULATIVE_FIELDS = ("algorithm", "num_steps", "eagle_topk", "num_draft_tokens")
STATE_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
# Server defaults that differ by model family; the rest are ServerSpec's.
DSV4_SERVER_DEFAULTS = dict(page_size=256, swa_full_tokens_ratio=0.1, max_running_requests=256)
MHA_SERVER_DEFAULTS = dict(page_size=1, swa_full_tokens_ratio=0.8, max_running_requests=None)

ModelSpec = DSV4ModelSpec | MHAModelSpec

# Inclusive upper bounds of the integer (and ratio) fields, far beyond any real deployment; a value
# above one is rejected as malformed instead of being planned (or overflowing a float).
PIB = 1 << 50
LIMITS = {
    "available_bytes": PIB,
    "pp_size": 1024,
    "num_hidden_layers": 4096, "num_layers": 4096,
    "head_dim": 1 << 16, "qk_rope_head_dim": 1 << 16, "index_head_dim": 1 << 16,
    "kv_heads": 1 << 16, "dtype_bytes": 64, "swa_layers": 4096,
    "sliding_window": 1 << 31, "swa_window": 1 << 31, "context_len": 1 << 31,
    "page_size": 1 << 20, "max_running_requests": 1 << 24, "chunked_prefill_size": 1 << 31,
    "max_total_tokens": 1 << 40, "hisparse_host_to_device_ratio": 1024,
    "hisparse_resident_index": 32767,
    "disaggregation_decode_extra_slots": 1 << 24, "attn_dp_size": 1024, "swa_prefix_tails": 1 << 24,
    "num_steps": 64, "eagle_topk": 64, "num_draft_tokens": 4096,
    "swa_full_tokens_ratio": 1.0,
}


@dataclass(frozen=True)
class MemoryCase:
    """One planning question: a model, a server, ``pp_size`` ranks of ``available_bytes`` each."""

    name: str
    model: ModelSpec
    model_label: str
    server: ServerSpec
    available_bytes: int
    pp_size: int = 1
    attn_dp_size: int = 1

    @property
    def is_dsv4(self) -> bool:
        """True for a DSV4 compressed-attention model."""
        return isinstance(self.model, DSV4ModelSpec)

    def configurators(self) -> list[MemoryPoolConfigurator]:
        """One configurator per PP rank (validates what only the configurators know)."""
        return create_stage_configurators(self.model, self.server, self.pp_size, self.attn_dp_size)

    def plan(self, configurators: list[MemoryPoolConfigurator] | None = None) -> PoolPlan:
        """Plan every rank; raises ``ValueError`` / ``RuntimeError`` when the budget cannot."""
        configurators = self.configurators() if configurators is None else configurators
        return plan_stages(configurators, self.server, self.available_bytes, self.attn_dp_size, self.model.context_len)


def _check_limits(name: str, obj: dict) -> None:
    """Reject a number of ``obj`` above its :data:`LIMITS` entry (types are the specs' job)."""
    for key, value in obj.items():
        limit = LIMITS.get(key)
        if limit is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value > limit:  # NaN and negatives fall through to the specs' own checks
            shown = f"{value:.3g}" if isinstance(value, float) else (str(value) if value < 10**30 else
                                                                      f"a {len(str(value))}-digit number")
            raise ValueError(f"{name}{key} must be <= {limit}, got {shown}")


_JSON_KINDS = {str: "a string", dict: "a JSON object"}


def _json(name: str, value: Any, kind: type) -> Any:
    """``value`` if it is a JSON string or object (``kind``), else a ``TypeError`` naming the field."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be {_JSON_KINDS[kind]}, got {type(value).__name__}")
    return value


def _reject_unknown(name: str, obj: dict, known: tuple) -> None:
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}; known: {list(known)}")


def _prefixed(prefix: str, error: Exception) -> Exception:
    # Spec constructors name fields bare ("head_dim", or "argument `head_dim`" from sparsekv.checks);
    # the case reader names them by path.
    text = str(error)
    if "argument `" in text:
        return type(error)(text.replace("argument `", f"argument `{prefix}.", 1))
    return type(error)(f"{prefix}.{text}")


def _parse_model(raw: Any) -> tuple[ModelSpec, str]:
    model = _json("model", raw, dict)
    if "preset" in model:
        if "kind" in model:
            raise ValueError("model must have either 'preset' or 'kind', not both")
        _reject_unknown("model", model, ("preset",) + DSV4_MODEL_OVERRIDES)
        _check_limits("model.", model)
        preset = _json("model.preset", model["preset"], str)
        if preset not in DSV4_PRESETS:
            raise ValueError(f"model.preset must be one of {sorted(DSV4_PRESETS)}, got {preset!r}")
        overrides = {k: model[k] for k in DSV4_MODEL_OVERRIDES if k in model}
        try:
            return dsv4_preset(preset, **overrides), preset
        except (TypeError, ValueError) as e:
            raise _prefixed("model", e) from None
    if model.get("kind") != "mha":
        raise ValueError("model needs 'preset' (dsv4-flash, dsv4-pro) or 'kind': 'mha'")
    _reject_unknown("model", model, ("kind",) + MHA_MODEL_FIELDS)
    _check_limits("model.", model)
    for key in MHA_REQUIRED:
        if key not in model:
            raise ValueError(f"model.{key} is required for kind 'mha'")
    try:
        spec = MHAModelSpec(**{k: model[k] for k in MHA_MODEL_FIELDS if k in model})
    except (TypeError, ValueError) as e:
        raise _prefixed("model", e) from None
    label = "mha" if not spec.is_hybrid_swa else "hybrid-swa mha"
    return spec, label


def _parse_speculative(raw: Any) -> SpeculativeSpec | None:
    if raw is None:
        return None
    spec = _json("server.speculative", raw, dict)
    _reject_unknown("server.speculative", spec, SPECULATIVE_FIELDS)
    _check_limits("server.speculative.", spec)
    if "algorithm" not in spec:
        raise ValueError("server.speculative.algorithm is required")
    fields = {k: spec[k] for k in SPECULATIVE_FIELDS if k in spec}
    # sglang reads NEXTN (the MTP head) as EAGLE.
    if fields["algorithm"] == "NEXTN":
        fields["algorithm"] = "EAGLE"
    # sglang's top-k 1 chain verifies num_steps drafts plus the bonus token.
    if "num_draft_tokens" not in fields and "num_steps" in fields:
        fields["num_draft_tokens"] = as_int(fields["num_steps"], "server.speculative.num_steps") + 1
    try:
        return SpeculativeSpec(**fields)
    except (TypeError, ValueError) as e:
        raise _prefixed("server", e) from None


def _parse_server(raw: Any, model: ModelSpec) -> tuple[ServerSpec, int]:
    server = dict(_json("server", raw, dict))
    _reject_unknown("server", server, SERVER_FIELDS)
    _check_limits("server.", server)
    is_dsv4 = isinstance(model, DSV4ModelSpec)
    fields = dict(DSV4_SERVER_DEFAULTS if is_dsv4 else MHA_SERVER_DEFAULTS)
    attn_dp_size = int_in(server.pop("attn_dp_size", 1), "server.attn_dp_size", 1)
    sizing = _json("server.swa_sizing", server.pop("swa_sizing", "ratio"), str)
    if sizing not in ("ratio", "cap"):
        raise ValueError(f"server.swa_sizing must be 'ratio' or 'cap', got {sizing!r}")
    speculative = _parse_speculative(server.pop("speculative", None))
    if speculative is not None and not is_dsv4:
        raise ValueError("server.speculative is supported for DSV4 presets only (an MHA draft's layers are unknown)")
    mode = server.pop("disaggregation_mode", "null")
    fields["disaggregation_mode"] = "null" if mode is None else _json("server.disaggregation_mode", mode, str)
    extra_slots = server.pop("disaggregation_decode_extra_slots", 0)
    fields["disaggregation_decode_extra_slots"] = 0 if extra_slots is None else extra_slots
    if "compress_state_dtype" in server:
        dtype = _json("server.compress_state_dtype", server.pop("compress_state_dtype"), str)
        if dtype not in STATE_DTYPE_ALIASES:
            raise ValueError(f"server.compress_state_dtype must be 'fp32' or 'bf16', got {dtype!r}")
        fields["compress_state_dtype"] = STATE_DTYPE_ALIASES[dtype]
    if sizing == "cap":
        # The operator set no ratio, so a ratio in the case is ignored: DSV4 may then size SWA by
        # the request cap (else by its default 0.1), an MHA model keeps sglang's default 0.8.
        server.pop("swa_full_tokens_ratio", None)
        if is_dsv4:
            fields["swa_full_tokens_ratio"] = None
    elif "swa_full_tokens_ratio" in server and server["swa_full_tokens_ratio"] is None:
        raise ValueError("server.swa_full_tokens_ratio must be a number (use swa_sizing 'cap' to leave it unset)")
    fields.update(server)
    try:
        spec = ServerSpec(speculative=speculative, **fields)
    except (TypeError, ValueError) as e:
        raise _prefixed("server", e) from None
    if is_dsv4 and spec.page_size % 128 != 0:
        raise ValueError(f"server.page_size must be a multiple of 128 for DSV4, got {spec.page_size}")
    return spec, attn_dp_size


def parse_case(raw: Any) -> MemoryCase:
    """Read one case object; keys it does not know at the top level (``expected``) are ignored.

    Raises
    ------
    TypeError, ValueError
        A malformed case, with the offending field named.
    """
    case = _json("case", raw, dict)
    for key in ("model", "available_bytes"):
        if key not in case:
            raise ValueError(f"case field {key!r} is required")
    name = _json("name", case.get("name", "case"), str)
    _check_limits("", case)
    model, label = _parse_model(case["model"])
    server, attn_dp_size = _parse_server(case.get("server", {}), model)
    available = int_in(case["available_bytes"], "available_bytes", 0)
    pp_size = int_in(case.get("pp_size", 1), "pp_size", 1)
    if pp_size > model.num_layers:
        raise ValueError(f"pp_size ({pp_size}) must be <= the model's layers ({model.num_layers})")
    return MemoryCase(name, model, label, server, available, pp_size, attn_dp_size)


def rank_answer(plan: PoolPlan, is_dsv4: bool) -> list[dict]:
    """The per-rank fields of the expected-answer JSON (plus ``layers`` and the request count)."""
    ranks = []
    for rank in plan.ranks:
        c = rank.config
        entry = {
            "max_total_num_tokens": c.max_total_num_tokens,
            "full_max_total_num_tokens": c.full_max_total_num_tokens,
            "swa_max_total_num_tokens": c.swa_max_total_num_tokens,
        }
        if is_dsv4:
            entry.update(
                c4_max_total_num_tokens=c.c4_max_total_num_tokens,
                c128_max_total_num_tokens=c.c128_max_total_num_tokens,
                c4_state_pool_size=c.c4_state_pool_size,
                c128_state_pool_size=c.c128_state_pool_size,
            )
        entry["max_running_requests"] = c.max_running_requests
        entry["layers"] = list(rank.layers)
        ranks.append(entry)
    return ranks


"""``sparsekv plan-memory``: how many KV tokens of each pool fit, and why.

Answers one case of the ``memory_plans.json`` schema (``--case CASE.json [--name NAME]``) or one
built from flags (``--model dsv4-flash --kv-budget 60GiB --pp 4 --hisparse 2``); the budget is the
bytes available for KV on each PP rank, not the GPU's size. ``--json`` prints the expected-answer
JSON; otherwise a breakdown: bytes per token by component, the fixed request-scoped bytes, the
resulting pools, what limits them, and for an impossible plan the reason and the smallest change
that fixes it.

Exit codes: 0 planned; 1 the budget cannot hold a valid plan (``{"error", "message"}`` on stdout
with ``--json``, the message on stderr); 2 a malformed case (the message names the field).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from .memory_case import MemoryCase, parse_case, rank_answer
from .plan_advice import fixes, limiting_factor
from .pool_configurator import DSV4PoolConfigurator, HybridSWAPoolConfigurator, SWARequestCapPoolConfigurator
from .pool_planner import PoolPlan, RankPlan

SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
COMPONENT_LABELS = {
    "swa_kv": "SWA KV pages",
    "c4_kv": "C4 KV",
    "c4_indexer": "C4 indexer",
    "c128_kv": "C128 KV",
    "c4_state": "C4 compressor state",
    "c4_indexer_state": "C4 indexer state",
    "c128_state": "C128 compressor state (fixed)",
}


class CaseError(Exception):
    """A malformed case or command line (exit code 2)."""


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer, or a number with a unit (``60GiB``, ``2.55GiB``, ``40GB``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in SIZE_UNITS:
        raise CaseError(f"--kv-budget: cannot read a size from {text!r} (e.g. 60GiB, 40GB, 123456789)")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``plan-memory``'s arguments on ``parser``."""
    parser.add_argument("--case", metavar="CASE.json", help="a case object, or an array of cases with --name")
    parser.add_argument("--name", help="the case to answer when CASE.json holds an array")
    parser.add_argument("--json", action="store_true", help="print the expected-answer JSON")
    flags = parser.add_argument_group("a case from flags (instead of --case)")
    flags.add_argument("--model", help="dsv4-flash or dsv4-pro")
    flags.add_argument("--kv-budget", metavar="SIZE", help="bytes available for KV on each PP rank, e.g. 60GiB")
    flags.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (default 1)")
    flags.add_argument("--hisparse", type=int, metavar="RATIO", help="enable HiSparse with this host:device ratio")
    flags.add_argument("--page-size", type=int)
    flags.add_argument("--swa-ratio", type=float, help="swa_full_tokens_ratio (the operator's explicit ratio)")
    flags.add_argument("--swa-cap", action="store_true", help="leave the ratio unset: size SWA by the request cap")
    flags.add_argument("--max-running-requests", metavar="N|auto", help="'auto' estimates it from capacity")
    flags.add_argument("--max-total-tokens", type=int)
    flags.add_argument("--chunked-prefill-size", type=int)
    flags.add_argument("--context-len", type=int)
    flags.add_argument("--eagle-steps", type=int, metavar="N", help="EAGLE/MTP with N steps (top-k 1, N+1 drafts)")
    flags.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"))
    flags.add_argument("--decode-extra-slots", type=int, help="disaggregation_decode_extra_slots")
    flags.add_argument("--compress-state-dtype", choices=("fp32", "bf16"))
    flags.add_argument("--attn-dp", type=int, help="attention data-parallel size")
    flags.add_argument("--disable-overlap-schedule", action="store_true")
    flags.add_argument("--disable-radix-cache", action="store_true")


def _case_from_flags(args: argparse.Namespace) -> dict:
    if args.kv_budget is None:
        raise CaseError("--kv-budget is required with --model")
    server: dict[str, Any] = {}
    optional = {
        "page_size": args.page_size,
        "swa_full_tokens_ratio": args.swa_ratio,
        "max_total_tokens": args.max_total_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "disaggregation_mode": args.disaggregation_mode,
        "disaggregation_decode_extra_slots": args.decode_extra_slots,
        "compress_state_dtype": args.compress_state_dtype,
        "attn_dp_size": args.attn_dp,
    }
    server.update({k: v for k, v in optional.items() if v is not None})
    if args.swa_cap:
        server["swa_sizing"] = "cap"
    if args.hisparse is not None:
        server.update(enable_hisparse=True, hisparse_host_to_device_ratio=args.hisparse)
    if args.max_running_requests is not None:
        mrr = args.max_running_requests
        if mrr != "auto" and not mrr.isdigit():
            raise CaseError(f"--max-running-requests must be an integer or 'auto', got {mrr!r}")
        server["max_running_requests"] = None if mrr == "auto" else int(mrr)
    if args.eagle_steps is not None:
        server["speculative"] = {"algorithm": "EAGLE", "num_steps": args.eagle_steps, "eagle_topk": 1}
    for flag in ("disable_overlap_schedule", "disable_radix_cache"):
        if getattr(args, flag):
            server[flag] = True
    model: dict[str, Any] = {"preset": args.model}
    if args.context_len is not None:
        model["context_len"] = args.context_len
    return {
        "name": f"{args.model} {args.kv_budget} pp{args.pp}",
        "model": model,
        "available_bytes": parse_size(args.kv_budget),
        "pp_size": args.pp,
        "server": server,
    }


def _case_from_file(path: str, name: str | None) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise CaseError(f"--case: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise CaseError(f"--case: {path} is not valid JSON: {e}") from None
    if isinstance(data, list):
        if name is None:
            raise CaseError(f"--case: {path} holds {len(data)} cases; choose one with --name")
        matches = [c for c in data if isinstance(c, dict) and c.get("name") == name]
        if len(matches) != 1:
            raise CaseError(f"--name: {path} holds {len(matches)} cases named {name!r}, expected exactly 1")
        return matches[0]
    if name is not None and isinstance(data, dict) and data.get("name") != name:
        raise CaseError(f"--name: the case in {path} is named {data.get('name')!r}, not {name!r}")
    return data


def load_case(args: argparse.Namespace) -> MemoryCase:
    """The case the arguments describe.

    Raises
    ------
    CaseError
        Both or neither of ``--case`` and ``--model``, an unreadable file, or a malformed case.
    """
    if (args.case is None) == (args.model is None):
        raise CaseError("give exactly one of --case CASE.json or --model MODEL --kv-budget SIZE")
    raw = _case_from_file(args.case, args.name) if args.case else _case_from_flags(args)
    try:
        return parse_case(raw)
    except (TypeError, ValueError) as e:
        raise CaseError(str(e)) from None


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def _describe_rank_coefficients(rank: RankPlan, available_bytes: int) -> list[str]:
    c = rank.configurator
    start, end = rank.layers
    if not isinstance(c, DSV4PoolConfigurator):
        if isinstance(c, HybridSWAPoolConfigurator):
            cap = " (SWA sized by the request cap)" if isinstance(c, SWARequestCapPoolConfigurator) else ""
            return [
                f"PP rank {rank.pp_rank}, layers [{start},{end}): {c.full_layers_num} full, "
                f"{c.swa_layers_num} SWA{cap}",
                f"  bytes per token: full layer {c.full_per_token}, SWA layer {c.swa_per_token}; "
                f"per full token {c.cell_size:.2f}",
                f"  profiled tokens {rank.profiled_tokens:,}",
            ]
        return [
            f"PP rank {rank.pp_rank}, layers [{start},{end}): bytes per token {c.cell_size}",
            f"  profiled tokens {rank.profiled_tokens:,}",
        ]
    b = c.token_bytes
    counts = c.num_layers_by_ratio
    swa_only = c.num_layers_total - counts[4] - counts[128]
    lines = [
        f"PP rank {rank.pp_rank}, layers [{start},{end}): {swa_only} SWA-only, {counts[4]} C4, {counts[128]} C128",
        f"  bytes per SWA token  {c.bytes_per_swa_token:12.2f} = SWA KV pages {b.swa_kv:.2f} + C4 state "
        f"{b.c4_state:.2f} + C4 indexer state {b.c4_indexer_state:.2f}",
        f"  bytes per full token {c.bytes_per_full_token:12.2f} = {b.swa_ratio_in_full:g} x SWA token + C4 KV "
        f"{b.c4_kv:.2f} + C4 indexer {b.c4_indexer:.2f} + C128 KV {b.c128_kv:.2f}",
    ]
    if c.is_speculative:
        lines.append(f"  (x {b.spec_inflation:.4f} = (L+1)/L: the speculative draft worker's layer)")
    budgeted_requests = c.budgeted_max_running_requests(available_bytes)
    lines.append(
        f"  fixed, request-scoped: {_gib(c.c128_state_fixed_bytes(budgeted_requests))} C128 compressor state "
        f"({c.num_req_slots(budgeted_requests)} request slots x {c.ring_sizes.get(128, 0)}-slot ring x "
        f"{counts[128]} layers)"
    )
    if c.swa_cap_tokens is not None:
        lines.append(
            f"  fixed, SWA cap: {_gib(c.swa_fixed_bytes())} = {c.swa_cap_tokens:,} SWA tokens "
            f"(request cap + {c.swa_prefix_tails} prefix tails)"
        )
    lines.append(f"  profiled full tokens {rank.profiled_tokens:,}")
    return lines


def _describe_rank_pools(rank: RankPlan, available_bytes: int) -> list[str]:
    cfg = rank.config
    lines = [f"PP rank {rank.pp_rank}: full {cfg.full_max_total_num_tokens or cfg.max_total_num_tokens:,} tokens"
             + (f", SWA {cfg.swa_max_total_num_tokens:,}" if cfg.swa_max_total_num_tokens is not None else "")
             + f", max_running_requests {cfg.max_running_requests}"]
    c = rank.configurator
    if isinstance(c, DSV4PoolConfigurator):
        entries = {
            "swa_kv": cfg.swa_max_total_num_tokens,
            "c4_kv": cfg.c4_max_total_num_tokens,
            "c4_indexer": cfg.full_max_total_num_tokens // 4,
            "c128_kv": cfg.c128_max_total_num_tokens,
            "c4_state": cfg.c4_state_pool_size,
            "c4_indexer_state": cfg.c4_state_pool_size,
            "c128_state": cfg.c128_state_pool_size,
        }
        component = c.component_bytes(cfg)
        for key, label in COMPONENT_LABELS.items():
            lines.append(f"  {label:31s} {entries[key]:>13,} entries {_gib(component[key]):>12}")
        total = sum(component.values())
        label = "total (without the draft worker)"
        lines.append(f"  {label:31s} {'':>21} {_gib(total):>12} of {_gib(available_bytes)}")
    return lines


def render_human(case: MemoryCase, plan: PoolPlan | None, error: Exception | None) -> str:
    """The human-readable breakdown of a plan, or of why there is none."""
    s = case.server
    head = (
        f"{case.name}: {case.model_label}, {case.model.num_layers} layers, PP {case.pp_size}, "
        f"KV budget {_gib(case.available_bytes)} per rank, page {s.page_size}"
    )
    lines = [head]
    if case.is_dsv4:
        sizing = "request cap (ratio unset)" if s.swa_full_tokens_ratio is None else f"ratio {s.swa_full_tokens_ratio}"
        extras = [f"SWA sizing: {sizing}"]
        if s.enable_hisparse:
            extras.append(f"HiSparse C4 on device 1/{s.hisparse_host_to_device_ratio}")
        if s.speculative:
            spec = s.speculative
            tree = f", top-k {spec.eagle_topk}" if spec.eagle_topk > 1 else ""
            extras.append(f"EAGLE {spec.num_steps} steps{tree}, {spec.num_draft_tokens} drafts")
        if s.disaggregation_mode != "null":
            extras.append(f"PD {s.disaggregation_mode}")
        lines.append("  " + "; ".join(extras))
    if error is not None:
        lines += ["", f"No plan: {type(error).__name__}: {error}", "Smallest change that fixes it (any one):"]
        lines += [f"  - {fix}" for fix in fixes(case)] or ["  (none found within a 1 PiB budget)"]
        return "\n".join(lines)
    lines.append("")
    for rank in plan.ranks:
        lines += _describe_rank_coefficients(rank, case.available_bytes)
    lines += ["", f"Agreed max_total_num_tokens: {plan.agreed_tokens:,}, limited by {limiting_factor(case, plan)}"]
    requested, resolved = s.max_running_requests, plan.ranks[0].config.max_running_requests
    if requested is not None and resolved < requested // case.attn_dp_size:
        lines.append(f"max_running_requests reduced from {requested} to {resolved}: at most half the full pool")
    for rank in plan.ranks:
        lines += _describe_rank_pools(rank, case.available_bytes)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Answer the case; returns the exit code (0 planned, 1 infeasible, 2 malformed)."""
    try:
        case = load_case(args)
        configurators = case.configurators()
    except (CaseError, TypeError, ValueError) as e:
        print(f"plan-memory: {e}", file=sys.stderr)
        return 2
    try:
        plan, error = case.plan(configurators), None
    except (ValueError, RuntimeError) as e:
        plan, error = None, e
    if args.json:
        if error is not None:
            answer = {"error": type(error).__name__, "message": str(error)}
        else:
            answer = {"ranks": rank_answer(plan, case.is_dsv4), "limited_by": limiting_factor(case, plan)}
        print(json.dumps(answer, indent=1))
    else:
        print(render_human(case, plan, error))
    if error is not None:
        print(f"plan-memory: {error}", file=sys.stderr)
        return 1
    return 0

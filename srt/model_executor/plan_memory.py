"""``sparsekv plan-memory``: how many KV tokens of each pool fit, and why.

Answers one case (the schema is in ``docs/memory_cases.md``): a case shipped with the package
(``--case flash-pp2-40GiB``; ``--list-cases`` names them), a case file (``--case CASE.json [--name
NAME]``), or a case built from flags (``--model dsv4-flash --kv-budget 60GiB --pp 4 --hisparse 2``).
The budget is the bytes available for KV on each PP rank, not the GPU's size.

Both outputs carry the same facts: :func:`plan_report` builds one JSON document (``--json`` prints
it) and :func:`render_text` writes the human breakdown from that document alone: bytes per token by
component, the fixed request-scoped bytes, the resulting pools and their bytes, the host (DRAM)
bytes under HiSparse, what limits the plan, and for an impossible plan the reason and the smallest
change that fixes it, named as the user wrote the setting (a flag, or a case field).

Exit codes: 0 planned; 1 the budget cannot hold a valid plan (``{"error", "message", "fixes"}`` on
stdout with ``--json``, the message on stderr); 2 malformed input (the message names the flag or
the case field). Nothing the user types produces a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

from sparsekv.kv_layout import DSV4_PAGE_SIZES, resident_index_bytes

from . import cases as shipped_cases
from . import dsv4_geometry as geo
from .memory_case import LIMITS, MemoryCase, parse_case, rank_answer
from .plan_advice import fixes, limiting_factor
from .pool_configurator import HybridSWAPoolConfigurator, SWARequestCapPoolConfigurator
from .pool_planner import PoolPlan, RankPlan

PROG = "sparsekv plan-memory"
# K/M/G/T/P and KiB.. are powers of 1024 (60G == 60GiB, as GPU memory is quoted); KB.. powers of 1000.
SIZE_UNITS = {"b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    SIZE_UNITS.update({_p: 1 << (10 * _i), f"{_p}ib": 1 << (10 * _i), f"{_p}b": 10 ** (3 * _i)})
SIZE_HELP = "a size with a unit: 60GiB (= 60G), 40GB (decimal), 64424509440B"
# Case fields -> the flag that sets them, so messages about a case built from flags name the flags.
FLAG_OF = {
    "available_bytes": "--kv-budget",
    "pp_size": "--pp",
    "model.preset": "--model",
    "model.context_len": "--context-len",
    "server.page_size": "--page-size",
    "server.swa_full_tokens_ratio": "--swa-full-tokens-ratio",
    "server.max_running_requests": "--max-running-requests",
    "server.max_total_tokens": "--max-total-tokens",
    "server.chunked_prefill_size": "--chunked-prefill-size",
    "server.hisparse_host_to_device_ratio": "--hisparse",
    "server.hisparse_resident_index": "--hisparse-index",
    "server.speculative.num_steps": "--eagle-steps",
    "server.speculative.num_draft_tokens": "--eagle-steps",
    "server.disaggregation_mode": "--disaggregation-mode",
    "server.disaggregation_decode_extra_slots": "--decode-extra-slots",
    "server.compress_state_dtype": "--compress-state-dtype",
    "server.attn_dp_size": "--attn-dp",
    "server.swa_prefix_tails": "--swa-prefix-tails",
}
# Planner messages name some settings bare ("Reduce max_running_requests"); those map too.
_BARE = {f.rsplit(".", 1)[1]: flag for f, flag in FLAG_OF.items() if f.startswith("server.") and "speculative" not in f}
MAX_MESSAGE_CHARS = 400
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
    """A malformed case or command line (exit code 2); the message names the flag or field."""


def parse_size(text: str, flag: str = "--kv-budget") -> int:
    """Bytes in ``text``, a number with a unit: ``60GiB``, ``60G`` (both 60 * 2**30), ``40GB``
    (40 * 10**9), ``2.55GiB``, ``64424509440B``.

    Raises
    ------
    CaseError
        No unit (a bare ``60`` is almost always meant as GiB, so it is refused with that hint), an
        unknown unit, an unreadable number, or more than 1 PiB; the message names ``flag``.
    """
    match = re.fullmatch(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([A-Za-z]*)\s*", text)
    if not match:
        raise CaseError(f"{flag}: cannot read a size from {text[:40]!r}; give {SIZE_HELP}")
    number, unit = match.groups()
    if not unit:
        raise CaseError(f"{flag}: {text.strip()!r} has no unit; did you mean {number}GiB? Give {SIZE_HELP}")
    if unit.lower() not in SIZE_UNITS:
        raise CaseError(f"{flag}: unknown unit {unit!r}; use B, K/KiB, M/MiB, G/GiB, T/TiB or KB, MB, GB, TB")
    nbytes = int(Decimal(number) * SIZE_UNITS[unit.lower()])
    if nbytes > LIMITS["available_bytes"]:
        raise CaseError(f"{flag}: {text.strip()} is more than 1 PiB per rank")
    return nbytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``plan-memory``'s arguments on ``parser``."""
    parser.add_argument("--case", metavar="NAME|CASE.json",
                        help="a shipped case (see --list-cases) or a JSON file: one case, or an array with --name")
    parser.add_argument("--name", help="the case to answer when CASE.json holds an array")
    parser.add_argument("--list-cases", action="store_true", help="list the cases shipped with sparsekv")
    parser.add_argument("--json", action="store_true", help="print the plan (or the error) as one JSON document")
    flags = parser.add_argument_group("a case from flags (instead of --case)")
    flags.add_argument("--model", help="dsv4-flash or dsv4-pro")
    flags.add_argument("--kv-budget", metavar="SIZE", help=f"bytes for KV on each PP rank: {SIZE_HELP}")
    flags.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (default 1)")
    flags.add_argument("--hisparse", type=int, metavar="RATIO", help="enable HiSparse with this host:device ratio")
    flags.add_argument("--hisparse-index", type=int, metavar="H",
                       help="with --hisparse: the indexed swap-in with H hot slots per request (its resident-token "
                            "index counts in the device bytes)")
    flags.add_argument("--page-size", type=int)
    flags.add_argument("--swa-full-tokens-ratio", "--swa-ratio", dest="swa_ratio", type=float, metavar="RATIO",
                       help="SWA pool size relative to the full pool, as the operator sets it")
    flags.add_argument("--swa-cap", action="store_true", help="leave the ratio unset: size SWA by the request cap")
    flags.add_argument("--swa-prefix-tails", type=int, metavar="N",
                       help="cached prefix tails the SWA cap keeps addressable (default 4 per request)")
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


def name_flags(message: str) -> str:
    """``message`` with case fields (``server.page_size``, ``pp_size``) replaced by their flags."""
    names = {**_BARE, **FLAG_OF}
    pattern = "|".join(re.escape(k) for k in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({pattern})(?![\w])", lambda m: names[m.group(1)], message)


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
        "swa_prefix_tails": args.swa_prefix_tails,
    }
    server.update({k: v for k, v in optional.items() if v is not None})
    if args.swa_cap:
        server["swa_sizing"] = "cap"
    if args.hisparse is not None:
        server.update(enable_hisparse=True, hisparse_host_to_device_ratio=args.hisparse)
    if args.hisparse_index is not None:
        if args.hisparse is None:
            raise CaseError("--hisparse-index needs --hisparse")
        server["hisparse_resident_index"] = args.hisparse_index
    if args.max_running_requests is not None:
        mrr = args.max_running_requests
        if mrr != "auto" and not (mrr.isascii() and mrr.isdigit() and len(mrr) < 20):
            raise CaseError(f"--max-running-requests must be an integer or 'auto', got {mrr[:40]!r}")
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
        "name": f"{args.model} {args.kv_budget.strip()} pp{args.pp}",
        "model": model,
        "available_bytes": parse_size(args.kv_budget),
        "pp_size": args.pp,
        "server": server,
    }


def _read_json(path: Path, shown: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise CaseError(f"--case: cannot read {shown}: {e.strerror}") from None
    except RecursionError:
        raise CaseError(f"--case: {shown} nests JSON too deeply") from None
    except ValueError as e:  # JSONDecodeError, undecodable bytes, an integer of thousands of digits
        raise CaseError(f"--case: {shown} is not valid JSON: {str(e)[:200]}") from None


def _case_from_file(path: str, name: str | None) -> dict:
    data = _read_json(Path(path), path)
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


def _case_from_arg(value: str, name: str | None) -> dict:
    """``--case``: an existing file, else the name of a shipped case."""
    if Path(value).is_file() or value.endswith(".json"):
        return _case_from_file(value, name)
    shipped = shipped_cases.load(value)
    if shipped is None:
        raise CaseError(f"--case: {value!r} is neither a file nor a shipped case; "
                        f"'{PROG} --list-cases' lists the shipped ones")
    if name is not None:
        raise CaseError("--name selects a case inside a CASE.json array; a shipped case is chosen by --case alone")
    return shipped


def load_case(args: argparse.Namespace) -> tuple[MemoryCase, dict[str, str]]:
    """The case the arguments describe, and the names to use for its settings in messages.

    Raises
    ------
    CaseError
        Both or neither of ``--case`` and ``--model``, an unreadable file, or a malformed case.
    """
    if (args.case is None) == (args.model is None):
        raise CaseError("give exactly one of --case NAME|CASE.json or --model MODEL --kv-budget SIZE")
    from_flags = args.case is None
    raw = _case_from_flags(args) if from_flags else _case_from_arg(args.case, args.name)
    try:
        case = parse_case(raw)
    except (TypeError, ValueError, RecursionError) as e:
        message = "the case nests too deeply" if isinstance(e, RecursionError) else str(e)
        raise CaseError(name_flags(message) if from_flags else message) from None
    # The configurators follow sglang, which plans any multiple of 128; the kernels serve fewer.
    if case.is_dsv4 and case.server.page_size not in DSV4_PAGE_SIZES:
        message = (f"server.page_size must be one of {', '.join(map(str, DSV4_PAGE_SIZES))} for DSV4 (the page "
                   f"sizes the DSV4 kernels serve), got {case.server.page_size}")
        raise CaseError(name_flags(message) if from_flags else message)
    return case, (dict(FLAG_OF) if from_flags else {})


# ---- the report: one JSON document, the source of both outputs ------------------------------------


def _case_facts(case: MemoryCase) -> dict:
    s = case.server
    facts: dict[str, Any] = {
        "name": case.name, "model": case.model_label, "num_layers": case.model.num_layers,
        "pp_size": case.pp_size, "available_bytes": case.available_bytes, "page_size": s.page_size,
    }
    if case.is_dsv4:
        spec = s.speculative
        facts.update(
            swa_sizing="cap" if s.swa_full_tokens_ratio is None else "ratio",
            swa_full_tokens_ratio=s.swa_full_tokens_ratio,
            hisparse_host_to_device_ratio=s.hisparse_host_to_device_ratio if s.enable_hisparse else None,
            speculative=None if spec is None else {"num_steps": spec.num_steps, "eagle_topk": spec.eagle_topk,
                                                   "num_draft_tokens": spec.num_draft_tokens},
            disaggregation_mode=s.disaggregation_mode,
        )
    return facts


def host_bytes(rank: RankPlan, page_size: int) -> dict:
    """The host (DRAM) pool HiSparse needs on one rank.

    The host mirrors every logical C4 entry of every C4 layer (the device keeps 1/ratio of them):
    ``ceil(full_max_total_num_tokens / 4 / slots)`` pages of ``slots = page_size / 4`` V4 entries,
    ``V4.page_bytes(slots)`` bytes each (37,440 for 64 slots), per C4 layer.
    """
    c = rank.configurator
    slots = page_size // 4
    pages = math.ceil(rank.config.full_max_total_num_tokens // 4 / slots)
    page_bytes = geo.kv_page_bytes(slots)
    layers = c.num_layers_by_ratio[4]
    return {"bytes": pages * page_bytes * layers, "pages_per_layer": pages, "page_bytes": page_bytes,
            "c4_layers": layers}


def resident_index(rank: RankPlan, case: MemoryCase, requests: int) -> dict | None:
    """Device bytes of the indexed swap-in's resident-token index on one rank (None: not used).

    Per request row and C4 layer ``kv_layout.resident_index_bytes(positions, H)``, with ``positions =
    ceil(context_len / 4) + page_size / 4`` (the coordinator's host-table columns) and
    ``H = server.hisparse_resident_index``, for every request slot.
    """
    s = case.server
    if not s.enable_hisparse or s.hisparse_resident_index is None:
        return None
    c = rank.configurator
    positions = -(-case.model.context_len // 4) + s.page_size // 4
    per = resident_index_bytes(positions, s.hisparse_resident_index)
    rows, layers = c.num_req_slots(requests), c.num_layers_by_ratio[4]
    return {"hot_buffer_size": s.hisparse_resident_index, "positions": positions, "bytes_per_request_layer": per,
            "request_slots": rows, "c4_layers": layers, "bytes": per * rows * layers}


def _dsv4_rank(rank: RankPlan, case: MemoryCase) -> dict:
    c, cfg, b = rank.configurator, rank.config, rank.configurator.token_bytes
    counts = c.num_layers_by_ratio
    requests = c.budgeted_max_running_requests(case.available_bytes)
    entries = {
        "swa_kv": cfg.swa_max_total_num_tokens, "c4_kv": cfg.c4_max_total_num_tokens,
        "c4_indexer": cfg.full_max_total_num_tokens // 4, "c128_kv": cfg.c128_max_total_num_tokens,
        "c4_state": cfg.c4_state_pool_size, "c4_indexer_state": cfg.c4_state_pool_size,
        "c128_state": cfg.c128_state_pool_size,
    }
    pool_bytes = {k: round(v) for k, v in c.component_bytes(cfg).items()}
    index = resident_index(rank, case, requests)
    return {
        "layer_counts": {"swa_only": c.num_layers_total - counts[4] - counts[128], "c4": counts[4],
                         "c128": counts[128]},
        "bytes_per_swa_token": {"total": c.bytes_per_swa_token, "swa_kv": b.swa_kv, "c4_state": b.c4_state,
                                "c4_indexer_state": b.c4_indexer_state},
        "bytes_per_full_token": {"total": c.bytes_per_full_token, "swa_tokens": b.swa_ratio_in_full,
                                 "c4_kv": b.c4_kv, "c4_indexer": b.c4_indexer, "c128_kv": b.c128_kv},
        "speculative_inflation": b.spec_inflation if c.is_speculative else None,
        "fixed_bytes": {"c128_state": c.c128_state_fixed_bytes(requests), "request_slots": c.num_req_slots(requests),
                        "c128_ring": c.ring_sizes.get(128, 0), "swa_cap": round(c.swa_fixed_bytes()),
                        "swa_cap_tokens": c.swa_cap_tokens, "swa_prefix_tails": c.swa_prefix_tails},
        "pool_entries": entries,
        "pool_bytes": pool_bytes,
        "device_bytes": sum(pool_bytes.values()) + (index["bytes"] if index else 0),
        "resident_index": index,
        "host": host_bytes(rank, case.server.page_size) if case.server.enable_hisparse else None,
    }


def _mha_rank(rank: RankPlan) -> dict:
    c = rank.configurator
    if isinstance(c, HybridSWAPoolConfigurator):
        return {"full_layers": c.full_layers_num, "swa_layers": c.swa_layers_num,
                "swa_sized_by_cap": isinstance(c, SWARequestCapPoolConfigurator),
                "bytes_per_token": {"full_layer": c.full_per_token, "swa_layer": c.swa_per_token,
                                    "per_full_token": c.cell_size}}
    return {"bytes_per_token": {"per_full_token": c.cell_size}}


def plan_report(case: MemoryCase, plan: PoolPlan | None, error: Exception | None,
                names: dict[str, str] | None = None) -> dict:
    """Everything ``plan-memory`` says about ``case``, as one JSON-able document.

    A plan: ``{"case", "ranks": [...], "agreed_max_total_num_tokens", "limited_by",
    "max_running_requests_reduced", "host_bytes"}``; each rank holds the golden answer's fields
    plus its byte breakdown. No plan: ``{"case", "error", "message", "fixes": [...]}``.
    ``names`` maps case fields to the flags the user typed.
    """
    report: dict[str, Any] = {"case": _case_facts(case)}
    if error is not None:
        report.update(
            error=type(error).__name__,
            message=name_flags(str(error)) if names else str(error),
            fixes=[{"field": f.field, "setting": (names or {}).get(f.field, f.field), "value": f.value,
                    "bound": f.bound, "text": f.describe(names)} for f in fixes(case)],
        )
        return report
    ranks = rank_answer(plan, case.is_dsv4)
    for entry, rank in zip(ranks, plan.ranks):
        entry["profiled_tokens"] = rank.profiled_tokens
        entry.update(_dsv4_rank(rank, case) if case.is_dsv4 else _mha_rank(rank))
    requested, resolved = case.server.max_running_requests, plan.ranks[0].config.max_running_requests
    reduced = requested is not None and resolved < requested // case.attn_dp_size
    hosts = [r.get("host") for r in ranks]
    report.update(
        ranks=ranks,
        agreed_max_total_num_tokens=plan.agreed_tokens,
        limited_by=limiting_factor(case, plan, names),
        max_running_requests_reduced={"from": requested, "to": resolved} if reduced else None,
        host_bytes=sum(h["bytes"] for h in hosts) if all(hosts) else None,
    )
    return report


# ---- the human breakdown, written from the report alone ------------------------------------------


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def _text_case(facts: dict) -> list[str]:
    lines = [f"{facts['name']}: {facts['model']}, {facts['num_layers']} layers, PP {facts['pp_size']}, "
             f"KV budget {_gib(facts['available_bytes'])} ({facts['available_bytes']:,} B) per rank, "
             f"page {facts['page_size']}"]
    if "swa_sizing" in facts:
        ratio = facts["swa_full_tokens_ratio"]
        extras = [f"SWA sizing: {'request cap (ratio unset)' if ratio is None else f'ratio {ratio}'}"]
        if facts["hisparse_host_to_device_ratio"] is not None:
            extras.append(f"HiSparse: 1/{facts['hisparse_host_to_device_ratio']} of C4 KV on the device, "
                          "all of it in host memory")
        spec = facts["speculative"]
        if spec is not None:
            tree = f", top-k {spec['eagle_topk']}" if spec["eagle_topk"] > 1 else ""
            extras.append(f"EAGLE {spec['num_steps']} steps{tree}, {spec['num_draft_tokens']} drafts")
        if facts["disaggregation_mode"] != "null":
            extras.append(f"PD {facts['disaggregation_mode']}")
        lines.append("  " + "; ".join(extras))
    return lines


def _text_rank_coefficients(i: int, r: dict) -> list[str]:
    start, end = r["layers"]
    head = f"PP rank {i}, layers [{start},{end})"
    if "layer_counts" not in r:
        per = r["bytes_per_token"]
        if "full_layer" not in per:
            return [f"{head}: bytes per token {per['per_full_token']}", f"  profiled tokens {r['profiled_tokens']:,}"]
        cap = " (SWA sized by the request cap)" if r["swa_sized_by_cap"] else ""
        return [f"{head}: {r['full_layers']} full, {r['swa_layers']} SWA{cap}",
                f"  bytes per token: full layer {per['full_layer']}, SWA layer {per['swa_layer']}; "
                f"per full token {per['per_full_token']:.2f}",
                f"  profiled tokens {r['profiled_tokens']:,}"]
    n, swa, full, fixed = r["layer_counts"], r["bytes_per_swa_token"], r["bytes_per_full_token"], r["fixed_bytes"]
    lines = [
        f"{head}: {n['swa_only']} SWA-only, {n['c4']} C4, {n['c128']} C128",
        f"  bytes per SWA token  {swa['total']:12.2f} = SWA KV pages {swa['swa_kv']:.2f} + C4 state "
        f"{swa['c4_state']:.2f} + C4 indexer state {swa['c4_indexer_state']:.2f}",
        f"  bytes per full token {full['total']:12.2f} = {full['swa_tokens']:g} x SWA token + C4 KV "
        f"{full['c4_kv']:.2f} + C4 indexer {full['c4_indexer']:.2f} + C128 KV {full['c128_kv']:.2f}",
    ]
    if r["speculative_inflation"] is not None:
        lines.append(f"  (x {r['speculative_inflation']:.4f} = (L+1)/L: the speculative draft worker's layer)")
    lines.append(f"  fixed, request-scoped: {_gib(fixed['c128_state'])} C128 compressor state "
                 f"({fixed['request_slots']} request slots x {fixed['c128_ring']}-slot ring x {n['c128']} layers)")
    if fixed["swa_cap_tokens"] is not None:
        lines.append(f"  fixed, SWA cap: {_gib(fixed['swa_cap'])} = {fixed['swa_cap_tokens']:,} SWA tokens "
                     f"(request cap + {fixed['swa_prefix_tails']} prefix tails)")
    lines.append(f"  profiled full tokens {r['profiled_tokens']:,}")
    return lines


def _text_rank_pools(i: int, r: dict, available_bytes: int) -> list[str]:
    swa = f", SWA {r['swa_max_total_num_tokens']:,}" if r["swa_max_total_num_tokens"] is not None else ""
    lines = [f"PP rank {i}: full {r['full_max_total_num_tokens'] or r['max_total_num_tokens']:,} tokens{swa}, "
             f"max_running_requests {r['max_running_requests']}"]
    if "pool_bytes" in r:
        for key, label in COMPONENT_LABELS.items():
            lines.append(f"  {label:31s} {r['pool_entries'][key]:>13,} entries {_gib(r['pool_bytes'][key]):>12}")
        index = r.get("resident_index")
        if index is not None:
            label = "HiSparse resident index"
            lines.append(f"  {label:31s} {index['request_slots']:>13,} requests {_gib(index['bytes']):>11} "
                         f"({index['c4_layers']} layers x {index['bytes_per_request_layer']:,} B, "
                         f"H {index['hot_buffer_size']})")
        label = "device total (no draft worker)"
        lines.append(f"  {label:31s} {'':>21} {_gib(r['device_bytes']):>12} of {_gib(available_bytes)}")
        if r["host"] is not None:
            h = r["host"]
            label = "host (DRAM), HiSparse C4 KV"
            lines.append(f"  {label:31s} {h['pages_per_layer']:>13,} pages   {_gib(h['bytes']):>12} "
                         f"({h['c4_layers']} layers x {h['page_bytes']:,} B pages)")
    return lines


def render_text(report: dict) -> str:
    """The human-readable breakdown of a :func:`plan_report` document (and nothing else)."""
    facts = report["case"]
    lines = _text_case(facts)
    if "error" in report:
        lines += ["", f"No plan: {report['error']}: {report['message']}", "Smallest change that fixes it (any one):"]
        lines += [f"  - {fix['text']}" for fix in report["fixes"]] or ["  (none found within a 1 PiB budget)"]
        return "\n".join(lines)
    lines.append("")
    for i, rank in enumerate(report["ranks"]):
        lines += _text_rank_coefficients(i, rank)
    lines += ["", f"Agreed max_total_num_tokens: {report['agreed_max_total_num_tokens']:,}, "
                  f"limited by {report['limited_by']}"]
    reduced = report["max_running_requests_reduced"]
    if reduced is not None:
        lines.append(f"max_running_requests reduced from {reduced['from']} to {reduced['to']}: at most half the "
                     "full pool")
    if report["host_bytes"] is not None:
        lines.append(f"Host (DRAM) memory for HiSparse: {_gib(report['host_bytes'])} "
                     f"({report['host_bytes']:,} B) over all ranks")
    for i, rank in enumerate(report["ranks"]):
        lines += _text_rank_pools(i, rank, facts["available_bytes"])
    return "\n".join(lines)


# ---- the command ---------------------------------------------------------------------------------


def _short(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + " ..."


def _list_cases(as_json: bool) -> int:
    listed = shipped_cases.catalog()
    if as_json:
        print(json.dumps(listed, indent=1))
        return 0
    width = max(len(c["name"]) for c in listed)
    for c in listed:
        print(f"{c['name']:<{width}}  {c['description']}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Answer the case; returns the exit code (0 planned, 1 infeasible, 2 malformed)."""
    if args.list_cases:
        return _list_cases(args.json)
    try:
        case, names = load_case(args)
        configurators = case.configurators()
    except (CaseError, TypeError, ValueError, RecursionError) as e:
        message = str(e) if isinstance(e, CaseError) else name_flags(str(e)) if args.case is None else str(e)
        print(f"{PROG}: error: {_short(message)}", file=sys.stderr)
        return 2
    try:
        plan, error = case.plan(configurators), None
    except (ValueError, RuntimeError) as e:
        plan, error = None, e
    report = plan_report(case, plan, error, names)
    print(json.dumps(report, indent=1) if args.json else render_text(report))
    if error is not None:
        print(f"{PROG}: {_short(report['message'])}", file=sys.stderr)
        return 1
    return 0

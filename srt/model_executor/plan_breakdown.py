"""What ``sparsekv plan-memory`` says about a case: one JSON document and the text written from it.

:func:`plan_report` builds one JSON-able document from a planned (or impossible) case: bytes per
token by component, the fixed request-scoped bytes, the resulting pools and their bytes, the host
(DRAM) bytes under HiSparse, what limits the plan, and for an impossible plan the reason and the
smallest change that fixes it, named as the user wrote the setting. :func:`render_text` writes the
human breakdown from that document alone. The command (:mod:`sparsekv.cli.plan_memory`) reads the
case and prints these.
"""

from __future__ import annotations

import math
import re
from typing import Any

from sparsekv.kv_layout import resident_index_bytes

from . import dsv4_geometry as geo
from .memory_case import MemoryCase, rank_answer
from .plan_advice import fixes, limiting_factor
from .pool_configurator import HybridSWAPoolConfigurator, SWARequestCapPoolConfigurator
from .pool_planner import PoolPlan, RankPlan

COMPONENT_LABELS = {
    "swa_kv": "SWA KV pages",
    "c4_kv": "C4 KV",
    "c4_indexer": "C4 indexer",
    "c128_kv": "C128 KV",
    "c4_state": "C4 compressor state",
    "c4_indexer_state": "C4 indexer state",
    "c128_state": "C128 compressor state (fixed)",
}


def name_flags(message: str, names: dict[str, str]) -> str:
    """``message`` with case fields (``server.page_size``, ``pp_size``) replaced by the settings in
    ``names`` (field -> flag); the planner's bare server field names (``max_running_requests``) too."""
    bare = {field.rsplit(".", 1)[1]: flag for field, flag in names.items()
            if field.startswith("server.") and "speculative" not in field}
    names = {**bare, **names}
    pattern = "|".join(re.escape(k) for k in sorted(names, key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({pattern})(?![\w])", lambda m: names[m.group(1)], message)


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
            message=name_flags(str(error), names) if names else str(error),
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

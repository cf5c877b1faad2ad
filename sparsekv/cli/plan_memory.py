"""``sparsekv plan-memory``: how many KV tokens of each pool fit, and why.

Answers one case (the schema is in ``docs/memory_cases.md``): a case shipped with the package
(``--case flash-pp2-40GiB``; ``--list-cases`` names them), a case file (``--case CASE.json [--name
NAME]``), or a case built from flags (``--model dsv4-flash --kv-budget 60GiB --pp 4 --hisparse 2``).
The budget is the bytes available for KV on each PP rank, not the GPU's size.

Both outputs carry the same facts (:mod:`sparsekv.srt.model_executor.plan_breakdown`): one JSON
document (``--json`` prints it) and the human breakdown written from that document alone, with
every setting named as the user wrote it (a flag, or a case field).

Exit codes: 0 planned; 1 the budget cannot hold a valid plan (``{"error", "message", "fixes"}`` on
stdout with ``--json``, the message on stderr); 2 malformed input (a :class:`~sparsekv.cli.UsageError`
for the shell: the message names the flag or the case field). Nothing the user types produces a
traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

from sparsekv.cli import UsageError
from sparsekv.kv_layout import DSV4_PAGE_SIZES
from sparsekv.srt.model_executor import cases as shipped_cases
from sparsekv.srt.model_executor.memory_case import LIMITS, MemoryCase, parse_case
from sparsekv.srt.model_executor.plan_breakdown import name_flags, plan_report, render_text

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
MAX_MESSAGE_CHARS = 400


class CaseError(UsageError):
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
        raise CaseError(name_flags(message, FLAG_OF) if from_flags else message) from None
    # The configurators follow sglang, which plans any multiple of 128; the kernels serve fewer.
    if case.is_dsv4 and case.server.page_size not in DSV4_PAGE_SIZES:
        message = (f"server.page_size must be one of {', '.join(map(str, DSV4_PAGE_SIZES))} for DSV4 (the page "
                   f"sizes the DSV4 kernels serve), got {case.server.page_size}")
        raise CaseError(name_flags(message, FLAG_OF) if from_flags else message)
    return case, (dict(FLAG_OF) if from_flags else {})


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
        message = str(e) if isinstance(e, CaseError) else name_flags(str(e), FLAG_OF) if args.case is None else str(e)
        raise UsageError(_short(message)) from None
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

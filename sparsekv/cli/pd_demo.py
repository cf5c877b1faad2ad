"""``sparsekv pd-demo``: a loopback prefill -> decode transfer of DSV4 pools, checked byte for byte.

Each session (:mod:`sparsekv.testing.pd_session`, which the PD tests run too) starts a prefill
process and a decode process on 127.0.0.1, over NIXL (default) or another engine of
:data:`~sparsekv.srt.disaggregation.engines.ENGINES` (``--engine``), with and without HiSparse on
the decode; this command prints each session's report. Exit code 0 only if every byte matched.

``--kill-decode-after N`` shows the failure path instead: the prefill kills the decode process
after N completed batches and reports the failed transfer.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from sparsekv.argtypes import int_list, int_range, number_range
from sparsekv.cli import UsageError
from sparsekv.srt.disaggregation.engines import DEFAULT_ENGINE, ENGINES, load_engine
from sparsekv.testing.pd_session import DemoSpec, first_c4_layer, run_session, verdict

#: The largest --budget-mib: the demo's pools live in this machine's memory (1 TiB at most).
_MAX_BUDGET_MIB = 1 << 20


# ---- the command ---------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sparsekv pd-demo``."""
    parser.add_argument("--seq-lens", type=int_list(1, 1 << 20), default=(1000, 3000, 700, 5000, 256),
                        help="comma-separated request lengths in tokens, each in [1, 2^20] (default: "
                             "1000,3000,700,5000,256)")
    parser.add_argument("--layers", type=int_range(1, 256), default=6, help="model layers (default: %(default)s)")
    parser.add_argument("--pp-size", type=int_range(1, 256), default=2,
                        help="prefill PP stages, at most --layers (default: %(default)s)")
    parser.add_argument("--budget-mib", type=int_range(1, _MAX_BUDGET_MIB), default=48,
                        help=f"KV budget per prefill stage, at most {_MAX_BUDGET_MIB} MiB (default: %(default)s)")
    parser.add_argument("--hisparse", choices=("off", "on", "both"), default="both",
                        help="HiSparse on the decode side (default: %(default)s)")
    parser.add_argument("--kill-decode-after", type=int_range(0), default=0, metavar="N",
                        help="kill the decode after N completed batches, to show the failure path")
    parser.add_argument("--timeout", type=number_range(0, 3600, lo_open=True), default=30.0,
                        help="bound of every wait in seconds (a process's start, each step of the transfer, "
                             "a process's end), in (0, 3600]")
    parser.add_argument("--seed", type=int_range(0, 2**32 - 1), default=0)
    parser.add_argument("--engine", choices=tuple(ENGINES), default=DEFAULT_ENGINE,
                        help="transfer engine of both sides (default: %(default)s; mooncake: the `mooncake` extra)")
    parser.add_argument("--json", action="store_true", help="print the full reports as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the sessions; 0 only if every byte of every session matched.

    Raises
    ------
    UsageError
        ``--pp-size`` above ``--layers`` (every stage holds at least one layer), ``--hisparse on``
        or ``both`` with no C4 layer among ``--layers``, or ``--engine``'s package is not installed.
    """
    if args.pp_size > args.layers:
        raise UsageError(f"--pp-size {args.pp_size}: more prefill stages than --layers {args.layers}")
    # Mooncake's engine logs every connection at INFO unless told otherwise, and takes its log
    # level only from the environment: this command's processes (spawned, they inherit it) say ERROR.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        load_engine(args.engine)
    except ImportError as e:
        raise UsageError(f"--engine {args.engine}: {e}") from None
    base = DemoSpec(num_layers=args.layers, pp_size=args.pp_size, budget_mib=args.budget_mib,
                    seq_lens=tuple(args.seq_lens), seed=args.seed,
                    timeout_s=args.timeout, kill_decode_after=args.kill_decode_after,
                    max_inflight=1 if args.kill_decode_after else 4,
                    max_batch_rows=4 if args.kill_decode_after else 16384, engine=args.engine)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.hisparse]
    if True in modes and args.layers <= first_c4_layer(base):
        raise UsageError(f"--hisparse {args.hisparse}: HiSparse holds C4 KV, and --layers {args.layers} holds no "
                         f"C4 layer (the first is layer {first_c4_layer(base)}); use --hisparse off or more --layers")
    reports, ok = [], True
    for hisparse in modes:
        report = run_session(replace(base, hisparse=hisparse))
        reports.append(report)
        good = verdict(report)
        ok &= good
        if not args.json:
            _print_report(report, good)
    if args.json:
        print(json.dumps(reports, indent=1, default=str))
    return 0 if ok else 1


def _print_report(report: dict, good: bool) -> None:
    spec, p, d = report["spec"], report["prefill"], report["decode"]
    mode = "HiSparse decode (C4 KV -> host pool)" if spec["hisparse"] else "device decode"
    engine = ENGINES[spec["engine"]].label
    print(f"== prefill PP={spec['pp_size']} -> {mode}, {len(report['plan'])} requests over 127.0.0.1 ({engine})")
    if d.get("killed"):
        print("   decode process killed mid-transfer")
    for r, room in sorted((p.get("rooms") or {}).items(), key=lambda kv: int(kv[0])):
        status = room["status"] + (f" ({room['error'][:100]})" if room["error"] else "")
        gbps = room["bytes"] / room["seconds"] / 1e9 if room["seconds"] else 0.0
        print(f"   room {r}: {room['bytes'] / 2**20:8.2f} MiB  {room['seconds'] * 1e3:7.2f} ms  {gbps:6.2f} GB/s  "
              f"{status}")
    if "rooms" in p:
        total = sum(room["bytes"] for room in p["rooms"].values())
        wall = d.get("elapsed") or p["elapsed"]
        print(f"   total {total / 2**20:.2f} MiB, first request to last arrival {wall * 1e3:.1f} ms "
              f"({total / max(wall, 1e-9) / 1e9:.2f} GB/s); prefill handles left {p['open_handles']}, "
              f"regions registered after close {p['registered_after_close']}")
    if "mismatched" in d:
        print(f"   decode checked {d['bytes_checked'] / 2**20:.1f} MiB in {d['regions_checked']} regions: "
              f"{sum(d['mismatched'].values())} bytes differ")
    print(f"   verdict: {'every byte matched' if good else 'FAILED'}")

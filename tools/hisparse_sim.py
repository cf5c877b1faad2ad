"""Replay top-k traces through the HiSparse hot buffer: LRU, a recency-protected LRU and Belady's optimum.

For each hot-buffer size H, reports per decode step the hit rate (lookups served without a load)
and the bytes moved host -> device (loads x item bytes), for the LRU policy of the swap-in kernel,
the recency-protected LRU (``recent_lru``: entries of the last ``--protect-recent`` positions are
evicted last), the neighbour-protected LRU (``near_lru``: also entries within ``--protect-near``
positions of a requested token) and Belady's offline optimum on the same trace
(:mod:`sparsekv.testing.hisparse_traces`). On a synthetic trace (also one saved by
``--save-trace``) it adds ``informed``: an online policy told the generator's own pick chances, the
closest to Belady that any online policy can expect on that trace. Each policy's bytes over
Belady's are in the table and the JSON.

Input: ``--trace PATH ...`` (files in our JSON trace format, see the module above, or folders of
them: each ``*.json`` inside), or a synthetic trace with tunable growth, drift, recency bias and
locality (``--save-trace`` writes it out). ``sparsekv demo --save-traces DIR`` records the demo's
decode (one trace per C4 layer); ``tools/hisparse_traces/`` ships one such recording.

Output, per trace: a summary table per H (stdout), the per-step table of one H (``--per-step H``),
JSON with every per-step series (``--json``: ``{"traces": [{"trace": ..., "rows": [...]}, ...]}``),
and a PNG of hit rate and bytes per step vs H, a row of plots per trace (``--plot``). H defaults
to the trace's top-k K times 1, 9/8, 5/4, 3/2, 2, 3 and 4. ``--quick`` shrinks the synthetic trace.

Examples::

    python tools/hisparse_sim.py --hot 512,640,768,1024,2048 --plot hit_rate.png
    python tools/hisparse_sim.py --trace tools/hisparse_traces --hot 128,256,512,1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from sparsekv.argtypes import int_list, int_range, number_range, output_path
from sparsekv.cli import CliParser
from sparsekv.kv_layout import V4
from sparsekv.testing.bench import add_common_args
from sparsekv.testing.hisparse_traces import POLICIES, PROTECT_NEAR, PROTECT_RECENT, Trace, replay, synthetic_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = CliParser(prog="tools/hisparse_sim.py", description=__doc__.splitlines()[0],
                  epilog="example:\n  python tools/hisparse_sim.py --hot 512,640,768,1024,2048 --plot hit_rate.png",
                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--trace", nargs="+", metavar="PATH",
                   help="replay these JSON traces (a folder: every *.json in it) instead of a synthetic one")
    p.add_argument("--save-trace", type=output_path, help="write the (synthetic) trace to this JSON file")
    p.add_argument("--hot", type=int_list(1, 1 << 20),
                   help="comma list of hot-buffer sizes H (each >= every trace's top-k K; default K times "
                        + ", ".join(f"{m:g}" for m in HOT_PER_TOP_K) + ": 512,576,...,2048 for K = 512)")
    p.add_argument("--item-bytes", type=int_range(1), default=V4.bytes_per_token,
                   help="bytes per loaded entry (584: V4)")
    p.add_argument("--per-step", type=int_range(1), metavar="H", help="also print the per-step table of this H")
    p.add_argument("--protect-recent", type=int_range(0), default=PROTECT_RECENT, metavar="W",
                   help="recent_lru, near_lru: positions before the newest evicted last (default %(default)s)")
    p.add_argument("--protect-near", type=int_range(0), default=PROTECT_NEAR, metavar="S",
                   help="near_lru: positions either side of a requested token evicted last (default %(default)s)")
    g = p.add_argument_group("synthetic trace")
    g.add_argument("--requests", type=int_range(1), default=4)
    g.add_argument("--steps", type=int_range(1), default=400)
    g.add_argument("--top-k", type=int_range(1), default=512)
    g.add_argument("--start-len", type=int_range(0), default=8192, help="initial compressed length of every request")
    g.add_argument("--growth", type=number_range(0, 1), default=0.25,
                   help="chance per step of one more compressed entry, in [0, 1]")
    g.add_argument("--drift", type=number_range(0, 1), default=0.05, help="fraction of the top-k replaced per step")
    g.add_argument("--recency", type=number_range(0, 1), default=0.3,
                   help="share of new picks among the latest entries")
    g.add_argument("--recency-window", type=int_range(1), default=256)
    g.add_argument("--locality", type=number_range(0, 1), default=0.3,
                   help="share of other new picks next to a current pick")
    g.add_argument("--locality-span", type=int_range(1), default=16)
    g.add_argument("--seed", type=int_range(0), default=0)
    args = p.parse_args(argv)
    args.loaded_traces = []
    for path in trace_files(args.trace or []):  # read now: a missing or malformed file is a usage error
        try:
            args.loaded_traces.append((str(path), Trace.load(path)))
        except (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
            # RecursionError: JSON nested deeper than the parser's recursion limit.
            p.error(f"--trace {path}: not a readable trace file ({type(e).__name__}: {e})")
    if args.trace and not args.loaded_traces:
        p.error(f"--trace {' '.join(args.trace)}: no *.json trace in it")
    for path, trace in args.loaded_traces or [("synthetic", SimpleNamespace(num_top_k=args.top_k))]:
        if args.hot and min(args.hot) < trace.num_top_k:
            p.error(f"--hot: every H must be >= the top-k of the {path} trace ({trace.num_top_k}), got {min(args.hot)}")
    if args.hot and args.per_step is not None and args.per_step not in args.hot:
        p.error(f"--per-step {args.per_step} is not one of the --hot sizes")
    return args


#: The default hot-buffer sizes, as multiples of a trace's top-k.
HOT_PER_TOP_K = (1, 1.125, 1.25, 1.5, 2, 3, 4)


def trace_files(paths: list[str]) -> list[Path]:
    """The trace files named: a file as given, a folder as its ``*.json`` files in name order."""
    return [f for path in map(Path, paths) for f in (sorted(path.glob("*.json")) if path.is_dir() else [path])]


def load_or_make_traces(args: argparse.Namespace) -> list[tuple[str, Trace]]:
    """``(label, trace)`` of every trace to replay: the files given, else one synthetic trace."""
    if args.loaded_traces:  # loaded (and checked) when the arguments were parsed
        return args.loaded_traces
    steps, requests = (100, 2) if args.quick else (args.steps, args.requests)
    return [("synthetic", synthetic_trace(
        num_requests=requests, num_steps=steps, num_top_k=args.top_k, start_len=args.start_len, growth=args.growth,
        drift=args.drift, recency=args.recency, recency_window=args.recency_window, locality=args.locality,
        locality_span=args.locality_span, seed=args.seed))]


def trace_policies(trace: Trace) -> list[str]:
    """The policies a trace can be replayed with (``informed`` needs a synthetic trace's generator)."""
    return [p for p in POLICIES if p != "informed" or trace.generator is not None]


def simulate(trace: Trace, hots: list[int], item_bytes: int, protect_recent: int = PROTECT_RECENT,
             protect_near: int = PROTECT_NEAR, desc: str = "hisparse_sim") -> list[dict]:
    """One row per H: overall hit rates and bytes, and every per-step series, for every policy."""
    rows = []
    policies = trace_policies(trace)
    for hot in tqdm(hots, desc=desc, unit="H", disable=None):
        row: dict = {"hot": hot}
        for policy in policies:
            result = replay(trace, hot, policy, protect_recent=protect_recent, protect_near=protect_near)
            row[f"{policy}_hit_rate"] = result.hit_rate
            row[f"{policy}_bytes"] = result.loads * item_bytes
            row[f"{policy}_bytes_per_step"] = result.loads * item_bytes / max(len(result.steps), 1)
            row[f"{policy}_steps"] = [{"hit_rate": s.hit_rate, "bytes": s.loads * item_bytes} for s in result.steps]
        row["belady_over_lru_bytes"] = row["belady_bytes"] / row["lru_bytes"] if row["lru_bytes"] else 1.0
        for policy in (p for p in policies if p != "belady"):
            row[f"{policy}_over_belady_bytes"] = row[f"{policy}_bytes"] / row["belady_bytes"] if row["belady_bytes"] \
                else 1.0
        rows.append(row)
    return rows


def print_tables(rows: list[dict], per_step: int | None, out=sys.stdout) -> None:
    names = {"lru": "LRU", "recent_lru": "recent", "near_lru": "near", "belady": "Belady", "informed": "informed"}
    policies = [p for p in POLICIES if f"{p}_bytes" in rows[0]]
    online = [p for p in policies if p != "belady"]
    print(f"{'H':>6} " + " ".join(f"{names[p] + ' hit':>13}" for p in policies) + " "
          + " ".join(f"{names[p] + ' MB/step':>17}" for p in policies)
          + " " + " ".join(f"{names[p] + '/Belady':>16}" for p in online), file=out)
    for r in rows:
        print(f"{r['hot']:>6} " + " ".join(f"{r[p + '_hit_rate']:>13.4f}" for p in policies) + " "
              + " ".join(f"{r[p + '_bytes_per_step'] / 1e6:>17.4f}" for p in policies)
              + " " + " ".join(f"{r[p + '_over_belady_bytes']:>16.3f}" for p in online), file=out)
    if per_step is None:
        return
    row = next((r for r in rows if r["hot"] == per_step), None)
    if row is None:
        print(f"\n(no per-step table: H={per_step} is not one of this trace's H)", file=out)
        return
    print(f"\nper step, H={per_step}", file=out)
    print(f"{'step':>6} " + " ".join(f"{names[p] + ' hit':>13}" for p in policies) + " "
          + " ".join(f"{names[p] + ' bytes':>15}" for p in policies), file=out)
    for i, steps in enumerate(zip(*(row[f"{p}_steps"] for p in policies))):
        print(f"{i:>6} " + " ".join(f"{s['hit_rate']:>13.4f}" for s in steps) + " "
              + " ".join(f"{s['bytes']:>15}" for s in steps), file=out)


def plot(results: list[dict], path: str) -> None:
    """Hit rate and MB per step vs H, one row of two plots per trace (``results``: the JSON's ``traces``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    styles = {"lru": "o-", "recent_lru": "^-", "near_lru": "v-", "belady": "s--", "informed": "d:"}
    for (ax1, ax2), result in zip(axes, results):
        rows = result["rows"]
        hots = [r["hot"] for r in rows]
        for policy, style in ((p, s) for p, s in styles.items() if f"{p}_bytes" in rows[0]):
            ax1.plot(hots, [r[f"{policy}_hit_rate"] for r in rows], style, label=policy)
            ax2.plot(hots, [r[f"{policy}_bytes_per_step"] / 1e6 for r in rows], style, label=policy)
        ax1.set_xlabel("hot buffer size H")
        ax1.set_ylabel("hit rate")
        ax2.set_xlabel("hot buffer size H")
        ax2.set_ylabel("MB host -> device per step")
        for ax in (ax1, ax2):
            ax.grid(True, alpha=0.3)
            ax.legend()
        ax1.set_title(f"{result['trace']} (K={result['num_top_k']})", fontsize=9)
    fig.suptitle("HiSparse hot buffer: policies vs Belady")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    traces = load_or_make_traces(args)
    if args.save_trace:
        traces[0][1].save(args.save_trace)
    results = []
    for label, trace in traces:
        hots = sorted(set(args.hot or (round(trace.num_top_k * m) for m in HOT_PER_TOP_K)))
        rows = simulate(trace, hots, args.item_bytes, args.protect_recent, args.protect_near, desc=label)
        print(f"trace {label}: {len(trace.requests)} requests, {trace.num_steps} steps, K={trace.num_top_k}")
        print_tables(rows, args.per_step)
        source = None if trace.source is None else {k: v for k, v in trace.source.items() if k != "kernel_steps"}
        results.append({"trace": label, "num_top_k": trace.num_top_k, "requests": len(trace.requests),
                        "steps": trace.num_steps, "source": source, "rows": rows})
    doc = {"name": "hisparse_sim", "protect_recent": args.protect_recent, "protect_near": args.protect_near,
           "item_bytes": args.item_bytes,
           "synthetic": None if args.trace else {k: getattr(args, k) for k in (
               "growth", "drift", "recency", "recency_window", "locality", "locality_span", "start_len", "seed")},
           "traces": results}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(doc, f)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

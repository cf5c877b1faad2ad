"""``sparsekv bench``: run the benchmark of every kernel family, collect its JSON and plots, print ratios.

The benchmarks are the scripts ``tools/bench/bench_<stem>.py`` of a checkout. A wheel ships the
same files as package data under ``sparsekv/benchmarks/`` (``setup.py`` maps the folder), so the
command finds them in a checkout first and in the installed package otherwise; there is one copy of
each benchmark, and each still runs on its own (``python tools/bench/bench_gather_rows.py --help``).

Each benchmark runs in its own process (``--quick``, ``--backend``, ``--json`` and ``--plot`` passed
through), so one that fails is reported and the others still run. ``all`` runs the benchmarks whose
stem is a kernel family's (its header ``csrc/<stem>.cuh``); a NAME runs any benchmark, with or
without its ``bench_`` prefix. Into ``--out`` go ``results.json`` (every benchmark's document, its
command, exit code and wall time) and ``bench_<stem>.png`` per benchmark. On stdout: one table of the
ratios each benchmark reports against its same-run baseline (row keys ``*_vs_*``, ``speedup_*``,
``*_over_*``), median, min and max over its cases.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sparsekv
from sparsekv.cli import UsageError
from sparsekv.testing.bench import add_backend_arg, takes_backend

RATIO_KEY = re.compile(r"(_vs_|^speedup|_over_)")


def benchmark_folder() -> Path:
    """Where the benchmark scripts are: ``tools/bench`` of a checkout, else the installed package's copy."""
    package = Path(sparsekv.__file__).resolve().parent
    checkout = package.parent / "tools" / "bench"
    return checkout if checkout.is_dir() else package / "benchmarks"


def available() -> dict[str, Path]:
    """Every benchmark script, by stem (``gather_rows`` for ``bench_gather_rows.py``)."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(benchmark_folder().glob("bench_*.py"))}


def kernel_family_stems() -> set[str]:
    """The stems of the registered kernel families' headers."""
    from sparsekv.jit_kernel.build.registry import discover

    return {family.stem for family in discover().values()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sparsekv bench``."""
    parser.add_argument("name", nargs="?", default="all", metavar="NAME",
                        help="a benchmark (e.g. gather_rows), or 'all': every kernel family's (default: all)")
    parser.add_argument("--quick", action="store_true", help="each benchmark's short sweep")
    add_backend_arg(parser)  # cuda without a visible GPU: a usage error here, not one failure per benchmark
    parser.add_argument("--out", default="bench-results", metavar="DIR",
                        help="folder for results.json and the PNG plots (default: %(default)s)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")


def selected(name: str) -> dict[str, Path]:
    """The benchmarks ``name`` stands for; :class:`UsageError` naming the known ones otherwise."""
    scripts = available()
    if name == "all":
        families = kernel_family_stems()
        return {stem: path for stem, path in scripts.items() if stem in families}
    stem = name.removeprefix("bench_").removesuffix(".py")
    if stem not in scripts:
        raise UsageError(f"NAME: no benchmark {name!r}; known: all, {', '.join(scripts)}")
    return {stem: scripts[stem]}


def ratios(document: dict) -> dict[str, list[float]]:
    """The ratio columns of a benchmark's rows: key -> values over its cases."""
    found: dict[str, list[float]] = {}
    for row in document.get("rows", []):
        for key, value in row.items():
            if RATIO_KEY.search(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
                found.setdefault(key, []).append(float(value))
    return found


def run_one(stem: str, script: Path, args: argparse.Namespace, out: Path) -> dict:
    """Run one benchmark script; its document, command, exit code and wall time."""
    json_path, plot_path = out / f"bench_{stem}.json", out / f"bench_{stem}.png"
    command = [sys.executable, str(script), "--json", str(json_path), "--plot", str(plot_path)]
    if args.quick:
        command.append("--quick")
    backend = takes_backend(script.read_text())
    if backend:
        command += ["--backend", args.backend]
    start = time.perf_counter()
    # Its JSON goes to the file; its progress bar and any error message to our stderr.
    done = subprocess.run(command, stdout=subprocess.DEVNULL)
    entry = {"command": command, "returncode": done.returncode, "wall_s": round(time.perf_counter() - start, 2),
             "backend": args.backend if backend else "n/a"}
    if done.returncode == 0 and json_path.is_file():
        entry["result"] = json.loads(json_path.read_text())
        json_path.unlink()  # results.json holds it
        entry["plot"] = plot_path.name if plot_path.is_file() else None
        entry["ratios"] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "cases": len(v)}
                           for k, v in ratios(entry["result"]).items()}
    else:
        entry["error"] = "its message is above" if done.returncode else "it wrote no JSON"
    return entry


#: The table's header: which way the ratios point (every benchmark reports its ratios so).
RATIO_DIRECTION = ("Each ratio is a throughput ratio against a baseline timed in the same run (the baseline's "
                   "time over ours): above 1, ours is faster; for *_vs_memcpy, the share of memcpy's bandwidth "
                   "ours reaches (1 = as fast as memcpy).")


def reads(key: str) -> str:
    """How a ratio column reads: ``"> 1: ours faster than <baseline>"``, or the memcpy share."""
    if key.endswith("_vs_memcpy"):
        return "share of memcpy bandwidth"
    baseline = key.split("_vs_", 1)[1] if "_vs_" in key else "baseline"
    return f"> 1: faster than {baseline}"


def table(results: dict[str, dict]) -> str:
    """One text table: benchmark, ratio, how it reads, median, min, max, cases (a failed benchmark:
    its error), under a line that says which way the ratios point."""
    lines = [("benchmark", "ratio", "reads", "median", "min", "max", "cases")]
    for stem, entry in results.items():
        if "error" in entry:
            lines.append((stem, f"FAILED (exit {entry['returncode']}): {entry['error'][:80]}", "", "", "", "", ""))
            continue
        if not entry["ratios"]:
            lines.append((stem, "(no ratio columns)", "", "", "", "", ""))
        for key, r in entry["ratios"].items():
            lines.append((stem, key, reads(key), f"{r['median']:.3g}", f"{r['min']:.3g}", f"{r['max']:.3g}",
                          str(r["cases"])))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    rows = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join([RATIO_DIRECTION, *rows])


def run(args: argparse.Namespace) -> int:
    """``sparsekv bench``: 0 when every benchmark ran and wrote its JSON, 1 otherwise."""
    if args.list:
        families = kernel_family_stems()
        for stem, path in available().items():
            print(f"{stem:20s} {'kernel family' if stem in families else 'other':14s} {path}")
        return 0
    chosen = selected(args.name)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {args.out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for k, (stem, script) in enumerate(chosen.items(), 1):
        print(f"[{k}/{len(chosen)}] bench_{stem}", file=sys.stderr, flush=True)
        results[stem] = run_one(stem, script, args, out)
    document = {"quick": args.quick, "backend": args.backend, "folder": str(benchmark_folder()),
                "benchmarks": results}
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    print(table(results))
    print(f"wrote {out / 'results.json'}")
    return 0 if all("error" not in e for e in results.values()) else 1

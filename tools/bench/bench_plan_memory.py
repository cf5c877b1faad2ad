"""Benchmark ``sparsekv plan-memory``: one case answered in-process and from a fresh process.

For each case: the in-process plan (parse + every PP rank + MIN + finalize), the fix search of an
infeasible case, and the wall time of ``python -m sparsekv plan-memory ... --json`` in a fresh
process, against the baseline of a fresh interpreter that only imports ``sparsekv`` (measured in
the same run). Prints JSON (``sparsekv.testing.bench``); ``--plot PNG`` draws the latencies.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from sparsekv.cli import CliParser
from sparsekv.srt.model_executor.memory_case import parse_case
from sparsekv.srt.model_executor.plan_advice import fixes
from sparsekv.testing.bench import BenchResult, add_common_args, bar_plot, report, time_call

GOLDEN = Path(__file__).resolve().parents[2] / "tests" / "golden" / "memory_plans.json"
CASES = ("flash-pp1-40GiB", "flash-pp4-40GiB", "mixed-09", "gemma-like-hybrid-swa-40GiB",
         "flash-pp1-2.55GiB-swa-floor", "mixed-02")


def fresh_process_ms(argv: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, *argv], capture_output=True, check=False)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = CliParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args()
    runs = 3 if args.quick else 9
    by_name = {c["name"]: c for c in json.loads(GOLDEN.read_text())}
    result = BenchResult(name="plan_memory", baseline="fresh `python -c 'import sparsekv'`",
                         threads={"ours": 1, "baseline": 1})
    baseline_ms = fresh_process_ms(["-c", "import sparsekv"], runs)
    result.notes["baseline_fresh_process_ms"] = baseline_ms
    for name in tqdm(CASES, desc="bench_plan_memory", unit="case", disable=None):
        case = parse_case(by_name[name])
        try:
            case.plan()
            feasible = True
        except (ValueError, RuntimeError):
            feasible = False
        row = {"case": name, "pp_size": case.pp_size, "feasible": feasible}
        row["plan_in_process_us"] = time_call(lambda case=case: _plan_or_error(case)).median_s * 1e6
        if not feasible:
            row["fix_search_ms"] = time_call(lambda case=case: fixes(case), repeats=3).median_s * 1e3
        argv = ["-m", "sparsekv", "plan-memory", "--case", str(GOLDEN), "--name", name, "--json"]
        row["cli_fresh_process_ms"] = fresh_process_ms(argv, runs)
        human = ["-m", "sparsekv", "plan-memory", "--case", str(GOLDEN), "--name", name]
        row["cli_human_fresh_process_ms"] = fresh_process_ms(human, runs)
        row["cli_over_baseline"] = row["cli_fresh_process_ms"] / baseline_ms
        result.rows.append(row)
    report(result, args, plot=lambda r, path: bar_plot(
        r, path, label_key="case", value_keys=("cli_fresh_process_ms", "cli_human_fresh_process_ms"),
        ylabel="ms (fresh process)"))


def _plan_or_error(case) -> None:
    try:
        case.plan()
    except (ValueError, RuntimeError):
        pass


if __name__ == "__main__":
    main()

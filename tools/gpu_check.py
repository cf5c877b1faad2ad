"""One-call GPU verification (`make gpu-check`): everything a briefly lent GPU should run, in one go.

A session is lent a GPU by chance, for minutes, on a bare image (CUDA 13, python3 3.12 with torch,
triton, pytest, pytest-xdist and hypothesis; no network). This script, run from the repository root:

1. installs apache-tvm-ffi from the wheel folder carried with the tree (``--wheels``, default
   ``wheels/``), then sparsekv itself with ``--no-deps`` into the image's Python (no venv);
2. builds every registered cuda module for the GPU it finds (``sparsekv jit build --backend cuda --all``);
3. runs every kernel test on the backends cpu,cuda (the cuda build compared with the cpu build);
4. runs the graph-capture test of a full decode step;
5. runs compute-sanitizer (memcheck, then racecheck) on one small test per kernel family; where the
   tool is missing or refuses the device, the step says so and the run goes on;
6. runs every kernel benchmark with ``--backend cuda --quick`` (CUDA events);
7. writes ``summary.json`` and ``summary.md`` into ``--out``: pass/fail and seconds per step, and
   each benchmark's JSON (its time against its roofline time where it reports one).

Each step has a time limit (they add up to about 15 minutes, the worst case); the whole run is
meant to finish in under 8 minutes on an H100 (not yet measured: no GPU has run it).
``--dry-run`` (``make gpu-check DRY_RUN=1``) needs no GPU: it lists the steps and checks the
plumbing (every test and benchmark the steps name exists, each benchmark takes the flags the
steps pass, the summary writes), which CI runs.

The wheel folder, prepared on a machine with network (cp312 manylinux, the version in pyproject)::

    python3 -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        --platform manylinux_2_28_x86_64 --no-deps -d wheels "apache-tvm-ffi>=0.1"
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "tools" / "bench"
#: Benchmarks that time a kernel family (the others time the loader, planning or PD transfer).
KERNEL_BENCHMARKS = ("bench_dsv4_attention.py", "bench_dsv4_compress.py", "bench_dsv4_indexer.py",
                     "bench_dsv4_quant.py", "bench_dsv4_store.py", "bench_gather_rows.py", "bench_hisparse.py",
                     "bench_hisparse_copy.py")
GRAPH_CAPTURE_TEST = "tests/kernels/test_torch_op.py::test_a_captured_decode_step_replays_without_a_host_sync"
#: One small test per kernel family, run under compute-sanitizer (cuda backend only).
SANITIZER_CASES = {
    "gather_rows": "tests/kernels/test_gather_rows.py::test_gather_matches_torch_indexing",
    "hisparse_copy": "tests/kernels/test_hisparse_copy.py::test_transfer_cache_dsv4_mla_copies_paged_token",
    "dsv4_quant": "tests/kernels/test_dsv4_quant.py::test_edge_blocks_hit_exact_scales",
    "dsv4_compress": "tests/kernels/test_dsv4_compress.py::test_c4_entry_zero_uses_only_the_b_halves",
    "dsv4_store": "tests/kernels/test_dsv4_store.py::test_streamed_entries_store_the_one_shot_cache_bytes",
    "dsv4_indexer": "tests/kernels/test_dsv4_indexer.py::test_ties_at_the_threshold_go_to_the_lower_positions",
    "dsv4_attention": "tests/kernels/test_dsv4_attention.py::test_a_slot_listed_twice_counts_twice",
    "hisparse": "tests/kernels/test_hisparse.py::test_hits_newest_and_lru_then_misses_take_lru_slots",
}
SANITIZER_TOOLS = ("memcheck", "racecheck")


@dataclass
class Step:
    """One step: a command, its time limit, and what it reported."""

    name: str
    command: list[str]
    limit_s: int
    env: dict[str, str] = field(default_factory=dict)
    optional: bool = False  # a missing tool is reported, not a failure
    status: str = "pending"
    seconds: float = 0.0
    detail: str = ""


def plan(python: str, wheels: Path, out: Path, jobs: int) -> list[Step]:
    """The steps, in order."""
    cuda_tests = {"SPARSEKV_TEST_BACKENDS": "cpu,cuda"}
    steps = [
        Step("install tvm-ffi", [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                                 "apache-tvm-ffi"], 60),
        Step("install sparsekv", [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e",
                                  str(REPO)], 60),
        Step("build cuda modules", [python, "-m", "sparsekv", "jit", "build", "--backend", "cuda", "--all"], 180),
        Step("kernel tests cpu,cuda", [python, "-m", "pytest", "-q", "-n", str(jobs), "-p", "no:cacheprovider",
                                       "tests/kernels"], 180, cuda_tests),
        Step("graph capture", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", GRAPH_CAPTURE_TEST], 60,
             cuda_tests),
    ]
    # One process per tool (the sanitizer's start-up dominates a small case): every family's case in it.
    sanitizer = shutil.which("compute-sanitizer") or "compute-sanitizer"
    cases = [case + "[cuda]" for case in SANITIZER_CASES.values()]
    for tool in SANITIZER_TOOLS:
        steps.append(Step(f"{tool} (one case per family)", [sanitizer, "--tool", tool, "--error-exitcode", "1",
                                                            python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                            *cases], 150, {"SPARSEKV_TEST_BACKENDS": "cuda"},
                          optional=True))
    for bench in KERNEL_BENCHMARKS:
        steps.append(Step(f"bench {bench[len('bench_'):-len('.py')]}",
                          [python, str(BENCH_DIR / bench), "--backend", "cuda", "--quick", "--json",
                           str(out / (bench[:-len(".py")] + ".json"))], 60))
    return steps


def run_step(step: Step, log_dir: Path) -> None:
    """Run one step with its time limit; record pass / fail / skipped (a missing optional tool)."""
    if step.optional and shutil.which(step.command[0]) is None:
        step.status, step.detail = "skipped", f"{step.command[0]} is not on PATH"
        return
    started = time.monotonic()
    log = log_dir / (step.name.replace(" ", "_").replace(",", "_") + ".log")
    try:
        done = subprocess.run(step.command, cwd=REPO, env={**os.environ, **step.env}, capture_output=True,
                              text=True, timeout=step.limit_s)
        log.write_text(done.stdout + done.stderr)
        step.status = "pass" if done.returncode == 0 else "fail"
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        step.detail = " | ".join(tail)
        if step.optional and step.status == "fail" and "not supported" in done.stdout + done.stderr:
            step.status = "skipped"  # the sanitizer refuses this device: say so and go on
    except subprocess.TimeoutExpired:
        step.status, step.detail = "fail", f"over its {step.limit_s} s limit"
    step.seconds = round(time.monotonic() - started, 1)


def check_plumbing(steps: list[Step], wheels: Path) -> list[str]:
    """What a dry run can check without a GPU: named files, tests and flags exist. Returns the problems."""
    problems = []
    names = [GRAPH_CAPTURE_TEST, *SANITIZER_CASES.values()]
    for node in names:
        path, _, test = node.partition("::")
        if not (REPO / path).is_file():
            problems.append(f"{path} does not exist")
        elif f"def {test}(" not in (REPO / path).read_text():
            problems.append(f"{path} has no test {test}")
    for bench in KERNEL_BENCHMARKS:
        path = BENCH_DIR / bench
        if not path.is_file():
            problems.append(f"{path.relative_to(REPO)} does not exist")
            continue
        helped = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
        for flag in ("--backend", "--quick", "--json"):
            if flag not in helped.stdout:
                problems.append(f"{bench} does not take {flag}")
    if not (REPO / "Makefile").read_text().count("gpu-check:"):
        problems.append("the Makefile has no gpu-check target")
    if not wheels.is_dir():
        print(f"note: the wheel folder {wheels} is absent here (a GPU run needs it; see --help)")
    return problems


def write_summary(steps: list[Step], out: Path, device: str) -> dict:
    """summary.json and summary.md in ``out``; returns the JSON document."""
    benches = {}
    for step in steps:
        if step.name.startswith("bench ") and step.status == "pass":
            path = Path(step.command[-1])
            if path.is_file():
                benches[step.name[len("bench "):]] = json.loads(path.read_text())
    doc = {"device": device, "steps": [{"name": s.name, "status": s.status, "seconds": s.seconds,
                                        "detail": s.detail} for s in steps],
           "passed": all(s.status in ("pass", "skipped", "planned") for s in steps), "benchmarks": benches}
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# sparsekv gpu-check on {device}", "", "| step | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds} | {s.detail.replace('|', '/')[:160]} |" for s in steps]
    for name, result in benches.items():
        lines += ["", f"## bench {name}: kernel time against the roofline", "", "| case | measured | roofline |",
                  "|---|---|---|"]
        lines += [f"| {case} | {measured} | {roofline} |" for case, measured, roofline in roofline_rows(result)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return doc


def roofline_rows(result: dict) -> list[tuple[str, str, str]]:
    """(case, the kernel's measured times, the paper H100/H200 times) of each row of a benchmark's JSON:
    measured are the ``*_us`` / ``*_ms`` fields naming the kernel, paper ones start with h100 / h200."""
    rows = []
    for row in result.get("rows", []):
        case = str(row.get("case", next((v for v in row.values() if isinstance(v, str)), "?")))
        measured = ", ".join(f"{k}={v}" for k, v in row.items() if "kernel" in k and k.endswith(("_us", "_ms")))
        roofline = ", ".join(f"{k}={v}" for k, v in row.items() if k.startswith(("h100", "h200")))
        rows.append((case, measured or "-", roofline or "-"))
    return rows


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        return "no torch"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__[__doc__.index("The wheel folder"):])
    parser.add_argument("--out", type=Path, default=REPO / "gpu-check", help="where the summaries go")
    parser.add_argument("--wheels", type=Path, default=REPO / "wheels", help="folder of the apache-tvm-ffi wheel")
    parser.add_argument("--python", default=sys.executable, help="the image's Python (default: this one)")
    parser.add_argument("--jobs", type=int, default=4, help="pytest-xdist workers for the kernel tests")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and check the plumbing, no GPU")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = plan(args.python, args.wheels, args.out, args.jobs)
    print(f"{len(steps)} steps, at most {sum(s.limit_s for s in steps)} s by their limits:")
    for step in steps:
        print(f"  {step.name:32s} {step.limit_s:4d} s  {' '.join(step.command[:6])} ...")
    if args.dry_run:
        problems = check_plumbing(steps, args.wheels)
        for step in steps:
            step.status = "planned"
        write_summary(steps, args.out, "dry run")
        for problem in problems:
            print(f"problem: {problem}")
        return 1 if problems else 0
    log_dir = args.out / "logs"
    log_dir.mkdir(exist_ok=True)
    for step in steps:
        run_step(step, log_dir)
        print(f"{step.status:8s} {step.seconds:6.1f} s  {step.name}  {step.detail[:100]}", flush=True)
        if step.name.startswith("install") and step.status != "pass":
            break  # nothing after it can run
    doc = write_summary(steps, args.out, device_name())
    print(f"summary: {args.out / 'summary.md'}")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

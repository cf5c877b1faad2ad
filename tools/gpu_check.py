"""One-call GPU verification (`make gpu-check`): everything a briefly lent GPU should run, in one go.

A session is lent a GPU by chance, for minutes, on a bare image (CUDA 13, python3 3.12 with torch,
triton, pytest, pytest-xdist and hypothesis; no network). This script, run from the repository root:

0. probes the machine (GPU, driver, nvcc, torch and triton versions);
1. installs apache-tvm-ffi from the wheel folder carried with the tree (``--wheels``, default
   ``wheels/``), then sparsekv itself with ``--no-deps`` into the image's Python (no venv);
2. builds every registered module for the GPU it finds and for the cpu backend (``sparsekv jit build
   --all``), so the tests below find them built;
3. runs the graph-capture test of a full decode step;
4. runs compute-sanitizer memcheck on one small test per kernel family; where the tool is missing or
   refuses the device, the step says so and the run goes on;
5. runs every kernel benchmark with ``--backend cuda --quick``: each kernel's device time is a
   CUDA-graph replay (or a loop of 100 calls where a call cannot be captured; the row says which),
   beside one eager call's latency, its bytes and FLOPs and its H100/H200/B200 roofline
   (``sparsekv.testing.roofline``); and FlashMLA beside our attention (``--peer``) where its peer
   library was built into ``peers/flashmla`` (docs/flashmla.md);
6. runs compute-sanitizer racecheck on the same cases;
7. runs every kernel test on the cuda backend (each compared with the cpu build of its header; the
   Triton twins run natively), with what is left of the budget;
8. writes ``summary.json`` and ``summary.md`` into ``--out``: pass/fail and seconds per step, each
   benchmark's JSON, and per kernel row its measured device time, eager latency, roofline on the GPU
   it ran on and ``measured / roofline`` (``roofline`` in summary.json).

Each step has a time limit, and the whole run has a budget (``--budget-s``, default 420 s): a step
gets at most what is left of it, and a step that would start with under 10 s left is reported as
"not run (budget)". A lent GPU's minutes are few, so the most telling steps go first. The summary is
rewritten after every step, so a run killed from outside still leaves what it had. ``--out`` holds
three files: ``summary.json``, ``summary.md`` and ``logs.tar.gz`` (each step's full output and each
benchmark's JSON), few enough to come back from a lent machine.
``--dry-run`` (``make gpu-check DRY_RUN=1``) needs no GPU: it lists the steps and checks the
plumbing (every test and benchmark the steps name exists, each benchmark takes the flags the
steps pass, the summary writes), which CI runs.

The wheel folder, prepared on a machine with network (cp312 manylinux, the version in pyproject)::

    python3 -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        --platform manylinux_2_28_x86_64 --no-deps -d wheels "apache-tvm-ffi>=0.1"
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A bare GPU image runs this before sparsekv is installed: the command-line helpers come from the checkout.
sys.path.insert(0, str(REPO))
from sparsekv.argtypes import int_range, number_range  # noqa: E402
from sparsekv.cli import CliParser  # noqa: E402

BENCH_DIR = REPO / "tools" / "bench"
KERNEL_TESTS = REPO / "tests" / "kernels"
#: The mark of each family's one small test that runs under compute-sanitizer (cuda backend only).
SANITIZER_MARK = "pytest.mark.sanitizer_case"


def kernel_stems() -> list[str]:
    """The kernel families' stems, one header ``csrc/<stem>.cuh`` each. Read from the checkout, not from
    the registry: a bare image runs this before sparsekv and tvm-ffi are installed
    (tests/test_gpu_check.py holds the two equal)."""
    return sorted(p.stem for p in (REPO / "csrc").glob("*.cuh"))


def kernel_benchmarks(stems: list[str]) -> tuple[str, ...]:
    """The families' benchmarks: ``bench_<stem>.py``, and ``bench_<stem>_<what>.py`` where a family's
    benchmarks split by function (the other benchmarks time the loader, planning or PD transfer)."""
    return tuple(sorted(p.name for p in BENCH_DIR.glob("bench_*.py")
                        if any(p.stem == f"bench_{stem}" or p.stem.startswith(f"bench_{stem}_") for stem in stems)))


def sanitizer_marked(stem: str) -> list[str]:
    """The tests of ``tests/kernels/test_<stem>.py`` marked ``@pytest.mark.sanitizer_case``, as node ids."""
    path = KERNEL_TESTS / f"test_{stem}.py"
    if not path.is_file():
        return []
    return [f"{path.relative_to(REPO)}::{node.name}" for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and any(ast.unparse(d) == SANITIZER_MARK for d in node.decorator_list)]


KERNEL_STEMS = kernel_stems()
KERNEL_BENCHMARKS = kernel_benchmarks(KERNEL_STEMS)
#: CUDA-graph captures: one C4 layer's step without a host sync, the attention backend's whole decode
#: step replayed with a padding row, and a compressor step replayed from its owned pinned staging.
GRAPH_CAPTURE_TESTS = (
    "tests/kernels/test_torch_op.py::test_a_captured_decode_step_replays_without_a_host_sync",
    "tests/runtime/test_dsv4_attention_backend.py::test_a_replay_with_a_padding_row_equals_eager_for_its_real_rows"
    "[cuda-resident]",
    "tests/runtime/test_dsv4_attention_backend.py::test_a_replay_with_a_padding_row_equals_eager_for_its_real_rows"
    "[cuda-hisparse]",
    "tests/runtime/test_host_staging.py::test_a_captured_compressor_step_replays_after_its_pinned_neighbours_are_reused",
)
#: Each family's sanitizer case, by stem (a family marking none, or several, is a plumbing problem).
SANITIZER_CASES = {stem: marked[0] for stem in KERNEL_STEMS if len(marked := sanitizer_marked(stem)) == 1}
SANITIZER_TOOLS = ("memcheck", "racecheck")
#: FlashMLA's kernels as a peer of our attention (docs/flashmla.md): built by tools/peers/build_flashmla.sh
#: into this ignored folder, carried with the tree; its step runs only where the library is present.
PEER_LIBRARY = REPO / "peers" / "flashmla" / "libsparsekv_flashmla.so"


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


def plan(python: str, wheels: Path, work: Path, jobs: int, peer_library: Path = PEER_LIBRARY) -> list[Step]:
    """The steps, in order: the short, telling ones first, the whole kernel suite last (it takes what
    is left of the budget, and its log says how far it got)."""
    # The cuda tests run the cpu build of each header as their reference; the cpu-only tests ran in CI.
    cuda_tests = {"SPARSEKV_TEST_BACKENDS": "cuda"}
    steps = [
        Step("probe", ["sh", "-c", "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; "
                                   "nvcc --version | tail -1; " + python + " -c 'import torch, triton; "
                                   "print(torch.__version__, triton.__version__)'"], 30),
        Step("install tvm-ffi", [python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels),
                                 "apache-tvm-ffi"], 60),
        Step("install sparsekv", [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e",
                                  str(REPO)], 60),
        *(Step(f"build {backend} modules", [python, "-m", "sparsekv", "jit", "build", "--backend", backend, "--all",
                                            "--jobs", str(jobs)], 180) for backend in ("cuda", "cpu")),
        Step("graph capture", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GRAPH_CAPTURE_TESTS], 120,
             cuda_tests),
    ]
    # One process per tool (the sanitizer's start-up dominates a small case): every family's case in it.
    sanitizer = shutil.which("compute-sanitizer") or "compute-sanitizer"
    sanitized = [Step(f"{tool} (one case per family)", [sanitizer, "--tool", tool, "--error-exitcode", "1", python,
                                                        "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                        *SANITIZER_CASES.values()], 150, cuda_tests, optional=True)
                 for tool in SANITIZER_TOOLS]
    benches = [Step(f"bench {bench[len('bench_'):-len('.py')]}",
                    [python, str(BENCH_DIR / bench), "--backend", "cuda", "--quick", "--json",
                     str(work / (bench[:-len(".py")] + ".json"))], 60) for bench in KERNEL_BENCHMARKS]
    if peer_library.is_file():
        benches.append(Step("bench dsv4_attention vs flashmla",
                            [python, str(BENCH_DIR / "bench_dsv4_attention.py"), "--backend", "cuda", "--quick",
                             "--peer", f"flashmla={peer_library}", "--json",
                             str(work / "bench_dsv4_attention_flashmla.json")], 120))
    # -v and --failures-now: each outcome and each failure's traceback is in the log as it happens, so
    # a suite stopped by the budget still says why its tests failed.
    kernel_tests = Step("kernel tests cuda", [python, "-m", "pytest", "-v", "--failures-now", "-n", str(jobs), "-p",
                                              "no:cacheprovider", "--durations=30", "tests/kernels"], 600, cuda_tests)
    # memcheck (memory safety) before the benchmarks, racecheck after them, the whole suite last.
    return steps + sanitized[:1] + benches + sanitized[1:] + [kernel_tests]


def run_step(step: Step, log_dir: Path, left_s: float) -> None:
    """Run one step within its time limit and ``left_s``; record pass / fail / skipped (a missing
    optional tool) / not run (too little of the budget left)."""
    if step.optional and shutil.which(step.command[0]) is None:
        step.status, step.detail = "skipped", f"{step.command[0]} is not on PATH"
        return
    if left_s < 10:
        step.status, step.detail = "not run", "budget spent"
        return
    started = time.monotonic()
    log = log_dir / (step.name.replace(" ", "_").replace(",", "_").replace("(", "").replace(")", "") + ".log")
    limit_s = min(step.limit_s, int(left_s))
    with log.open("w") as sink:  # streamed: a step stopped at its limit leaves what it printed
        try:
            done = subprocess.run(step.command, cwd=REPO, env={**os.environ, **step.env}, stdout=sink,
                                  stderr=subprocess.STDOUT, timeout=limit_s)
            step.status = "pass" if done.returncode == 0 else "fail"
        except subprocess.TimeoutExpired:
            step.status = "fail"
    output = log.read_text(errors="replace")
    step.detail = " | ".join(output.strip().splitlines()[-3:])
    if step.status == "fail" and time.monotonic() - started >= limit_s:
        step.detail = f"over its {limit_s} s limit: {step.detail}"
    if step.optional and step.status == "fail" and "not supported" in output:
        step.status = "skipped"  # the sanitizer refuses this device: say so and go on
    step.seconds = round(time.monotonic() - started, 1)


#: Runs each benchmark given as an argument with ``--help`` as its ``__main__``, all in this one process
#: (torch and sparsekv imported once, not once per benchmark), and prints ``{name: help text}`` as JSON;
#: one that fails to load has an empty text (so it takes none of the flags).
_HELP_OF_EACH = """
import contextlib, io, json, pathlib, runpy, sys
helps = {}
for path in sys.argv[1:]:
    sys.argv, sys.path[0], out = [path, "--help"], str(pathlib.Path(path).parent), io.StringIO()  # as a script
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit, Exception):
        runpy.run_path(path, run_name="__main__")
    helps[pathlib.Path(path).name] = out.getvalue()
print(json.dumps(helps))
"""


def benchmark_help(benches: list[str]) -> dict[str, str]:
    """Each benchmark's ``--help`` text (empty where it printed none or failed to load), from one Python process."""
    done = subprocess.run([sys.executable, "-c", _HELP_OF_EACH, *(str(BENCH_DIR / b) for b in benches)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the benchmarks' --help failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def check_plumbing(steps: list[Step], wheels: Path) -> list[str]:
    """What a dry run can check without a GPU: named files, tests and flags exist. Returns the problems."""
    problems = [f"tests/kernels/test_{stem}.py marks {len(marked)} tests @{SANITIZER_MARK}; one per family"
                for stem in KERNEL_STEMS if len(marked := sanitizer_marked(stem)) != 1]
    names = [*GRAPH_CAPTURE_TESTS, *SANITIZER_CASES.values()]
    for node in names:
        path, _, test = node.partition("::")
        test = test.partition("[")[0]  # a parametrized case: its function
        if not (REPO / path).is_file():
            problems.append(f"{path} does not exist")
        elif f"def {test}(" not in (REPO / path).read_text():
            problems.append(f"{path} has no test {test}")
    present = [bench for bench in KERNEL_BENCHMARKS if (BENCH_DIR / bench).is_file()]
    problems += [f"{(BENCH_DIR / bench).relative_to(REPO)} does not exist" for bench in KERNEL_BENCHMARKS
                 if bench not in present]
    helps = benchmark_help(present)
    for bench in present:
        for flag in ("--backend", "--quick", "--json") + (("--peer",) if bench == "bench_dsv4_attention.py" else ()):
            if flag not in helps[bench]:
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
           "passed": all(s.status in ("pass", "skipped", "planned") for s in steps),
           "complete": all(s.status not in ("pending", "not run") for s in steps), "benchmarks": benches}
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [f"# sparsekv gpu-check on {device}", "", "| step | status | seconds | detail |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.seconds} | {s.detail.replace('|', '/')[:160]} |" for s in steps]
    doc["roofline"] = {name: roofline_rows(result) for name, result in benches.items()}
    (out / "summary.json").write_text(json.dumps(doc, indent=2) + "\n")
    for name, rows in doc["roofline"].items():
        lines += ["", f"## bench {name}: measured device time against the roofline", "",
                  "| case | device us | eager us | roofline us (GPU) | measured / roofline | timed as |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['case']} | {_us(r['device_us'])} | {_us(r['eager_us'])} | {_us(r['roofline_us'])} "
                  f"({r['roofline_gpu'] or 'H200, on paper'}) | {r['measured_over_roofline'] or '-'} | "
                  f"{r['method'] or '-'} |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return doc


def _us(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def roofline_rows(result: dict) -> list[dict]:
    """Each row of a benchmark's JSON that carries a roofline (``sparsekv.testing.roofline.fields``):
    its case, the kernel's device time and eager latency (``kernel_us`` / ``kernel_eager_us``, or
    ``kernel_ms``), how it was timed, the roofline of the GPU it ran on (the H200's when the GPU is
    not one the model knows) and ``measured_over_roofline``."""
    rows = []
    for row in result.get("rows", []):
        if "h200_roofline_us" not in row:
            continue
        device_us = row.get("kernel_us", row["kernel_ms"] * 1e3 if "kernel_ms" in row else None)
        gpu = row.get("roofline_gpu")
        rows.append({"case": str(row.get("case", "?")), "device_us": device_us, "eager_us": row.get("kernel_eager_us"),
                     "method": row.get("kernel_method"), "roofline_gpu": gpu,
                     "roofline_us": row[f"{gpu.lower()}_roofline_us" if gpu else "h200_roofline_us"],
                     "measured_over_roofline": row.get("measured_over_roofline")})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = CliParser(prog="tools/gpu_check.py", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__[__doc__.index("The wheel folder"):])
    parser.add_argument("--out", type=Path, default=REPO / "gpu-check", help="where the summaries go")
    parser.add_argument("--wheels", type=Path, default=REPO / "wheels", help="folder of the apache-tvm-ffi wheel")
    parser.add_argument("--python", default=sys.executable, help="the image's Python (default: this one)")
    parser.add_argument("--jobs", type=int_range(1), default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                        help="compile jobs and pytest-xdist workers (default: the cores less two, at most 12)")
    parser.add_argument("--budget-s", type=number_range(10), default=420,
                        help="the whole run's time budget, in seconds (at least 10)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and check the plumbing, no GPU")
    args = parser.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot create the folder ({exc.strerror})")
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))  # logs and benchmark JSON; tarred into --out
    steps = plan(args.python, args.wheels, work, args.jobs)
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
    deadline = time.monotonic() + args.budget_s
    device = "unknown"
    for step in steps:
        run_step(step, work, deadline - time.monotonic())
        print(f"{step.status:8s} {step.seconds:6.1f} s  {step.name}  {step.detail[:100]}", flush=True)
        if step.name == "probe" and step.status == "pass":
            device = step.detail.split(" | ")[0]
        if step.name.startswith("install") and step.status != "pass":
            break  # nothing after it can run
        write_summary(steps, args.out, device)
        with tarfile.open(args.out / "logs.tar.gz", "w:gz") as logs:
            logs.add(work, arcname="gpu-check")
    doc = write_summary(steps, args.out, device)
    print(f"summary: {args.out / 'summary.md'}")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The one sweep helper every benchmark in ``tools/`` uses: time callables, print JSON, draw a PNG.

A benchmark builds a list of cases (shown with a tqdm progress bar); each case times its candidates
(our kernel, the raw module call, the baseline measured in the same run) with :func:`time_call` on
the host, or :func:`time_cuda` (CUDA events, never host clocks) for the cuda backend; :func:`report`
prints one JSON document and optionally plots it.

Every document says how to reproduce its figures: the threads each side used (``threads``, which
the benchmark must fill: a figure of 1 thread against 2 is not a kernel speedup) and the run's
environment (the command line, the torch build, its thread settings, the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from sparsekv.argtypes import output_path


@dataclass
class Timing:
    """Robust timing of one callable: median and min over repeats, in seconds per call."""

    median_s: float
    min_s: float
    repeats: int
    #: GPU timings only: one eager call's latency from an idle GPU (median), and how ``median_s`` was
    #: taken (a CUDA-graph replay or a loop of calls): see :func:`time_cuda`.
    eager_s: float | None = None
    method: str | None = None


def time_call(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1, min_time_s: float = 0.05,
              clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Time ``fn()``: warm up, then ``repeats`` samples, each looping until ``min_time_s`` elapsed on ``clock``
    (``time.process_time`` for host-only work on a shared machine: the time other processes take the
    core is not counted)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        loops, start = 0, clock()
        while True:
            fn()
            loops += 1
            elapsed = clock() - start
            if elapsed >= min_time_s:
                break
        samples.append(elapsed / loops)
    return Timing(median_s=statistics.median(samples), min_s=min(samples), repeats=repeats)


@dataclass
class BenchResult:
    """One benchmark's output: what ran, on what, and one row per case."""

    name: str
    baseline: str
    rows: list[dict] = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    #: The threads each side ran on, e.g. ``{"ours": 1, "baseline": 2}`` (required by :func:`report`).
    threads: dict = field(default_factory=dict)
    #: Filled by :func:`report`: see :func:`environment`.
    environment: dict = field(default_factory=dict)


def environment() -> dict:
    """What a figure needs to be reproduced: the command, the torch build and its threads, the cores."""
    import torch

    info = torch.__config__.parallel_info().splitlines()
    parallel = next((line.split(":", 1)[1].strip() for line in info if line.startswith("ATen parallel backend")), None)
    return {
        "command": shlex.join([os.path.relpath(sys.argv[0]) if sys.argv[0] else "python", *sys.argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_cuda": torch.version.cuda,
        "torch_parallel_backend": parallel,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "machine": platform.machine(),
    }


#: The most calls one CUDA graph of a timed sample holds, and the calls of a sample timed as a loop.
GRAPH_CALLS = 100
#: About how long one replayed sample lasts: a graph holds this long's calls (3 to :data:`GRAPH_CALLS`).
SAMPLE_S = 0.02


def time_cuda(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1, min_time_s: float = 0.0) -> Timing:
    """Device time of ``fn()`` on the current CUDA stream, and separately one eager call's latency.

    ``median_s`` / ``min_s`` are per call, over ``repeats`` samples, each a replay of one CUDA graph
    holding about :data:`SAMPLE_S` (or ``min_time_s``, if longer) of calls (3 to :data:`GRAPH_CALLS`),
    timed with CUDA events: the kernels back to back, no host work between them. A call that cannot
    be captured (it syncs, or copies from pageable host memory) is timed as a loop of
    :data:`GRAPH_CALLS` eager calls instead; :attr:`Timing.method` says which. ``eager_s`` is the
    median latency of one call from an idle GPU (synchronized before it), the host's wrapper
    included. The inputs stay in L2 between calls where they fit in it.
    """
    import torch

    for _ in range(max(warmup, 1)):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) / 1e3)
    calls = min(GRAPH_CALLS, max(3, round(max(SAMPLE_S, min_time_s) / max(statistics.median(eager), 1e-7))))
    run, method, calls = _captured(fn, calls)
    run()  # warm: the first replay uploads the graph
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return Timing(median_s=statistics.median(samples), min_s=min(samples), repeats=repeats,
                  eager_s=statistics.median(eager), method=method)


def _captured(fn: Callable[[], object], calls: int) -> tuple[Callable[[], object], str, int]:
    """``(run, method, calls)``: ``run()`` replays a CUDA graph of ``calls`` calls of ``fn``, or, when
    ``fn`` cannot be captured, makes :data:`GRAPH_CALLS` calls one by one."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # torch's recipe: a warm-up call on a side stream before capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as error:  # noqa: BLE001 - whatever refused the capture, time the calls eagerly
        torch.cuda.synchronize()
        reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__

        def loop() -> None:
            for _ in range(GRAPH_CALLS):
                fn()

        return loop, f"loop of {GRAPH_CALLS} eager calls (not capturable: {reason})", GRAPH_CALLS
    return graph.replay, f"CUDA-graph replay of {calls} calls", calls


def timer(backend: str) -> Callable[..., Timing]:
    """:func:`time_call` for the cpu backend, :func:`time_cuda` for the cuda backend."""
    return time_cuda if backend == "cuda" else time_call


#: The most entries (rows, tokens) a Triton column runs under the interpreter (tens of ms each there).
INTERPRETED_ROWS = 64
#: ``notes.triton_timing`` of a sweep with a Triton column (:func:`triton_timer`).
TRITON_TIMING = (f"cpu backend: the Triton interpreter, NOT speed (numpy per program op), one sample, cases up to "
                 f"{INTERPRETED_ROWS} rows; cuda backend: CUDA events")


def triton_timer(backend: str, repeats: int) -> Callable[..., Timing]:
    """The timer of a Triton twin's column: :func:`time_cuda` on the cuda backend; on the cpu backend
    the Triton interpreter (turned on here, before triton is imported), one sample, which is not speed."""
    if backend == "cuda":
        return lambda fn: time_cuda(fn, repeats=repeats)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return lambda fn: time_call(fn, repeats=1, warmup=0, min_time_s=0.0)


#: ``notes.timer`` of a cuda run: what its kernel figures are (see :func:`time_cuda`).
CUDA_TIMER = (f"device time per call: CUDA events around a CUDA-graph replay of up to {GRAPH_CALLS} calls (a loop of "
              f"{GRAPH_CALLS} eager calls where a call cannot be captured: each row's *_method says which); "
              f"*_eager_us: one eager call from an idle GPU, the Python wrapper included")


def backend_notes(backend: str, **notes) -> dict:
    """``BenchResult.notes`` saying the backend and its timer, with ``notes`` added."""
    return {"backend": backend, "timer": CUDA_TIMER if backend == "cuda" else "perf_counter", **notes}


def timing_fields(name: str, timing: Timing) -> dict:
    """A row's columns of one timed candidate: ``{name}_us``, and on a GPU ``{name}_eager_us`` and
    ``{name}_method``."""
    row = {f"{name}_us": timing.median_s * 1e6}
    if timing.eager_s is not None:
        row[f"{name}_eager_us"] = timing.eager_s * 1e6
        row[f"{name}_method"] = timing.method
    return row


def device_name(backend: str) -> str:
    """The device a benchmark's kernels run on: the GPU's name on the cuda backend, else ``"cpu"``."""
    if backend != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` (also write the JSON to a file), ``--plot PNG``, ``--quick`` (fewer cases).

    Both paths are checked at parse time (a writable file in an existing folder), not after the run."""
    parser.add_argument("--json", dest="json_path", type=output_path, help="also write the JSON result to this file")
    parser.add_argument("--plot", type=output_path, help="draw a PNG plot to this path")
    parser.add_argument("--quick", action="store_true", help="a short sweep (smaller cases, fewer repeats)")


#: The calls through which a benchmark script takes ``--backend`` (each ends in :func:`add_backend_arg`).
BACKEND_OPENINGS = ("add_backend_arg(", "bench_args(", "open_sweep(", "kernel_sweep(")


def takes_backend(source: str) -> bool:
    """Whether a benchmark script (its source text) takes ``--backend``: it calls one of
    :data:`BACKEND_OPENINGS`."""
    return any(call in source for call in BACKEND_OPENINGS)


def add_backend_arg(parser: argparse.ArgumentParser) -> None:
    """``--backend {cpu,cuda}``: which build of the kernels a benchmark runs (default cpu); ``cuda``
    without a visible GPU is a usage error at parse time."""
    parser.add_argument("--backend", type=_backend, default="cpu",
                        help="kernel backend: cpu or cuda (tensors on the GPU, timed with CUDA events)")


def _backend(text: str) -> str:
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    import torch

    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: torch sees no CUDA device here (run on a GPU machine, or use cpu)")
    return text


def report(result: BenchResult, args: argparse.Namespace,
           plot: Callable[[BenchResult, str], None] | None = None) -> None:
    """Print ``result`` as JSON on stdout (with its :func:`environment`); write it and the plot where asked.

    Raises
    ------
    ValueError
        ``result.threads`` does not say the threads of both sides (``ours`` and ``baseline``).
    """
    missing = {"ours", "baseline"} - set(result.threads)
    if missing:
        raise ValueError(f"{result.name}: BenchResult.threads must say the threads of each side; "
                         f"missing {sorted(missing)}")
    result.environment = environment()
    text = json.dumps(asdict(result), indent=2)
    print(text)
    if getattr(args, "json_path", None):
        with open(args.json_path, "w") as f:
            f.write(text + "\n")
    if getattr(args, "plot", None) and plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        plot(result, args.plot)


def bar_plot(result: BenchResult, path: str, *, label_key: str, value_keys: Iterable[str], ylabel: str,
             log: bool = False) -> None:
    """A grouped bar chart of ``value_keys`` per case (labelled by ``label_key``)."""
    import matplotlib.pyplot as plt

    keys = list(value_keys)
    labels = [str(r[label_key]) for r in result.rows]
    width = 0.8 / max(len(keys), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    for k, key in enumerate(keys):
        xs = [i + k * width for i in range(len(labels))]
        ax.bar(xs, [r.get(key, 0) for r in result.rows], width=width, label=key)
    ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(labels))], labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(textwrap.fill(f"{result.name} (baseline: {result.baseline})", 70), fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse the command line of a kernel benchmark: ``parser``'s own options, :func:`add_common_args`
    and :func:`add_backend_arg`."""
    add_common_args(parser)
    add_backend_arg(parser)
    return parser.parse_args()


@dataclass
class Sweep:
    """An open benchmark run: its parsed arguments, the :class:`BenchResult` its rows go into, how many
    repeats each timing takes, and the stem its progress bar is named by (see :func:`open_sweep`)."""

    args: argparse.Namespace
    result: BenchResult
    repeats: int
    stem: str

    def cases(self, cases: Sequence, quick_cases: Sequence | None = None) -> Iterable:
        """``quick_cases`` with ``--quick`` (when given), else ``cases``, behind a ``bench_<stem>`` progress bar."""
        from tqdm import tqdm

        chosen = quick_cases if self.args.quick and quick_cases is not None else cases
        return tqdm(chosen, desc=f"bench_{self.stem}", unit="case", disable=None)  # None: terminals only

    def report(self, plot: Callable[[BenchResult, str], None] | None = None) -> None:
        """:func:`report` of this run."""
        report(self.result, self.args, plot)


def open_sweep(parser: argparse.ArgumentParser, *, stem: str, name: str, baseline: str, repeats: int = 7,
               quick_repeats: int = 3, one_thread: bool = False, ours_threads: int | None = 1,
               baseline_threads: object = None, notes: dict | None = None) -> Sweep:
    """The opening every kernel benchmark's ``main()`` shares: parse, threads, repeats, the result.

    ``parser`` (the script's own options) is read with :func:`bench_args`; ``one_thread`` sets torch
    to one thread first (compare like with like). The result is named ``"{name} ({backend} backend)"``
    (or ``name`` with ``{backend}`` filled in, when it holds that field); its threads say, for the cpu
    backend, ``ours_threads`` (None: torch's threads, for a kernel that splits its items over them)
    and ``baseline_threads`` (None: torch's threads), and ``"cuda"`` on the cuda backend unless
    ``baseline_threads`` is given (a baseline that runs on the host either way); its notes are
    :func:`backend_notes` with ``notes`` added. ``repeats`` (``quick_repeats`` with ``--quick``) is
    :attr:`Sweep.repeats`.
    """
    import torch

    args = bench_args(parser)
    if one_thread:
        torch.set_num_threads(1)
    on_cpu = args.backend == "cpu"
    torch_threads = torch.get_num_threads()
    title = name.format(backend=args.backend) if "{backend}" in name else f"{name} ({args.backend} backend)"
    threads = {"ours": (torch_threads if ours_threads is None else ours_threads) if on_cpu else "cuda",
               "baseline": baseline_threads if baseline_threads is not None else torch_threads if on_cpu else "cuda"}
    result = BenchResult(name=title, baseline=baseline, threads=threads,
                         notes=backend_notes(args.backend, **(notes or {})))
    return Sweep(args, result, quick_repeats if args.quick else repeats, stem)


def kernel_sweep(parser: argparse.ArgumentParser, *, name: str, baseline: str, cases: Sequence[tuple],
                 quick_cases: Sequence[tuple], run_case: Callable[..., dict], plot: dict,
                 notes: dict | None = None, one_thread: bool = False, threaded: bool = False) -> None:
    """The ``main()`` of a one-sweep kernel benchmark: :func:`open_sweep`, run every case, report.

    Each case (``quick_cases`` with ``--quick``) is ``run_case(*case, repeats, backend)`` (3 repeats
    with ``--quick``, else 7), one row of a :class:`BenchResult` named ``"{name} ({backend} backend)"``;
    the cpu backend runs on one thread, the torch baseline on torch's threads (``one_thread``: on one
    thread too, like with like; ``threaded``: the kernel splits its items over torch's threads, as
    many as the baseline's). The progress bar is ``bench_<stem>`` (the first word of ``name``); the
    plot is :func:`bar_plot` with ``plot`` as its keywords.
    """
    sweep = open_sweep(parser, stem=name.split()[0], name=name, baseline=baseline, one_thread=one_thread,
                       ours_threads=None if threaded else 1, notes=notes)
    for case in sweep.cases(cases, quick_cases):
        sweep.result.rows.append(run_case(*case, sweep.repeats, sweep.args.backend))
    sweep.report(lambda r, path: bar_plot(r, path, **plot))

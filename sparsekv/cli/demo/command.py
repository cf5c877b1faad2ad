"""``sparsekv demo``: plan, prefill, HiSparse backup, decode through every DSV4 kernel; three checks.

The model (:mod:`sparsekv.cli.demo.model`) has seeded random weights, so nothing is downloaded. The run:

1. plans memory for the model (``plan_pipeline``, what ``sparsekv plan-memory`` runs) and builds
   the ``DeepSeekV4TokenToKVPool`` from the plan;
2. loads every kernel the run uses (compiling the ones not yet in the JIT cache: timed apart);
3. prefills two requests: per layer the SWA KV, the C4 / C128 compressors, then the fused norm +
   RoPE + quantize + store, and the indexer keys; with HiSparse the C4 KV is backed up to the
   host pool and only a small hot buffer per request stays on the device;
4. decodes ``--steps`` tokens: compress the new token (fused store), indexer scores and top-k,
   swap-in of the selected C4 entries (HiSparse), sparse attention with the sink.

Checks (the exit code is 0 only if all hold):

* kernels vs fp64 torch: compressor entries, stored values, indexer scores and attention outputs
  against torch computations of the same steps (same selected slots, same cache bytes), each
  within its documented tolerance;
* HiSparse: attention outputs with the small hot buffer are bit for bit those of a run with every
  C4 entry resident;
* ``--pd``: prefill in one process, decode in another, the KV sent over NIXL on 127.0.0.1 straight
  into the decode's host pool; the decode's outputs are bit for bit the single-process ones.

``--save-traces DIR`` records what the HiSparse run's decode asked for (the all-resident run's
without HiSparse): per C4 layer, the top-k of every request at every step, written as
``DIR/demo_layer<L>.json`` in the trace format ``tools/hisparse_sim.py`` replays
(:mod:`sparsekv.testing.hisparse_traces`), with the swap-in kernel's hits and loads per step.
Recording reads the top-k back every step; without the flag nothing is read back.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from sparsekv.cli import UsageError

IMPLS = ("header", "triton")
BACKENDS = ("cpu", "cuda", "sim")


@dataclass(frozen=True)
class DemoSpec:
    """One demo run."""

    tokens: int = 2048
    steps: int = 32
    hisparse: int | None = 2
    pd: bool = False
    backend: str = "cpu"
    impl: str = "header"
    hot_buffer: int = 128  # deployment.DEMO_HOT_BUFFER: what `jit build --model demo` builds
    seed: int = 0

    def prompts(self) -> tuple[int, ...]:
        """Prompt lengths of the requests: ``tokens`` and about five eighths of it."""
        return (self.tokens, max(1, self.tokens * 5 // 8 + 3))

    @property
    def requests(self) -> int:
        """How many requests run: one per prompt (the PD processes read it from the spec they are given)."""
        return len(self.prompts())


@dataclass
class DemoReport:
    """Everything the demo measured (``traces``: the trace files written by ``--save-traces``)."""

    spec: dict
    plan: dict = field(default_factory=dict)
    kernels: dict = field(default_factory=dict)
    setup_s: float = 0.0
    prefill_s: float = 0.0
    steps: list[dict] = field(default_factory=list)
    errors: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)
    traces: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c["ok"] for c in self.checks.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sparsekv demo``."""
    parser.add_argument("--tokens", type=int, default=DemoSpec.tokens, metavar="N",
                        help="prompt length of the longer request (default: %(default)s; the other has ~5/8 of it)")
    parser.add_argument("--steps", type=int, default=DemoSpec.steps, metavar="S",
                        help="decode steps (default: %(default)s)")
    parser.add_argument("--hisparse", default=str(DemoSpec.hisparse), metavar="RATIO",
                        help="HiSparse host:device ratio of the C4 KV, or 'off' (default: %(default)s)")
    parser.add_argument("--pd", action="store_true",
                        help="also run prefill and decode in two processes over NIXL (the `pd` extra)")
    parser.add_argument("--impl", choices=IMPLS, default="header",
                        help="indexer and attention implementation: the CUDA/C++ headers or their Triton twins "
                             "(on the cpu backend under the Triton interpreter; slow) (default: header)")
    parser.add_argument("--backend", choices=BACKENDS, default="cpu", help="kernel backend (default: cpu)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot hit rate and bytes moved per step (matplotlib)")
    parser.add_argument("--save-traces", metavar="DIR",
                        help="write each C4 layer's decode top-k per request and step to DIR/demo_layer<L>.json, "
                             "the trace format tools/hisparse_sim.py replays")
    parser.add_argument("--json", metavar="FILE", help="write the full report as JSON ('-': stdout)")


def spec_from_args(args: argparse.Namespace) -> DemoSpec:
    """The :class:`DemoSpec` of the command line; :class:`UsageError` naming the flag otherwise."""
    if args.tokens < 16 or args.tokens > 65536:
        raise UsageError(f"--tokens must be in [16, 65536], got {args.tokens}")
    if args.steps < 1 or args.steps > 4096:
        raise UsageError(f"--steps must be in [1, 4096], got {args.steps}")
    if args.hisparse.lower() == "off":
        hisparse = None
    else:
        try:
            hisparse = int(args.hisparse)
        except ValueError:
            raise UsageError(f"--hisparse takes a host:device ratio (an integer >= 1) or 'off', got "
                             f"{args.hisparse!r}") from None
        if hisparse < 1:
            raise UsageError(f"--hisparse takes a host:device ratio >= 1 or 'off', got {hisparse}")
    if args.impl == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            raise UsageError("--impl triton needs triton installed (pip install triton); use --impl header")
    if args.backend == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--backend cuda needs a visible CUDA GPU; use --backend cpu")
    if args.pd and hisparse is None:
        raise UsageError("--pd sends the C4 KV straight into the decode's HiSparse host pool: give --hisparse RATIO")
    if args.pd:
        from sparsekv.srt.disaggregation.engines import load_engine

        try:
            load_engine("nixl")
        except ImportError as e:
            raise UsageError(f"--pd needs NIXL (`make install-pd`, or pip install --no-deps nixl-cu12 nixl): {e}"
                             ) from None
    if args.save_traces is not None and os.path.exists(args.save_traces) and not os.path.isdir(args.save_traces):
        raise UsageError(f"--save-traces takes a directory, {args.save_traces!r} is a file")
    return DemoSpec(tokens=args.tokens, steps=args.steps, hisparse=hisparse, pd=args.pd, backend=args.backend,
                    impl=args.impl)


def load_kernels(spec: DemoSpec, progress) -> dict:
    """Load (building where missing) every kernel instance the run uses (what ``sparsekv jit build
    --model demo`` prebuilds); what came from where."""
    from sparsekv.cli.demo.stack import PAGE_SIZE
    from sparsekv.jit_kernel.build import loader
    from sparsekv.jit_kernel.build.registry import discover
    from sparsekv.srt.model_executor.deployment import DEMO, model_instances

    families = discover()
    built, cached, build_s = [], [], 0.0
    instances = model_instances(DEMO, hot_buffer_size=spec.hot_buffer, page_size=PAGE_SIZE)
    for name, values in progress(instances, desc="kernels", unit="module"):
        family = families[name]
        before = len(loader.COMPILED)
        family.module(backend=spec.backend, **values)
        if len(loader.COMPILED) > before:
            built.append(family.describe(values))
            build_s += sum(seconds for _, seconds in loader.COMPILED[before:])
        else:
            cached.append(family.describe(values))
    return {"built": built, "cached": cached, "build_s": build_s}


def run_single(spec: DemoSpec, progress, *, hisparse: int | None, check: bool, record: bool = False):
    """One process: prefill both requests, (HiSparse) back them up, decode; ``(stack, outputs, stats, prefill_s)``
    (``record``: the stack's ``recorders`` hold every C4 layer's top-k trace)."""
    from sparsekv.cli.demo.model import DemoModel, ModelShape
    from sparsekv.cli.demo.stack import Request, Stack

    model = DemoModel(ModelShape(), spec.seed)
    prompts = spec.prompts()
    stack = Stack(model, tokens=max(prompts) + spec.steps, requests=spec.requests, hisparse=hisparse,
                  hot_buffer=spec.hot_buffer, device="cuda" if spec.backend == "cuda" else "cpu", check=check,
                  impl=spec.impl, trace_source={"kind": "sparsekv demo", "demo": asdict(spec)} if record else None)
    reqs = [Request(i + 1, 0) for i in range(spec.requests)]
    start = time.perf_counter()
    for req, n in zip(reqs, prompts):
        stack.prefill(req, n)
    if hisparse is not None:
        stack.back_up(reqs)
    prefill_s = time.perf_counter() - start
    outputs, stats = [], []
    label = "decode" + (" (HiSparse)" if hisparse is not None else " (all resident)")
    for _ in progress(range(spec.steps), desc=label, unit="step"):
        out, step = stack.decode_step(reqs)
        outputs.append([o.cpu() for o in out])
        stats.append(step)
    return stack, outputs, stats, prefill_s


def same_outputs(a, b) -> tuple[bool, float]:
    """Bit-equal attention outputs, and the largest difference."""
    import torch

    worst = max(float((x - y).abs().max()) for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    equal = len(a) == len(b) and all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    return equal, worst


def save_traces(stack, directory: str) -> list[str]:
    """Write the stack's recorded traces, one file per C4 layer; their paths."""
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for layer, recorder in stack.recorders.items():
        path = out / f"demo_layer{layer}.json"
        recorder.trace().save(path)
        paths.append(str(path))
    return paths


def run_demo(spec: DemoSpec, progress=None, *, traces_dir: str | None = None) -> DemoReport:
    """Run the demo (see the module docstring) and return its report; nothing printed but progress.
    ``traces_dir``: record the decode's top-k there (``--save-traces``)."""
    from sparsekv.cli.demo.stack import ATTENTION_TOL, COMPRESS_TOL, INDEXER_TOL, STORE_REL_TOL

    if progress is None:
        def progress(items, **_):
            return items

    report = DemoReport(spec=asdict(spec))
    start = time.perf_counter()
    report.kernels = load_kernels(spec, progress)
    report.setup_s = time.perf_counter() - start
    record = traces_dir is not None
    resident, resident_out, _, prefill_s = run_single(spec, progress, hisparse=None, check=True,
                                                      record=record and spec.hisparse is None)
    if record and spec.hisparse is None:
        report.traces = save_traces(resident, traces_dir)
    report.plan = {"budget_bytes": resident.budget, "full_tokens": resident.config.full_max_total_num_tokens,
                   "swa_tokens": resident.config.swa_max_total_num_tokens,
                   "c4_tokens": resident.config.c4_max_total_num_tokens,
                   "c128_tokens": resident.config.c128_max_total_num_tokens,
                   "pool_bytes": sum(resident.pool.component_nbytes().values())}
    errors = resident.errors
    report.prefill_s = prefill_s
    report.checks["kernels_vs_fp64"] = {
        "ok": errors.ok, "compress": errors.compress, "store": errors.store, "indexer": errors.indexer,
        "attention": errors.attention, "attention_abs": errors.attention_abs,
        "tolerances": {"compress": COMPRESS_TOL, "store_rel": STORE_REL_TOL, "indexer": INDEXER_TOL,
                       "attention": ATTENTION_TOL[spec.impl]}}
    steps = None
    if spec.hisparse is not None:
        hot, hot_out, steps, prefill_s = run_single(spec, progress, hisparse=spec.hisparse, check=False,
                                                    record=record)
        if record:
            report.traces = save_traces(hot, traces_dir)
        equal, worst = same_outputs(resident_out, hot_out)
        report.prefill_s = prefill_s
        report.checks["hisparse_equals_resident"] = {"ok": equal, "max_abs_diff": worst,
                                                     "hot_buffer": spec.hot_buffer, "ratio": spec.hisparse}
        report.plan["hisparse_host_entries"] = hot.coordinator.mem_pool_host.size
    if spec.pd:
        from sparsekv.cli.demo.pd import run_pd

        pd_out = run_pd(spec)
        equal, worst = same_outputs(resident_out, pd_out["outputs"])
        report.checks["pd_equals_single_process"] = {"ok": equal and pd_out["transfer_ok"], "max_abs_diff": worst,
                                                     "bytes_sent": pd_out["bytes"], "transfer": pd_out["transfer"]}
    for i, step in enumerate(steps or []):
        total = step.hits + step.misses
        report.steps.append({"step": i, "hits": step.hits, "misses": step.misses,
                             "hit_rate": step.hits / total if total else 1.0, "bytes_h2d": step.bytes_h2d,
                             "seconds": step.seconds})
    return report


# ---- output --------------------------------------------------------------------------------------


def render(report: DemoReport) -> str:
    """The final table and the three checks, as printed."""
    spec, plan, k = report.spec, report.plan, report.kernels
    steps = report.steps
    hits = sum(s["hits"] for s in steps)
    total = hits + sum(s["misses"] for s in steps)
    per_step = sorted(s["seconds"] for s in steps)
    e = report.checks["kernels_vs_fp64"]
    rows = [
        ("model", "4 layers (ratios 0, 4, 128, 4), 8 heads x 512, window 128, indexer 4 x 128, top-k 64"),
        ("plan", f"{plan['budget_bytes'] / 2**20:.0f} MiB budget -> {plan['full_tokens']:,} full / "
                 f"{plan['swa_tokens']:,} SWA / {plan['c4_tokens']:,} C4 / {plan['c128_tokens']:,} C128 tokens"),
        ("kernels", f"{len(k['built'])} built in {k['build_s']:.1f} s, {len(k['cached'])} from the JIT cache "
                    f"(setup {report.setup_s:.1f} s)"),
        ("tokens", f"{' + '.join(str(n) for n in DemoSpec(**spec).prompts())} prompt, "
                   f"prefill {report.prefill_s:.2f} s"),
        ("steps", f"{spec['steps']} decode steps x {DemoSpec(**spec).requests} requests"),
    ]
    if steps:
        rows += [
            ("hot-buffer hit rate", f"{hits / total:.3f} ({hits:,} hits, {total - hits:,} misses; hot buffer "
                                    f"{spec['hot_buffer']} per request and C4 layer)"),
            ("bytes host -> device", f"{sum(s['bytes_h2d'] for s in steps):,} "
                                     f"({sum(s['bytes_h2d'] for s in steps) / len(steps):,.0f} per step)"),
            ("time per step", f"median {per_step[len(per_step) // 2] * 1e3:.1f} ms (HiSparse run, {spec['backend']})"),
        ]
    rows += [
        ("max error / tolerance", f"compress {e['compress']:.3f}, store {e['store']:.3f}, indexer "
                                  f"{e['indexer']:.3f}, attention {e['attention']:.3f} "
                                  f"(attention |out - fp64| max {e['attention_abs']:.1e})"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append(f"{'':<{width}}  (each kernel's worst |error| against fp64 torch over its documented bound: "
                 f"1.0 is at the bound, below 1 passes)")
    lines.append("")
    names = {"kernels_vs_fp64": "kernels vs fp64 torch, within each documented tolerance",
             "hisparse_equals_resident": "HiSparse (small hot buffer) outputs == all-resident outputs, bit for bit",
             "pd_equals_single_process": "PD over NIXL (prefill and decode processes) == single process, bit for bit"}
    for key, check in report.checks.items():
        lines.append(f"check: {names[key]}: {'OK' if check['ok'] else 'FAILED'}")
    return "\n".join(lines)


def plot(report: DemoReport, path: str) -> None:
    """PNG of the hot-buffer hit rate and the bytes moved host -> device per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in report.steps]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [s["hit_rate"] for s in report.steps], color="tab:blue", label="hit rate")
    ax.set_xlabel("decode step")
    ax.set_ylabel("hot-buffer hit rate", color="tab:blue")
    ax.set_ylim(0, 1.02)
    ax2 = ax.twinx()
    ax2.bar(steps, [s["bytes_h2d"] / 1024 for s in report.steps], color="tab:orange", alpha=0.4)
    ax2.set_ylabel("KiB host -> device", color="tab:orange")
    ax.set_title(f"sparsekv demo: HiSparse C4 swap-in ({report.spec['tokens']} tokens, hot buffer "
                 f"{report.spec['hot_buffer']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 only if every check holds."""
    import torch
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    spec = spec_from_args(args)
    if spec.impl == "triton" and spec.backend != "cuda":
        # Triton on CPU tensors is its interpreter, chosen before triton is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if spec.backend == "sim":
        # sim runs on CPU tensors: every kernel call on them (the PD processes inherit it) takes the
        # sim build of the kernels' CUDA path. Slow: use a few tokens and steps.
        os.environ["SPARSEKV_CPU_BACKEND"] = "sim"
    # The demo's matrices are small: torch's thread pool costs more than it saves (and much more on
    # a machine whose cores are busy).
    torch.set_num_threads(1)

    def progress(items, **kwargs):
        return tqdm(items, leave=False, dynamic_ncols=True, disable=None, **kwargs)  # None: terminals only

    with logging_redirect_tqdm(loggers=[logging.getLogger("sparsekv")]):
        report = run_demo(spec, progress, traces_dir=args.save_traces)
    print(render(report))
    if report.traces:
        print(f"traces: {', '.join(report.traces)}")
    if args.plot and report.steps:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        text = json.dumps(asdict(report) | {"ok": report.ok}, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if report.ok else 1

"""Benchmark the JIT loader: cold builds, warm loads (fresh process and in-process) against
tvm-ffi's own ``tvm_ffi.cpp.load`` on the same source, which runs ninja on every call; and the
operator's paths: a never-seen instance in an empty cache (compiler probe included),
``sparsekv jit build --model`` with the memory-aware parallelism against one job, and importing a
bundle of those modules against building them.

Prints JSON (``sparsekv.testing.bench``); ``--plot PNG`` draws the warm-path latencies.
Targets: in-process warm call < 50 us, fresh-process warm load < 2 ms (excluding the interpreter
and torch import), >= 5x faster than the tvm-ffi path.

Example: ``python tools/bench/bench_jit_loader.py --quick --plot jit.png``
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import tvm_ffi.cpp
from tqdm import tqdm

from sparsekv.argtypes import int_range
from sparsekv.cli import CliParser
from sparsekv.jit_kernel.build import cache, loader
from sparsekv.jit_kernel.gather_rows import GATHER_ROWS
from sparsekv.testing.bench import BenchResult, add_common_args, bar_plot, report, time_call

FRESH_PROCESS = textwrap.dedent("""
    import time, torch
    from sparsekv.jit_kernel.gather_rows import GATHER_ROWS
    start = time.perf_counter()
    GATHER_ROWS.module(index_dtype=torch.int64, backend={backend!r}, arch={arch!r})
    print((time.perf_counter() - start) * 1e6)
""")


def cold_build_s(backend: str, arch: str | None) -> float:
    roots = cache.open_roots()
    plan = loader.make_plan(GATHER_ROWS.name, ("int64_t",), header=GATHER_ROWS.header, exports=GATHER_ROWS.exports,
                            kernels=GATHER_ROWS.kernels, backend=backend, arch=arch, probe_dir=None)
    shutil.rmtree(roots.write / plan.entry_name(), ignore_errors=True)
    start = time.perf_counter()
    loader.find_or_build(plan, roots)
    return time.perf_counter() - start


def fresh_process_warm_us(backend: str, arch: str | None, runs: int) -> float:
    samples = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", FRESH_PROCESS.format(backend=backend, arch=arch)],
                             capture_output=True, text=True, check=True).stdout
        samples.append(float(out.strip().splitlines()[-1]))
    return statistics.median(samples)


def tvm_ffi_load_us(build_dir: Path, source: Path) -> float:
    csrc = loader.csrc_root()
    kwargs = dict(sources=[str(source)], extra_include_paths=[str(csrc), str(csrc / "include")],
                  extra_cflags=['-DSPARSEKV_MODULE_KEY=\\"gather_rows_tvm_ffi\\"'], build_directory=str(build_dir))
    tvm_ffi.cpp.load("gather_rows_tvm_ffi", **kwargs)  # cold build, not timed here
    timing = time_call(lambda: tvm_ffi.cpp.load("gather_rows_tvm_ffi", **kwargs), repeats=5, min_time_s=0.02)
    return timing.median_s * 1e6


def cold_new_instance_s(backend: str, arch: str | None) -> float:
    """A module no cache has seen (a unique flag), in an empty cache: compiler probe, key, compile, publish."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, SPARSEKV_CACHE_DIR=tmp, SPARSEKV_EXTRA_CFLAGS=f"-DSPARSEKV_BENCH_{os.getpid()}=1")
        script = FRESH_PROCESS.format(backend=backend, arch=arch)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
        return float(out.stdout.strip().splitlines()[-1]) / 1e6


def _jit(args: list[str], cache_dir: str) -> dict:
    env = dict(os.environ, SPARSEKV_CACHE_DIR=cache_dir)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "sparsekv", "jit", *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"bench_jit_loader: `sparsekv jit {' '.join(args)}` failed: {out.stderr.strip()}")
    wall = time.perf_counter() - start
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        doc = {}
    return dict(doc if isinstance(doc, dict) else {}, wall_s=wall)


def model_build_rows(selection: list[str]) -> dict:
    """``jit build`` of ``selection`` in empty caches: one job, then the memory-aware default; then the
    same modules exported and imported into an empty cache."""
    with tempfile.TemporaryDirectory() as tmp:
        one = _jit(["build", *selection, "--jobs", "1", "--json"], f"{tmp}/one")
        auto = _jit(["build", *selection, "--json"], f"{tmp}/auto")
        export_args = ["--all"] if selection[0] != "--model" else selection
        _jit(["export", f"{tmp}/bundle.tar", *export_args], f"{tmp}/auto")
        imported = _jit(["import", f"{tmp}/bundle.tar", "--json"], f"{tmp}/imported")
    return {"modules": auto.get("built"), "one_job_s": round(one["wall_s"], 2),
            "parallel_jobs": auto.get("jobs"), "parallel_s": round(auto["wall_s"], 2),
            "speedup_parallel_vs_one_job": round(one["wall_s"] / auto["wall_s"], 2),
            "bundle_import_s": round(imported["wall_s"], 2),
            "speedup_import_vs_build": round(auto["wall_s"] / imported["wall_s"], 1)}


def main() -> None:
    parser = CliParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--fresh-runs", type=int_range(1), default=5)
    parser.add_argument("--model", default="dsv4-flash", choices=("dsv4-flash", "dsv4-pro"),
                        help="model whose serving instances `jit build --model` builds (with --quick: gather_rows)")
    args = parser.parse_args()
    has_nvcc = shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")
    backends = [("cpu", None)] + ([("cuda", "9.0a")] if has_nvcc else [])
    result = BenchResult(name="bench_jit_loader", baseline="tvm_ffi.cpp.load on the same source (ninja every call)",
                         threads={"ours": "one compiler process per build",
                                  "baseline": "one compiler process per build"})
    for backend, arch in tqdm(backends, desc="bench_jit_loader: cold build + warm loads", unit="backend", disable=None):
        cold = cold_build_s(backend, arch)
        GATHER_ROWS.module(index_dtype=torch.int64, backend=backend, arch=arch)
        in_process = time_call(lambda b=backend, a=arch: GATHER_ROWS.module(index_dtype=torch.int64, backend=b, arch=a))
        fresh = fresh_process_warm_us(backend, arch, 2 if args.quick else args.fresh_runs)
        result.rows.append({"backend": backend, "arch": arch, "cold_build_s": round(cold, 3),
                            "cold_new_instance_s": round(cold_new_instance_s(backend, arch), 3),
                            "warm_in_process_us": round(in_process.median_s * 1e6, 3),
                            "warm_fresh_process_us": round(fresh, 1)})
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "module.cpp"
        source.write_text(loader.generate_sources(GATHER_ROWS.header, GATHER_ROWS.exports, GATHER_ROWS.kernels,
                                                  ("int64_t",), "cpu")["module.cpp"])
        baseline_us = tvm_ffi_load_us(Path(tmp) / "build", source)
    selection = ["gather_rows"] if args.quick else ["--model", args.model]
    model = model_build_rows(selection)
    cpu = result.rows[0]
    result.notes = {
        "tvm_ffi_cpp_load_warm_us": round(baseline_us, 1),
        "speedup_fresh_process_vs_tvm_ffi": round(baseline_us / cpu["warm_fresh_process_us"], 1),
        "speedup_in_process_vs_tvm_ffi": round(baseline_us / cpu["warm_in_process_us"], 1),
        "targets": {"warm_in_process_us": 50, "warm_fresh_process_us": 2000, "speedup": 5},
        "jit_build": dict(model, selection=" ".join(selection)),
    }
    report(result, args, lambda r, path: bar_plot(r, path, label_key="backend", log=True, ylabel="microseconds",
                                                  value_keys=["warm_in_process_us", "warm_fresh_process_us"]))


if __name__ == "__main__":
    main()

"""``sparsekv bench``: one small benchmark run through the command, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from sparsekv.cli.bench import RATIO_DIRECTION, available, kernel_family_stems, selected, table

REPO = Path(__file__).resolve().parent.parent


def test_bench_one_name_writes_results_json_plot_and_a_ratio_table(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "sparsekv", "bench", "gather_rows", "--quick", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads((out / "results.json").read_text())
    entry = document["benchmarks"]["gather_rows"]
    assert entry["returncode"] == 0 and document["quick"] and document["backend"] == "cpu"
    rows = entry["result"]["rows"]
    assert rows and entry["result"]["threads"] == {"ours": 1, "baseline": entry["result"]["environment"]
                                                   ["torch_threads"]}
    # The ratio is the same-run baseline's time over the kernel's, and the table summarizes those rows.
    for row in rows:
        assert abs(row["kernel_vs_torch"] - row["torch_us"] / row["kernel_us"]) < 1e-9 * row["kernel_vs_torch"]
    values = [row["kernel_vs_torch"] for row in rows]
    summary = entry["ratios"]["kernel_vs_torch"]
    assert (summary["min"], summary["max"], summary["cases"]) == (min(values), max(values), len(values))
    table_row = next(line for line in done.stdout.splitlines() if "kernel_vs_torch" in line)
    assert table_row.split()[0] == "gather_rows" and f"{summary['median']:.3g}" in table_row.split()
    assert (out / entry["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "bench_gather_rows.json").exists()  # folded into results.json


def test_all_means_every_kernel_family_benchmark():
    families = kernel_family_stems()
    chosen = selected("all")
    assert set(chosen) == families  # every family has its benchmark by stem, and "all" is exactly those
    assert set(available()) - set(chosen) == {stem for stem in available() if stem not in families}


def test_bench_runs_from_an_installed_wheel_outside_a_checkout(tmp_path):
    # Outside a checkout the command runs the copies under sparsekv/benchmarks/ (setup.py maps tools/bench).
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("sparsekv-*.whl")
    shipped = {Path(name).name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("sparsekv/benchmarks/")}
    assert shipped == {p.name for p in (REPO / "tools" / "bench").glob("bench_*.py")}
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # The wheel's sparsekv comes first on the path (the editable install's finder only answers after it).
    done = subprocess.run([sys.executable, "-m", "sparsekv", "bench", "gather_rows", "--quick", "--out", "out"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(site)))
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads((tmp_path / "out" / "results.json").read_text())
    assert Path(document["folder"]) == site / "sparsekv" / "benchmarks"
    assert document["benchmarks"]["gather_rows"]["ratios"]["kernel_vs_torch"]["cases"] == 2


def test_the_table_says_which_way_each_ratio_points():
    summary = {"median": 2.0, "min": 1.0, "max": 3.0, "cases": 2}
    text = table({"hisparse_copy": {"ratios": {"kernel_vs_torch": summary, "kernel_vs_memcpy": summary}},
                  "dsv4_compress": {"ratios": {"speedup": summary}}})
    lines = text.splitlines()
    assert lines[0] == RATIO_DIRECTION and "above 1, ours is faster" in lines[0]
    reads = {line.split()[1]: line for line in lines[2:]}
    assert "> 1: faster than torch" in reads["kernel_vs_torch"]
    assert "share of memcpy bandwidth" in reads["kernel_vs_memcpy"]
    assert "> 1: faster than baseline" in reads["speedup"]

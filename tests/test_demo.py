"""``sparsekv demo`` at a tiny size: its checks hold, and the numbers it reports are consistent.

Two requests (640 and 403 tokens: 160 and 100 C4 entries) against a hot buffer of 128 slots, so the
longer one misses and the swap-in moves bytes; six decode steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparsekv.cli import main
from sparsekv.kv_layout import V4
from sparsekv.srt.managers import HiSparseCoordinator
from sparsekv.testing.components import needs_engine
from sparsekv.testing.hisparse_traces import Trace, replay

TINY = ["--tokens", "640", "--steps", "6"]


def run_demo(tmp_path, *extra):
    out = tmp_path / "demo.json"
    code = main(["demo", *TINY, "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_tiny_demo_checks_hold_and_its_swap_in_numbers_add_up(tmp_path, monkeypatch, capsys):
    reads = []
    read_counters = HiSparseCoordinator.read_counters
    monkeypatch.setattr(HiSparseCoordinator, "read_counters", lambda self, **kw: reads.append(kw) or read_counters(
        self, **kw))
    code, report = run_demo(tmp_path, "--plot", str(tmp_path / "demo.png"))
    assert code == 0 and report["ok"] and report["traces"] == []
    printed = capsys.readouterr()
    # The error column says what it means, and no progress bar is drawn off a terminal.
    assert "over its documented bound: 1.0 is at the bound" in printed.out
    assert "\r" not in printed.out + printed.err
    # Not recording traces, the counters are read once per step (and once after the backup): the
    # recording's reads around every layer's swap-in (a wait for the device each) are not made.
    assert reads == [{"reset": True}] * 7
    checks = report["checks"]
    assert set(checks) == {"kernels_vs_fp64", "hisparse_equals_resident"}
    fp64 = checks["kernels_vs_fp64"]
    assert fp64["ok"] and all(0 < fp64[k] <= 1 for k in ("compress", "store", "indexer", "attention"))
    assert checks["hisparse_equals_resident"]["ok"] and checks["hisparse_equals_resident"]["max_abs_diff"] == 0
    steps = report["steps"]
    assert len(steps) == 6
    # Every miss moves one 584-byte entry host -> device; the longer request cannot fit its hot buffer.
    assert all(s["bytes_h2d"] == s["misses"] * V4.bytes_per_token for s in steps)
    assert sum(s["misses"] for s in steps) > 0
    # Each step, every C4 layer (2) of every request (2) looks up min(top-k, visible entries) entries.
    visible = [(n + i + 1) // 4 for i in range(6) for n in (640, 403)]
    lookups = [sum(min(64, v) for v in visible[2 * i : 2 * i + 2]) * 2 for i in range(6)]
    assert [s["hits"] + s["misses"] for s in steps] == lookups
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_traces_are_what_its_swap_in_received_and_what_it_did(tmp_path, monkeypatch):
    """--save-traces: each C4 layer's trace holds, per step and request, the C4 length and top-k the
    coordinator's swap-in was called with; LRU replayed over it at the demo's hot buffer gives the
    kernel's hits and loads of that layer, which add up to the demo's per-step counters. The
    recording run still equals the all-resident run bit for bit."""
    received: dict[int, list[tuple[list[int], list[int], list[list[int]]]]] = {}
    swap_in = HiSparseCoordinator.swap_in_selected_pages

    def spy(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id, num_real_reqs=None):
        received.setdefault(layer_id, []).append(
            (req_pool_indices.tolist(), compressed_seq_lens.tolist(), top_k_result.tolist()))
        return swap_in(self, req_pool_indices, compressed_seq_lens, top_k_result, layer_id, num_real_reqs)

    monkeypatch.setattr(HiSparseCoordinator, "swap_in_selected_pages", spy)
    code, report = run_demo(tmp_path, "--save-traces", str(tmp_path / "traces"))
    assert code == 0 and report["checks"]["hisparse_equals_resident"]["ok"]
    assert report["traces"] == [str(tmp_path / "traces" / f"demo_layer{layer}.json") for layer in (1, 3)]
    per_step = [[0, 0] for _ in report["steps"]]
    for c4_layer, path in enumerate(report["traces"]):
        trace = Trace.load(path)
        assert trace.num_top_k == 64 and trace.source["layer"] == (1, 3)[c4_layer]
        calls = received[c4_layer]
        assert len(calls) == 6 == trace.num_steps
        for step, (rids, lens, top_k) in enumerate(calls):
            assert [r.id for r in trace.requests] == [f"r{rid}" for rid in rids]
            assert [r.steps[step] for r in trace.requests] == list(zip(lens, top_k))
        kernel = trace.source["kernel_steps"]
        assert [[s.hits, s.loads] for s in replay(trace, trace.source["hot_buffer"], "lru").steps] == kernel
        per_step = [[a + b for a, b in zip(total, layer)] for total, layer in zip(per_step, kernel)]
    assert per_step == [[s["hits"], s["misses"]] for s in report["steps"]]
    assert sum(loads for _, loads in per_step) > 0


def test_demo_refuses_what_this_build_lacks_naming_the_flag(capsys, tmp_path):
    assert main(["demo", "--backend", "tpu"]) == 2
    assert "--backend" in capsys.readouterr().err
    assert main(["demo", "--hisparse", "many"]) == 2
    assert "--hisparse" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["demo", "--save-traces", str(tmp_path / "file")]) == 2
    assert "--save-traces" in capsys.readouterr().err


#: The smallest --tokens the demo takes (prompts of 16 and 13 tokens: 4 and 3 C4 entries): it reaches the
#: paths 64 reached (top-k keeps every entry, no hot-buffer miss, no C128 entry yet, the window not
#: full) at a quarter of the prefill, which the Triton interpreter and the simulator make slow.
SMALLEST = ["--tokens", "16", "--steps", "1"]


@pytest.mark.slow
def test_a_tiny_demo_on_sim_checks_hold(tmp_path):
    """--backend sim: the kernels' CUDA path under the simulator (slow: the sim builds, cold; CI: make
    test-demos)."""
    done = subprocess.run([sys.executable, "-m", "sparsekv", "demo", *SMALLEST, "--backend", "sim", "--json",
                           str(tmp_path / "demo.json")], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["ok"] and report["spec"]["backend"] == "sim"


def test_a_demo_decode_runs_in_strict_mode_after_jit_build_model(sparsekv_cli):
    """`jit build --model demo` lists every family the demo's serving path loads: with compiling
    forbidden (SPARSEKV_JIT_STRICT=1), a whole prefill + HiSparse decode step still runs."""
    env = dict(os.environ)
    built = sparsekv_cli("jit", "build", "--model", "demo", "--json", cache_dir=env["SPARSEKV_CACHE_DIR"])
    assert built.returncode == 0, built.stderr[-2000:]
    strict = subprocess.run([sys.executable, "-m", "sparsekv", "demo", *SMALLEST],
                            capture_output=True, text=True, env=env | {"SPARSEKV_JIT_STRICT": "1"}, timeout=600)
    assert strict.returncode == 0, strict.stderr[-2000:]
    assert "0 built" in strict.stdout and "HiSparse (small hot buffer) outputs == all-resident outputs" in strict.stdout


@needs_engine("nixl")
def test_tiny_demo_over_pd_equals_the_single_process_run(tmp_path):
    """Prefill and decode in two processes, the KV over NIXL on 127.0.0.1 (C4 KV straight into the
    decode's host pool): bit for bit the single-process outputs. NIXL is the `pd` extra (make test
    installs it)."""
    code, report = run_demo(tmp_path, "--pd")
    assert code == 0
    pd = report["checks"]["pd_equals_single_process"]
    assert pd["ok"] and pd["max_abs_diff"] == 0 and pd["transfer"]["statuses"] == {"1": "SUCCESS", "2": "SUCCESS"}
    # Two requests' pages of every full-token, SWA and state region crossed: at least their C4 KV bytes.
    assert pd["bytes_sent"] >= (640 // 4 + 403 // 4) * 2 * 584


@pytest.mark.slow  # the Triton interpreter: about 40 CPU seconds even at this size (CI: make test-demos)
def test_tiny_demo_with_the_triton_indexer_and_attention(tmp_path):
    out = tmp_path / "demo.json"
    code = main(["demo", *SMALLEST, "--impl", "triton", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["spec"]["impl"] == "triton"
    assert report["checks"]["kernels_vs_fp64"]["ok"] and report["checks"]["hisparse_equals_resident"]["ok"]

"""``sparsekv plan-memory``: the golden/README CLI contract, the breakdown and the suggested fixes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sparsekv.cli import main
from sparsekv.srt.model_executor.memory_case import parse_case
from sparsekv.srt.model_executor.plan_advice import min_budget_bytes, min_swa_ratio

REPO = Path(__file__).resolve().parents[2]
GOLDEN_PATH = REPO / "tests" / "golden" / "memory_plans.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text())
BY_NAME = {c["name"]: c for c in GOLDEN}


def run_cli(capsys, *argv):
    code = main(["plan-memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_cli_answers_golden_case(capsys, name):
    code, out, err = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", name, "--json")
    got, expected = json.loads(out), BY_NAME[name]["expected"]
    if "error" in expected:
        assert code == 1
        assert got["error"] == expected["error"] and got["message"]
        assert got["message"] in err
        return
    assert code == 0 and err == ""
    assert len(got["ranks"]) == len(expected["ranks"])
    for g, e in zip(got["ranks"], expected["ranks"]):
        assert {k: g.get(k) for k in e} == e


def test_cli_reads_a_single_case_object(capsys, tmp_path):
    case = BY_NAME["flash-pp4-40GiB"]
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))  # carries "expected", which the CLI ignores
    code, out, _ = run_cli(capsys, "--case", str(path), "--json")
    assert code == 0
    assert [r["max_total_num_tokens"] for r in json.loads(out)["ranks"]] == [21735680] * 4 == [
        r["max_total_num_tokens"] for r in case["expected"]["ranks"]
    ]


def test_flags_build_the_same_case_as_json(capsys):
    code, out, _ = run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", "40GiB", "--pp", "2", "--json")
    assert code == 0
    expected = BY_NAME["flash-pp2-40GiB"]["expected"]["ranks"]
    assert [{k: r[k] for k in e} for r, e in zip(json.loads(out)["ranks"], expected)] == expected
    code, out, _ = run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", "40GiB", "--hisparse", "4", "--json")
    expected = BY_NAME["flash-pp1-40GiB-hisparse4"]["expected"]["ranks"][0]
    assert code == 0 and {k: json.loads(out)["ranks"][0][k] for k in expected} == expected


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "dsv4-flash", "--kv-budget", "40GiB", "--page-size", "100"], "--page-size"),
        (["--model", "dsv4-flash", "--kv-budget", "forty"], "--kv-budget"),
        (["--model", "dsv4-flash"], "--kv-budget"),
        (["--model", "dsv4-flash", "--kv-budget", "1GiB", "--pp", "99"], "--pp"),
        (["--model", "dsv4-mega", "--kv-budget", "1GiB"], "--model"),
        ([], "exactly one of"),
    ],
)
def test_malformed_input_exits_2_naming_the_field(capsys, argv, needle):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err


def test_malformed_case_files_exit_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--case", str(GOLDEN_PATH))
    assert code == 2 and "--name" in err
    code, _, err = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", "no-such-case")
    assert code == 2 and "no-such-case" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BY_NAME["flash-pp1-40GiB"], "server": {"max_running_requests": "many"}}))
    code, _, err = run_cli(capsys, "--case", str(bad), "--json")
    assert code == 2 and "server.max_running_requests" in err
    bad.write_text("{not json")
    code, _, err = run_cli(capsys, "--case", str(bad))
    assert code == 2 and "not valid JSON" in err
    code, _, err = run_cli(capsys, "--case", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read" in err


def test_human_breakdown_names_components_and_limit(capsys):
    code, out, _ = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", "flash-pp2-40GiB")
    assert code == 0
    for needle in ("bytes per SWA token", "bytes per full token", "C4 indexer", "C128 compressor state",
                   "fixed, request-scoped", "limited by the KV budget of PP rank 1", "11,490,048"):
        assert needle in out
    code, out, _ = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", "flash-pp1-40GiB-max-total-tokens")
    assert code == 0 and "limited by the max_total_tokens cap" in out


def test_infeasible_plan_explains_and_fixes(capsys):
    code, out, err = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", "flash-pp1-20GiB-cap-mode")
    assert code == 1 and "SWA pool cap" in err
    assert "No plan: RuntimeError" in out and "lower server.max_running_requests to <=" in out
    assert "raise the KV budget (available_bytes) to >=" in out


@pytest.mark.parametrize("name", ["flash-pp1-2.55GiB-swa-floor", "flash-pp1-20GiB-cap-mode", "mixed-02"])
def test_suggested_budget_is_the_smallest_that_plans(name):
    case = parse_case(BY_NAME[name])
    budget = min_budget_bytes(case)
    replace(case, available_bytes=budget).plan()  # plans
    with pytest.raises((ValueError, RuntimeError)):
        replace(case, available_bytes=budget - 1).plan()


def test_suggested_ratio_plans_and_the_one_below_does_not():
    case = parse_case(BY_NAME["flash-pp1-2.55GiB-swa-floor"])
    ratio = min_swa_ratio(case)
    replace(case, server=replace(case.server, swa_full_tokens_ratio=ratio)).plan()
    with pytest.raises(ValueError):
        replace(case, server=replace(case.server, swa_full_tokens_ratio=round(ratio - 0.001, 3))).plan()


def test_console_script_and_import_stays_torch_free():
    probe = "import sys, sparsekv.srt.model_executor.plan_memory; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    done = subprocess.run(
        [sys.executable, "-m", "sparsekv", "plan-memory", "--case", str(GOLDEN_PATH), "--name", "mixed-06", "--json"],
        capture_output=True, text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ranks"][0]["c128_state_pool_size"] == BY_NAME["mixed-06"]["expected"]["ranks"][0][
        "c128_state_pool_size"
    ]

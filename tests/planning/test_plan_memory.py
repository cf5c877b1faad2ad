"""``sparsekv plan-memory``: the golden/README CLI contract, the breakdown and the suggested fixes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sparsekv.cli import main
from sparsekv.cli.plan_memory import parse_size
from sparsekv.srt.model_executor import cases as shipped_cases
from sparsekv.srt.model_executor import memory_case
from sparsekv.srt.model_executor.memory_case import parse_case
from sparsekv.srt.model_executor.plan_advice import min_budget_bytes, min_swa_ratio
from sparsekv.srt.model_executor.plan_breakdown import COMPONENT_LABELS

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
        # Multiples of 128 that no DSV4 kernel serves: refused, naming the sizes that are served.
        (["--model", "dsv4-flash", "--kv-budget", "40GiB", "--page-size", "384"], "--page-size must be one of 128, "
                                                                                  "256, 512"),
        (["--model", "dsv4-flash", "--kv-budget", "40GiB", "--page-size", "1024", "--hisparse", "2"],
         "--page-size must be one of 128, 256, 512"),
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


def test_the_swa_prefix_tails_the_planner_suggests_lowering_is_a_flag(capsys):
    argv = ("--model", "dsv4-flash", "--kv-budget", "20GiB", "--swa-cap")
    code, out, _ = run_cli(capsys, *argv)
    assert code == 1 and "lower --swa-prefix-tails" in out and "swa_prefix_tails" not in out
    # Following the advice works: without the 4 tails per request the cap leaves room for the full pool.
    code, _, _ = run_cli(capsys, *argv, "--swa-prefix-tails", "0")
    assert code == 0


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
    probe = "import sys, sparsekv.cli.plan_memory; print('torch' in sys.modules)"
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


# ---- issue 16: sizes with units, flag names, host bytes, one set of facts, shipped cases ----------


def test_a_bare_number_budget_is_refused_with_a_hint(capsys):
    code, out, err = run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", "60")
    assert code == 2 and out == ""
    assert "--kv-budget" in err and "did you mean 60GiB" in err


@pytest.mark.parametrize("text", ["60GiB", "60G", "60g", "60 GiB", "64424509440B", "61440MiB", "61440M", "0.05859375T"])
def test_binary_sizes_with_units(text):
    assert parse_size(text) == 60 * 2**30


def test_decimal_units_and_fractions():
    assert parse_size("40GB") == 40 * 10**9 and parse_size("1.5KB") == 1500
    # the golden "2.55GiB" case's budget is exactly 2.55 * 2**30, rounded down
    assert parse_size("2.55GiB") == BY_NAME["flash-pp1-2.55GiB-swa-floor"]["available_bytes"]


def test_units_plan_the_same_case(capsys):
    answers = {json.dumps(json.loads(run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", b, "--json")[1])["ranks"])
               for b in ("40GiB", "40G", "42949672960B")}
    assert len(answers) == 1
    ranks = json.loads(answers.pop())
    expected = BY_NAME["flash-pp1-40GiB"]["expected"]["ranks"]
    assert [{k: r[k] for k in e} for r, e in zip(ranks, expected)] == expected


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--page-size", "100"], "--page-size"),
        (["--pp", "99"], "--pp"),
        (["--pp", "0"], "--pp"),
        (["--swa-full-tokens-ratio", "2"], "--swa-full-tokens-ratio"),
        (["--max-running-requests", "0"], "--max-running-requests"),
        (["--eagle-steps", "0"], "--eagle-steps"),
        (["--attn-dp", "0"], "--attn-dp"),
        (["--context-len", "0"], "--context-len"),
        (["--hisparse", "0"], "--hisparse"),
    ],
)
def test_errors_about_flags_name_the_flags_not_case_fields(capsys, argv, flag):
    code, out, err = run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", "40GiB", *argv)
    assert code == 2 and out == ""
    assert flag in err and "server." not in err and "model." not in err and "pp_size" not in err


def test_fixes_of_a_flag_case_name_the_flags(capsys):
    code, out, err = run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", "20GiB", "--swa-cap")
    assert code == 1
    assert "raise the KV budget (--kv-budget) to >=" in out and "lower --max-running-requests to <=" in out
    assert "set --swa-full-tokens-ratio explicitly" in out and "server." not in out


def expected_host_bytes(full_tokens: int, c4_layers: int) -> int:
    # every logical C4 entry lives in host memory: 64-entry V4 pages of 37,440 B, per C4 layer
    return -(-(full_tokens // 4) // 64) * 37440 * c4_layers


@pytest.mark.parametrize("name", ["flash-pp1-40GiB-hisparse2", "flash-pp1-40GiB-hisparse4"])
def test_hisparse_plans_show_the_host_bytes_in_both_outputs(capsys, name):
    full = BY_NAME[name]["expected"]["ranks"][0]["full_max_total_num_tokens"]
    host = expected_host_bytes(full, c4_layers=21)
    code, out, _ = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", name, "--json")
    report = json.loads(out)
    assert code == 0 and report["host_bytes"] == report["ranks"][0]["host"]["bytes"] == host
    code, out, _ = run_cli(capsys, "--case", str(GOLDEN_PATH), "--name", name)
    assert code == 0 and f"Host (DRAM) memory for HiSparse: {host / 2**30:.2f} GiB ({host:,} B)" in out


def test_plans_without_hisparse_need_no_host_bytes(capsys):
    code, out, _ = run_cli(capsys, "--case", "flash-pp1-40GiB", "--json")
    assert code == 0 and json.loads(out)["host_bytes"] is None and json.loads(out)["ranks"][0]["host"] is None


SHIPPED = [c["name"] for c in shipped_cases.catalog()]


def _count(text: str) -> int:
    return int(text.replace(",", ""))


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"


def numbers_in_text(text: str) -> dict:
    """The numbers the text breakdown states, read back from it: agreed tokens, and per rank its
    pool sizes, request count, profiled tokens and (DSV4) each component's entries and GiB."""
    agreed = re.search(r"^Agreed max_total_num_tokens: ([\d,]+), limited by ", text, re.M)
    ranks = {}
    for m in re.finditer(r"^PP rank (\d+): full ([\d,]+) tokens(?:, SWA ([\d,]+))?, max_running_requests (\d+)$",
                         text, re.M):
        ranks[int(m[1])] = {"full": _count(m[2]), "swa": m[3] and _count(m[3]), "requests": int(m[4]), "pools": {}}
    profiled = [_count(m[1]) for m in re.finditer(r"^  profiled (?:full )?tokens ([\d,]+)$", text, re.M)]
    # Pool lines follow their rank's summary line.
    rank = None
    for line in text.splitlines():
        if m := re.match(r"PP rank (\d+): full ", line):
            rank = int(m[1])
        elif rank is not None and (m := re.match(r"  (\S.*?)\s+([\d,]+) entries\s+([\d.]+ GiB)$", line)):
            ranks[rank]["pools"][m[1]] = (_count(m[2]), m[3])
    return {"agreed": agreed and _count(agreed[1]), "ranks": ranks, "profiled": profiled}


@pytest.mark.parametrize("source", [("--case", str(GOLDEN_PATH), "--name", n) for n in sorted(BY_NAME)]
                         + [("--case", n) for n in SHIPPED], ids=lambda s: s[-1])
def test_text_states_the_planned_numbers(capsys, source):
    code_json, out_json, _ = run_cli(capsys, *source, "--json")
    code_text, out_text, _ = run_cli(capsys, *source)
    report = json.loads(out_json)
    assert code_json == code_text
    if code_json != 0:
        assert report["message"] in out_text and all(f["text"] in out_text for f in report["fixes"])
        return
    stated = numbers_in_text(out_text)
    # Golden cases: the text must state sglang's own numbers; shipped cases: the planner's.
    expected = BY_NAME[source[-1]]["expected"]["ranks"] if source[-1] in BY_NAME else report["ranks"]
    assert stated["agreed"] == report["agreed_max_total_num_tokens"]
    assert sorted(stated["ranks"]) == list(range(len(expected)))
    assert stated["profiled"] == [r["profiled_tokens"] for r in report["ranks"]]
    for i, (golden, rank) in enumerate(zip(expected, report["ranks"])):
        want = {**rank, **golden}  # a field the golden file leaves out: the planner's, from the JSON
        got = stated["ranks"][i]
        assert got["full"] == (want.get("full_max_total_num_tokens") or want["max_total_num_tokens"])
        assert got["swa"] == want.get("swa_max_total_num_tokens")
        assert got["requests"] == want["max_running_requests"]
        if "pool_entries" in rank:
            pools = {COMPONENT_LABELS[k]: (rank["pool_entries"][k], _gib(rank["pool_bytes"][k]))
                     for k in COMPONENT_LABELS}
            assert got["pools"] == pools
            assert pools["C4 KV"][0] == want["c4_max_total_num_tokens"]
            assert pools["C128 KV"][0] == want["c128_max_total_num_tokens"]
            assert pools["C4 compressor state"][0] == want["c4_state_pool_size"]
            assert pools["C128 compressor state (fixed)"][0] == want["c128_state_pool_size"]
        else:
            assert got["pools"] == {}


def test_list_cases_names_every_shipped_case(capsys):
    code, out, _ = run_cli(capsys, "--list-cases")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == SHIPPED
    code, out, _ = run_cli(capsys, "--list-cases", "--json")
    assert code == 0 and [c["name"] for c in json.loads(out)] == SHIPPED
    assert "flash-pp2-40GiB-hisparse" in SHIPPED  # the case the README plans


@pytest.mark.parametrize("name", [n for n in SHIPPED if n in BY_NAME])
def test_shipped_cases_that_are_golden_give_the_golden_answer(capsys, name):
    code, out, _ = run_cli(capsys, "--case", name, "--json")
    got, expected = json.loads(out), BY_NAME[name]["expected"]
    if "error" in expected:
        assert code == 1 and got["error"] == expected["error"]
        return
    assert code == 0
    assert [{k: r.get(k) for k in e} for r, e in zip(got["ranks"], expected["ranks"])] == expected["ranks"]


def test_the_case_schema_document_names_every_field():
    doc = (REPO / "docs" / "memory_cases.md").read_text()
    fields = (memory_case.SERVER_FIELDS + memory_case.MHA_MODEL_FIELDS + memory_case.DSV4_MODEL_OVERRIDES
              + memory_case.SPECULATIVE_FIELDS + ("preset", "kind", "available_bytes", "pp_size", "description"))
    missing = [f for f in fields if f"`{f}`" not in doc]
    assert missing == []


def test_the_indexed_swap_in_adds_its_resident_index_to_the_device_bytes(capsys):
    base = ["--model", "dsv4-flash", "--kv-budget", "40GiB", "--hisparse", "2", "--json"]
    code, out, _ = run_cli(capsys, *base)
    plain = json.loads(out)["ranks"][0]
    code2, out, _ = run_cli(capsys, *base, "--hisparse-index", "1024")
    indexed = json.loads(out)["ranks"][0]
    assert code == code2 == 0 and plain["resident_index"] is None
    index = indexed["resident_index"]
    # 1M context: 262,144 C4 positions + 64 page slots; 2 B each, then an int16 queue of 2H and int32 per slot.
    positions = 1048576 // 4 + 256 // 4
    assert index["bytes_per_request_layer"] == 2 * positions + 4 * 1024 + 4 * (1024 + 2)
    assert index["bytes"] == index["bytes_per_request_layer"] * index["request_slots"] * 21
    assert index["request_slots"] == plain["fixed_bytes"]["request_slots"]
    assert indexed["device_bytes"] == plain["device_bytes"] + index["bytes"]
    code, out, _ = run_cli(capsys, *base[:-1], "--hisparse-index", "1024")
    gib = index["bytes"] / 2**30
    assert code == 0 and re.search(rf"HiSparse resident index +{index['request_slots']:,} requests +{gib:.2f} GiB", out)


def test_hisparse_index_without_hisparse_is_refused(capsys):
    code, _, err = run_cli(capsys, "--model", "dsv4-flash", "--kv-budget", "40GiB", "--hisparse-index", "1024")
    assert code == 2 and "--hisparse-index needs --hisparse" in err

"""Plans the public golden cases leave out: regression values, not sglang's output.

The cases, with the arithmetic behind their numbers, are in ``tools/extra_memory_cases.py``; its
output, the planner's answer to each, is checked in as ``tests/golden/extra_memory_cases.json``
(rerun the script after a planner change and argue each number that moved against sglang's code).
This file holds the planner to that JSON, the JSON to the script's cases, and the three answers
that are golden plans' (sglang's own, ``tests/golden/memory_plans.json``) to those plans.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from sparsekv.cli import main
from sparsekv.srt.model_executor.model_spec import ServerSpec, SpeculativeSpec
from sparsekv.srt.model_executor.pool_configurator import decode_alloc_per_request

REPO = Path(__file__).resolve().parents[2]
GOLDEN_PATH = REPO / "tests" / "golden" / "memory_plans.json"


def _script():
    """tools/extra_memory_cases.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("extra_memory_cases", REPO / "tools" / "extra_memory_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("extra_memory_cases", module)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()
ENTRIES = json.loads(SCRIPT.OUTPUT.read_text())
EXPECTED = {e["name"]: e["expected"] for e in ENTRIES}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_plan_matches_the_regression_value(entry):
    got = SCRIPT.answer(entry["case"])
    assert got == entry["expected"]
    if isinstance(got, list) and "c4_max_total_num_tokens" in got[0]:
        # DSV4: max_total_num_tokens is the full pool.
        assert all(r["max_total_num_tokens"] == r["full_max_total_num_tokens"] for r in got)


def test_the_json_holds_the_scripts_cases():
    # Same names, same inputs, in order (JSON round trip: tuples are lists there): the JSON is the
    # script's output for its own cases, not numbers from anywhere else.
    assert [[e["name"], e["case"]] for e in ENTRIES] == json.loads(json.dumps(SCRIPT.CASES))
    assert len(ENTRIES) == 27 and sum(isinstance(e["expected"], list) for e in ENTRIES) == 19


#: Cases of this file whose answer is a golden plan's (the comment above each says why).
ANCHORED = {"flash-cap-without-chunked-prefill-falls-back-to-ratio": "flash-pp1-40GiB",
            "flash-hisparse-ratio1": "flash-pp1-40GiB",
            "mha-hybrid-cap-sizing-keeps-default-ratio": "gemma-like-hybrid-swa-40GiB"}


def test_anchored_cases_are_golden_plans():
    golden = {c["name"]: c["expected"].get("ranks") for c in json.loads(GOLDEN_PATH.read_text())}
    ours = EXPECTED
    for name, golden_name in ANCHORED.items():
        for mine, theirs in zip(ours[name], golden[golden_name], strict=True):
            assert {k: mine[k] for k in theirs if k in mine} == {k: v for k, v in theirs.items() if k in mine}


def test_cli_prices_a_top_k_2_draft_tree(capsys, tmp_path):
    # Formerly rejected as malformed (exit 2): sglang's configurator has numbers for it.
    path = tmp_path / "case.json"
    path.write_text(json.dumps(SCRIPT.case(SCRIPT.FLASH, 80 * SCRIPT.GIB, swa_sizing="cap",
                                           speculative=SCRIPT.eagle(3, 5, topk=2))))
    assert main(["plan-memory", "--case", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"][0]["swa_max_total_num_tokens"] == 1196288


@pytest.mark.parametrize(
    "page, topk, overlap_off, expected",
    [
        # sglang's hybrid-SWA unit test (steps 3, 5 drafts): spec v1 on page 4 ->
        # max(ceil_align(3 + 4, 4) * 2, ceil_align(5, 4)) = 16; spec v2 on page 1 -> 2 * max(6, 5).
        (4, 2, True, 16),
        (1, 2, False, 12),
        (4, 1, True, 8),  # max(ceil_align(3, 4), ceil_align(5, 4))
        (4, 2, False, 32),  # 2 * max(ceil((3 + 3) / 4) * 4 * 2, 5)
    ],
)
def test_decode_alloc_per_request(page, topk, overlap_off, expected):
    server = ServerSpec(
        page_size=page, speculative=SpeculativeSpec(num_steps=3, eagle_topk=topk, num_draft_tokens=5),
        disable_overlap_schedule=overlap_off,
    )
    assert decode_alloc_per_request(server) == expected

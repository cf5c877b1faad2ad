"""``sparsekv plan-memory`` never shows a traceback: any case file gives exit 0 (a plan), 1 (the
budget cannot hold one) or 2 (malformed input, one line naming the field).

A hypothesis test puts random JSON (wrong types, huge and non-finite numbers, 400-digit integers,
deep nesting, lists where strings are expected) into random fields of the golden cases; the
regressions of issue 12 are pinned one by one, in a real process.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.cli import main
from sparsekv.srt.model_executor import memory_case

REPO = Path(__file__).resolve().parents[2]
GOLDEN = {c["name"]: c for c in json.loads((REPO / "tests" / "golden" / "memory_plans.json").read_text())}
BIG = 10**400

PATHS = (
    [("name",), ("model",), ("available_bytes",), ("pp_size",), ("server",)]
    + [("model", k) for k in ("preset", "kind") + memory_case.DSV4_MODEL_OVERRIDES + memory_case.MHA_MODEL_FIELDS]
    + [("server", k) for k in memory_case.SERVER_FIELDS]
    + [("server", "speculative", k) for k in memory_case.SPECULATIVE_FIELDS]
)


class Deep:
    """A JSON array nested ``depth`` levels (written as text: json.dumps itself would recurse)."""

    def __init__(self, depth: int):
        self.depth = depth


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([BIG, -BIG, BIG + 7, 2**63, 2**64 + 1, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e-308, 0.5, 4.0]),
    st.text(max_size=6),
    st.sampled_from(["dsv4-flash", "mha", "cap", "ratio", "bf16", "decode", "EAGLE", "NEXTN", ""]),
    st.lists(st.one_of(st.integers(-5, 300), st.text(max_size=3)), max_size=4),
    st.sampled_from([["dsv4-flash"], [0, 4, 128], {"preset": "dsv4-flash"}, {}]),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
    st.integers(min_value=2, max_value=200_000).map(Deep),
)


def to_json(value) -> str:
    deep: dict[str, int] = {}

    def encode(v):
        if isinstance(v, Deep):
            key = f"__deep_{len(deep)}__"
            deep[key] = v.depth
            return key
        raise TypeError(type(v))

    text = json.dumps(value, default=encode, allow_nan=True)
    for key, depth in deep.items():
        text = text.replace(f'"{key}"', "[" * depth + "]" * depth)
    return text


def put(case: dict, path: tuple[str, ...], value) -> None:
    node = case
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = value


def answer(text: str) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "case.json"
        path.write_text(text)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["plan-memory", "--case", str(path), "--json"])
    return code, out.getvalue(), err.getvalue()


def check_contract(code: int, out: str, err: str) -> None:
    assert "Traceback" not in out + err
    if code == 0:
        assert json.loads(out)["ranks"] and err == ""
    elif code == 1:
        # plan-memory's own "no plan" answer, not the CLI's catch-all for an unexpected exception
        assert json.loads(out)["error"] in ("ValueError", "RuntimeError"), (out, err)
    else:
        assert code == 2 and out == "", (code, out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("sparsekv plan-memory: error: "), err
        assert "unhashable" not in err and "object of type" not in err, err


@given(base=st.sampled_from(sorted(GOLDEN)), edits=st.lists(st.tuples(st.sampled_from(PATHS), JUNK), min_size=1,
                                                            max_size=3))
def test_random_json_in_any_field_gives_0_1_or_2(base, edits):
    case = copy.deepcopy(GOLDEN[base])
    for path, value in edits:
        put(case, path, value)
    check_contract(*answer(to_json(case)))


@pytest.mark.parametrize(
    "path, value, field",
    [
        (("available_bytes",), BIG, "available_bytes"),
        (("model", "head_dim"), BIG, "model.head_dim"),
        (("server", "swa_full_tokens_ratio"), BIG, "server.swa_full_tokens_ratio"),
        (("server", "swa_full_tokens_ratio"), 1e308, "server.swa_full_tokens_ratio"),
        (("server", "max_running_requests"), BIG, "server.max_running_requests"),
        (("pp_size",), BIG, "pp_size"),
        (("model", "preset"), ["dsv4-flash"], "model.preset"),
        (("server", "compress_state_dtype"), ["bf16"], "server.compress_state_dtype"),
        (("server", "swa_sizing"), {"cap": 1}, "server.swa_sizing"),
        (("server", "disaggregation_mode"), ["decode"], "server.disaggregation_mode"),
        (("name",), ["a"], "name"),
    ],
)
def test_out_of_range_and_wrongly_typed_fields_exit_2_naming_the_field(tmp_path, path, value, field):
    case = copy.deepcopy(GOLDEN["flash-pp1-40GiB"])
    put(case, path, value)
    file = tmp_path / "case.json"
    file.write_text(to_json(case))
    done = subprocess.run([sys.executable, "-m", "sparsekv", "plan-memory", "--case", str(file), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 2 and done.stdout == "" and field in done.stderr, done.stderr


@pytest.mark.parametrize("depth", [900, 100_000])
def test_deeply_nested_json_exits_2(tmp_path, depth):
    for text in ("[" * depth + "]" * depth, to_json({**GOLDEN["flash-pp1-40GiB"], "server": Deep(depth)})):
        file = tmp_path / "case.json"
        file.write_text(text)
        done = subprocess.run([sys.executable, "-m", "sparsekv", "plan-memory", "--case", str(file)],
                              capture_output=True, text=True, timeout=120)
        assert "Traceback" not in done.stdout + done.stderr
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_400_digit_kv_budget_exits_2():
    done = subprocess.run([sys.executable, "-m", "sparsekv", "plan-memory", "--model", "dsv4-flash", "--kv-budget",
                           "9" * 400 + "GiB"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 2 and "--kv-budget" in done.stderr

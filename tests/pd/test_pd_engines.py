"""The engine contract, over every engine of ``ENGINES``: two real processes on 127.0.0.1 (the
``sparsekv pd-demo`` roles, :mod:`sparsekv.testing.pd_session`) move DSV4 pools with random bytes
byte for byte (PP stages, with and without HiSparse on decode) and leave unrelated bytes as they
were; manifest, TP and length mismatches fail before any write; a decode killed mid-transfer fails
the transfer on the prefill side, which frees what it registered and held, every wait within the
session's timeout.

The decode checks every byte of every region it registered against what it must hold (its own
bytes, each transferred item replaced by the prefill's), so "nothing written" and "unrelated slots
unchanged" are the same exact comparison. An engine whose listeners bind every interface runs in a
private network namespace (:mod:`pd_isolation`). Each engine's tests skip, with the reason, only
where it cannot be imported.
"""

from __future__ import annotations

import json
import re

import pytest
from pd_isolation import run_isolated

from sparsekv.srt.disaggregation.engines import ENGINES, load_engine, open_backend
from sparsekv.testing.components import needs_engine
from sparsekv.testing.pd_session import DemoSpec, run_session, verdict

#: One parameter per engine of the table, marked with what it needs (the only reason it may skip; CI: fail).
EVERY_ENGINE = [pytest.param(name, marks=needs_engine(name), id=name) for name in ENGINES]

# With HiSparse the demo's hot buffer holds 64 C4 entries: room 4 (200 tokens, 50 entries) is preloaded
# whole by admit_request_direct, the others (>= 175 entries) load only their newest entry.
SMALL = {"num_layers": 6, "budget_mib": 16, "seq_lens": [1000, 3000, 700, 200], "timeout_s": 30.0}


def scenario_session(spec: dict) -> dict:
    """One session of ``spec`` (a :class:`DemoSpec` as JSON) and its verdict."""
    report = run_session(DemoSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}))
    report["verdict"] = verdict(report)
    return report


def engine_session(spec: dict) -> dict:
    """:func:`scenario_session` as JSON carries it (room numbers as strings), in a private network
    namespace for an engine that binds every interface."""
    if ENGINES[spec["engine"]].binds_every_interface:
        return run_isolated(__file__, "scenario_session", spec)
    return json.loads(json.dumps(scenario_session(spec), default=str))


def assert_prefill_released(prefill: dict) -> None:
    assert prefill["open_handles"] == 0
    assert prefill["registered_after_close"] == 0
    assert prefill["rooms_still_held"] == []


@pytest.mark.parametrize("hisparse", [False, True], ids=["device-decode", "hisparse-decode"])
@pytest.mark.parametrize("engine", EVERY_ENGINE)
def test_pp_stages_arrive_byte_for_byte(engine, hisparse):
    # Room 3 asks for one SWA destination too many: both sides refuse it before any write.
    report = engine_session({**SMALL, "engine": engine, "pp_size": 2, "hisparse": hisparse, "bad_rooms": [3]})
    prefill, decode = report["prefill"], report["decode"]
    assert report["spec"]["engine"] == engine
    # A room that fails still may have received part of its bytes: name the rooms' outcomes with any mismatch.
    assert decode["mismatched"] == {}, (decode["mismatched"], decode["rooms"])
    assert decode["bytes_checked"] > 0
    statuses = {int(r): v["status"] for r, v in decode["rooms"].items()}
    assert statuses == {1: "success", 2: "success", 3: "failed", 4: "success"}
    assert "index length mismatch" in decode["rooms"]["3"]["error"]
    assert {int(r): v["status"] for r, v in prefill["rooms"].items()} == statuses
    assert "refused before any write" in prefill["rooms"]["3"]["error"]
    assert all(prefill["rooms"][r]["bytes"] > 0 for r in ("1", "2", "4"))
    if hisparse:
        assert decode["admitted"] == [1, 2, 4]
        assert decode["hot_entries_checked"] > 0 and decode["hot_entries_wrong"] == 0
    assert_prefill_released(prefill)
    assert report["verdict"] is False  # room 3 failed, so the demo's verdict must say so


@pytest.mark.parametrize(("override", "match"), [
    ({"decode_state_dtype": "bf16"}, "items are .* B on prefill and .* B on decode"),
    ({"decode_attn_tp_size": 2, "is_mla": False}, "different attention TP sizes .* non-MLA SWA"),
], ids=["state-dtype", "tp-size"])
@pytest.mark.parametrize("engine", EVERY_ENGINE)
def test_mismatches_are_refused_on_both_sides_before_any_write(engine, override, match):
    report = engine_session({**SMALL, "engine": engine, "pp_size": 1, "budget_mib": 32, **override})
    prefill, decode = report["prefill"], report["decode"]
    assert "refused this decode" in decode["refused"]
    assert re.search(match, decode["refused"])
    assert decode["unchanged"] is True
    assert len(prefill["refusals"]) == 1 and re.search(match, prefill["refusals"][0])
    assert all(r["status"] == "failed" and r["bytes"] == 0 for r in prefill["rooms"].values())
    assert_prefill_released(prefill)


@pytest.mark.parametrize("engine", EVERY_ENGINE)
def test_decode_killed_mid_transfer_fails_the_transfer_on_prefill(engine):
    spec = {**SMALL, "engine": engine, "pp_size": 1, "budget_mib": 32, "seq_lens": [5000, 700],
            "kill_decode_after": 2, "max_inflight": 1, "max_batch_rows": 4}
    report = engine_session(spec)
    prefill, decode = report["prefill"], report["decode"]
    assert decode.get("killed") is True
    room = prefill["rooms"]["1"]
    assert room["status"] == "failed"
    # One batch in flight at a time: the decode died after the second, so the third fails.
    assert "room 1: transfer failed after 2/" in room["error"], room["error"]
    # Detected within the transfer timeout (the decode's socket closing is seen at once).
    assert prefill["failure_detected_after_kill_s"] < spec["timeout_s"]
    assert prefill["rooms"]["2"]["status"] == "failed"
    assert_prefill_released(prefill)
    # Every wait of the parent and the prefill (the decode is dead) was given at most the timeout,
    # each step's wait its own (pd-demo --kill-decode-after 1 once ran 197 s past --timeout 20).
    waits = report["waits"] + prefill["waits"]
    assert all(0 <= seconds <= spec["timeout_s"] for _, seconds in waits), waits
    assert {"prefill addresses", "prefill report", "the prefill process's end", "the decode process's end",
            "decode pid from the parent", "the killed decode's end"} <= {what for what, _ in waits}


def test_an_unknown_engine_is_refused_naming_the_table():
    with pytest.raises(ValueError, match=r"argument `engine` must be one of \('nixl', 'mooncake'\), got 'ucx'"):
        open_backend("ucx")
    with pytest.raises(ValueError, match="argument `engine`"):
        load_engine("ucx")

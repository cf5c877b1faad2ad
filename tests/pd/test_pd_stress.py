"""The PP and HiSparse PD scenarios, repeated under CPU load on every engine: every byte arrives.

A fresh-clone CI run on a loaded 2-core machine once saw a room reported as a success whose 18
regions all held other bytes (while another deployment's ``pd-demo --engine mooncake`` ran on the
same host). Since then every room's regions are hashed on the prefill and checked on the decode,
each deployment has its own secret and each decode its own session id in every notification
(docs/pd.md, "PD trust model"). This test repeats the scenarios under busy-loop CPU hogs, one per core:
the default profile runs one PP=2 session per engine of the table, NIXL's with the device (non-HiSparse)
decode and Mooncake's with a HiSparse decode (some 30 s); ``--slow`` runs 10 rounds of both decode kinds per
engine. A failure names the session and its rooms.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pd_cpu_lock import hold_cpu_load_lock
from test_pd_engines import EVERY_ENGINE, SMALL, engine_session

from sparsekv.srt.disaggregation.engines import ENGINES
from sparsekv.testing.pd_session import verdict


@pytest.fixture
def cpu_load():
    """One busy-looping process per core for the test's duration (ours, stopped by pid), while no
    other PD test runs (conftest: their timeouts are not this test's subject)."""
    with hold_cpu_load_lock(exclusive=True):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        yield
        for hog in hogs:
            hog.kill()
            hog.wait(10)


def _rounds(request, engine: str) -> tuple[int, list[bool]]:
    """``--slow``: 10 rounds of both decode kinds; by default one session of one kind, the engines of the
    table taking turns (NIXL the device decode, Mooncake the HiSparse one), so CI stresses both kinds."""
    slow = request.config.getoption("--slow")
    return (10, [False, True]) if slow else (1, [list(ENGINES).index(engine) % 2 == 1])


def _check(report: dict, what: str) -> None:
    decode, prefill = report["decode"], report["prefill"]
    assert decode.get("mismatched") == {}, (what, decode.get("mismatched"))
    assert all(r["status"] == "success" for r in decode["rooms"].values()), (what, decode["rooms"])
    assert verdict(report), (what, {r: v["status"] for r, v in prefill["rooms"].items()})


@pytest.mark.parametrize("engine", EVERY_ENGINE)
def test_pp_and_hisparse_sessions_arrive_byte_for_byte_under_load(engine, cpu_load, request):
    rounds, modes = _rounds(request, engine)
    for i in range(rounds):
        for hisparse in modes:
            report = engine_session({**SMALL, "engine": engine, "pp_size": 2, "hisparse": hisparse, "seed": i})
            _check(report, f"{engine} round {i} hisparse={hisparse}")

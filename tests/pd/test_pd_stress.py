"""The PP and HiSparse PD scenarios, repeated under CPU load on both engines: every byte arrives.

A fresh-clone CI run on a loaded 2-core machine once saw a room reported as a success whose 18
regions all held other bytes (while another deployment's ``pd-demo --engine mooncake`` ran on the
same host). Since then every room's regions are hashed on the prefill and checked on the decode,
each deployment has its own secret and each decode its own session id in every notification
(docs/pd.md, "PD trust model"). This test repeats the scenarios under busy-loop CPU hogs, one per core:
the default profile runs one PP=2 session per engine, NIXL's with the device (non-HiSparse) decode and
Mooncake's with a HiSparse decode (some 30 s); ``--slow`` runs 10 rounds of both decode kinds per
engine. A failure names the session and its rooms.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pd_cpu_lock import hold_cpu_load_lock
from test_pd_mooncake import SMALL, needs_mooncake, run_isolated  # the namespaced child runner

from sparsekv.cli.pd_demo import DemoSpec, run_session, verdict
from sparsekv.testing import components

needs_nixl = components.needs_nixl()


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


def _rounds(request, default_hisparse: bool) -> tuple[int, list[bool]]:
    """``--slow``: 10 rounds of both decode kinds; by default one session of ``default_hisparse``'s kind (the
    two engines take one kind each, so CI stresses both the device decode and the HiSparse one)."""
    slow = request.config.getoption("--slow")
    return (10, [False, True]) if slow else (1, [default_hisparse])


def _check(report: dict, what: str) -> None:
    decode, prefill = report["decode"], report["prefill"]
    assert decode.get("mismatched") == {}, (what, decode.get("mismatched"))
    assert all(r["status"] == "success" for r in decode["rooms"].values()), (what, decode["rooms"])
    assert verdict(report), (what, {r: v["status"] for r, v in prefill["rooms"].items()})


@needs_nixl
def test_pp_and_hisparse_sessions_arrive_byte_for_byte_under_load_nixl(cpu_load, request):
    rounds, modes = _rounds(request, default_hisparse=False)
    for i in range(rounds):
        for hisparse in modes:
            spec = DemoSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in SMALL.items()
                               if k != "engine"}, pp_size=2, hisparse=hisparse, engine="nixl", seed=i)
            _check(run_session(spec), f"nixl round {i} hisparse={hisparse}")


@needs_mooncake
def test_pp_and_hisparse_sessions_arrive_byte_for_byte_under_load_mooncake(cpu_load, request):
    rounds, modes = _rounds(request, default_hisparse=True)
    for i in range(rounds):
        for hisparse in modes:
            report = run_isolated("scenario_session", {**SMALL, "pp_size": 2, "hisparse": hisparse, "seed": i})
            _check(report, f"mooncake round {i} hisparse={hisparse}")

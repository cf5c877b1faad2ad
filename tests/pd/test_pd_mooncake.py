"""The Mooncake transfer backend: two real processes over Mooncake TE/TCP on 127.0.0.1 (the
``sparsekv pd-demo`` roles) move DSV4 pools byte for byte (PP stages, with and without HiSparse
decode); a decode killed mid-transfer fails the transfer on the prefill side, which frees what it
registered and held; a row outside the registered regions of either side is refused before anything
is posted (Mooncake itself sends from any mapped source address); notifications arrive in order,
each after its write's data. The range check itself is compared with a brute-force reference.

Mooncake's handshake and data listeners bind ``0.0.0.0`` whatever host the engine is given. So
every test that starts an engine runs in a child process inside a private network namespace that
holds only ``lo`` (``unshare -n``, or ``unshare -rn`` without root) where the machine allows one,
and directly otherwise (all its traffic still goes to 127.0.0.1 either way). The child runs one of
the ``scenario_*`` functions of this file and prints its result as JSON; the tests check it.

The engine tests skip, with the reason, only where Mooncake cannot be imported.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.mooncake_backend import RegionTable, check_rows
from sparsekv.testing import components

needs_mooncake = components.needs_mooncake()  # the only reason the engine tests may skip (CI: fail)

SMALL = {"num_layers": 6, "budget_mib": 16, "seq_lens": [1000, 3000, 700, 200], "timeout_s": 30.0,
         "engine": "mooncake"}
CHILD_TIMEOUT_S = 150


@functools.cache
def _netns_prefix() -> list[str]:
    """A command prefix that runs its command in a new network namespace with ``lo`` up; [] if none works."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    for unshare in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            probe = subprocess.run([*unshare, "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", 'ip link set lo up && exec "$@"', "netns"]
    return []  # no namespace here: run directly (the engines still talk over 127.0.0.1 only)


_RUNNER = ("import json, runpy, sys; m = runpy.run_path(sys.argv[1]); "
           "print(json.dumps(m[sys.argv[2]](*json.loads(sys.argv[3])), default=str))")


def run_isolated(scenario: str, *args, engine_wait_s: int = 30) -> dict:
    """``scenario(*args)`` of this file, run in a child process (in a private network namespace
    where possible); its JSON result. The engine bounds its wait for a batch by
    ``MC_TRANSFER_TIMEOUT`` from the environment (no API sets it): ``engine_wait_s`` in the child."""
    argv = [sys.executable, "-c", _RUNNER, str(Path(__file__).resolve()), scenario, json.dumps(args)]
    done = subprocess.run([*_netns_prefix(), *argv], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env={**os.environ, "MC_TRANSFER_TIMEOUT": str(engine_wait_s)})
    assert done.returncode == 0, f"{scenario} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- what the child processes run ----------------------------------------------------------------


def scenario_session(spec: dict) -> dict:
    """One pd-demo session (two more processes) and its verdict."""
    from sparsekv.cli.pd_demo import DemoSpec, run_session, verdict

    report = run_session(DemoSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}))
    report["verdict"] = verdict(report)
    return report


def _pair():
    """Two connected endpoints in this process: ``a`` writes into ``b``; each has a 1 MiB buffer
    registered (random on ``a``, zeros on ``b``) and ``a`` one more unregistered buffer."""
    from sparsekv.srt.disaggregation.mooncake_backend import MooncakeBackend

    a, b = MooncakeBackend("a", timeout_s=10.0), MooncakeBackend("b", timeout_s=10.0)
    src = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    stray = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    a.register([(src.ctypes.data, src.nbytes, "DRAM")])
    b.register([(dst.ctypes.data, dst.nbytes, "DRAM")])
    peer = a.connect(b.descriptor())
    return a, b, peer, src, dst, stray


def _wait(handle, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while handle.status() == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return handle.status()


def _rows(src: np.ndarray, dst: np.ndarray, src_off, dst_off, nbytes) -> np.ndarray:
    return np.stack([src.ctypes.data + np.asarray(src_off, dtype=np.uint64),
                     dst.ctypes.data + np.asarray(dst_off, dtype=np.uint64),
                     np.asarray(nbytes, dtype=np.uint64)], axis=1).astype(np.uint64)


def scenario_refusals() -> dict:
    """Bad writes are refused before anything is posted; then a good one lands; then the peer dies."""
    a, b, peer, src, dst, stray = _pair()
    k = 4096
    good = _rows(src, dst, [0, k, 2 * k, 3 * k], [5 * k, 7 * k, 9 * k, 11 * k], [k] * 4)
    cases = {}
    bad_src = good.copy()
    bad_src[2, 0] = src.ctypes.data + src.nbytes - 100  # runs 3996 B past the source region
    bad_stray = good.copy()
    bad_stray[3, 0] = stray.ctypes.data  # mapped memory, but never registered
    bad_dst = good.copy()
    bad_dst[1, 1] = dst.ctypes.data + dst.nbytes  # starts at the end of the peer's region
    for name, rows, kwargs in [("src_past_end", bad_src, {}), ("src_unregistered", bad_stray, {}),
                               ("dst_past_end", bad_dst, {}), ("device_memory", good, {"dst_kind": "VRAM"})]:
        try:
            a.write(peer, rows, **{"src_kind": "DRAM", "dst_kind": "DRAM", **kwargs}, notif=name.encode())
            cases[name] = "accepted"
        except TransferError as e:
            cases[name] = str(e)
    try:
        a.write("nobody", good, src_kind="DRAM", dst_kind="DRAM")
        cases["unknown_peer"] = "accepted"
    except TransferError as e:
        cases["unknown_peer"] = str(e)
    result = {"cases": cases, "handles_after_refusals": a.open_handles}
    # The good write is the barrier: notifications arrive in order, each after its write's data, so a
    # refused write that was posted anyway (each carries a notification) would land and notify first.
    handle = a.write(peer, good, src_kind="DRAM", dst_kind="DRAM", notif=b"good")
    result["good_status"] = _wait(handle)
    handle.release()
    expected = np.zeros_like(dst)
    for s, d in zip(range(0, 4 * k, k), range(5 * k, 13 * k, 2 * k)):
        expected[d : d + k] = src[s : s + k]
    deadline = time.monotonic() + 10
    notifs: list[str] = []
    while "a:good" not in notifs and time.monotonic() < deadline:
        notifs += [f"{p}:{m.decode()}" for p, ms in b.get_notifs().items() for m in ms]
        time.sleep(0.001)
    result["notifs_through_good"] = notifs
    result["good_landed"] = bool(np.array_equal(dst, expected))  # and nothing anywhere else
    b.close()  # the peer goes away: a write to it fails within the engine's bound
    try:
        handle = a.write(peer, good, src_kind="DRAM", dst_kind="DRAM", notif=b"late")
        # The engine's bound is MC_TRANSFER_TIMEOUT (10 s here); a write still in flight when this
        # wait gives up, twice that later, reads "PROC".
        result["dead_peer_status"] = _wait(handle, 20.0)
        handle.release()
    except TransferError as e:
        result["dead_peer_status"] = f"refused: {e}"
    a.close()
    a.close()  # idempotent
    result["registered_after_close"] = len(a.registered) + len(b.registered)
    result["handles_after_close"] = a.open_handles
    return result


def scenario_notif_order() -> dict:
    """Two writes of 3000 rows each (three sub-batches) and a plain notification: at the moment
    each notification is seen, is its write's data all there?"""
    a, b, peer, src, dst, _ = _pair()
    n, item = 3000, 128  # 3000 rows: sub-batches of 1024, 1024 and 952
    order = np.random.default_rng(2).permutation(n)
    writes = {"w1": _rows(src, dst, order * item, np.arange(n) * item, [item] * n),
              "w2": _rows(src, dst, (order + n) * item, (np.arange(n) + n) * item, [item] * n)}
    expected = {"w1": src[(order[:, None] * item + np.arange(item)).ravel()],
                "w2": src[((order + n)[:, None] * item + np.arange(item)).ravel()]}
    landed = {"w1": slice(0, n * item), "w2": slice(n * item, 2 * n * item)}
    handles = [a.write(peer, rows, src_kind="DRAM", dst_kind="DRAM", notif=name.encode())
               for name, rows in writes.items()]
    seen, complete_when_seen, sent_after = [], {}, False
    deadline = time.monotonic() + 20
    while len(seen) < 3 and time.monotonic() < deadline:
        if not sent_after and all(h.status() == "DONE" for h in handles):
            a.send_notif(peer, b"after")  # sent after both writes completed: must arrive last
            sent_after = True
        for sender, messages in b.get_notifs().items():
            for m in messages:
                name = m.decode()
                seen.append(f"{sender}:{name}")
                if name in landed:
                    complete_when_seen[name] = bool(np.array_equal(dst[landed[name]], expected[name]))
        time.sleep(0.0005)
    # Nothing more may come (no duplicates): a last notification closes the stream, in order.
    a.send_notif(peer, b"end")
    while "a:end" not in seen and time.monotonic() < deadline + 10:
        seen += [f"{p}:{m.decode()}" for p, ms in b.get_notifs().items() for m in ms]
        time.sleep(0.0005)
    statuses = [h.status() for h in handles]
    for h in handles:
        h.release()
    a.close()
    b.close()
    return {"seen": seen, "complete_when_seen": complete_when_seen, "statuses": statuses}


# ---- the tests -------------------------------------------------------------------------------------


def assert_prefill_released(prefill: dict) -> None:
    assert prefill["open_handles"] == 0
    assert prefill["registered_after_close"] == 0
    assert prefill["rooms_still_held"] == []


@needs_mooncake
@pytest.mark.parametrize("hisparse", [False, True],
                         ids=["device-decode", "hisparse-decode"])
def test_pp_stages_arrive_byte_for_byte(hisparse):
    # Room 3 asks for one SWA destination too many: both sides refuse it before any write.
    report = run_isolated("scenario_session", {**SMALL, "pp_size": 2, "hisparse": hisparse, "bad_rooms": [3]})
    prefill, decode = report["prefill"], report["decode"]
    assert report["spec"]["engine"] == "mooncake"
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


@needs_mooncake
def test_decode_killed_mid_transfer_fails_the_transfer_on_prefill():
    spec = {**SMALL, "pp_size": 1, "budget_mib": 32, "seq_lens": [5000, 700], "kill_decode_after": 2,
            "max_inflight": 1, "max_batch_rows": 4}
    report = run_isolated("scenario_session", spec)
    prefill, decode = report["prefill"], report["decode"]
    assert decode.get("killed") is True
    room = prefill["rooms"]["1"]
    assert room["status"] == "failed"
    # One batch in flight at a time: the decode died after the second, so the third fails.
    assert "room 1: transfer failed after 2/" in room["error"], room["error"]
    assert prefill["failure_detected_after_kill_s"] < spec["timeout_s"]
    assert prefill["rooms"]["2"]["status"] == "failed"
    assert_prefill_released(prefill)


@needs_mooncake
def test_bad_rows_are_refused_before_anything_is_posted():
    result = run_isolated("scenario_refusals", engine_wait_s=10)
    cases = result["cases"]
    assert "row 2 (source" in cases["src_past_end"] and "registered on this side" in cases["src_past_end"]
    assert "row 3 (source" in cases["src_unregistered"]
    assert "row 1 (destination" in cases["dst_past_end"] and "peer 'b'" in cases["dst_past_end"]
    assert all("nothing was posted" in cases[c] for c in ("src_past_end", "src_unregistered", "dst_past_end"))
    assert "host memory (DRAM) only" in cases["device_memory"]
    assert "'nobody' is not connected" in cases["unknown_peer"]
    assert result["handles_after_refusals"] == 0
    assert result["good_status"] == "DONE" and result["good_landed"] is True
    assert result["notifs_through_good"] == ["a:good"]  # no refused write notified before it
    # A dead peer fails the write within the engine's bound, never hangs: a write still running
    # when the scenario's bounded wait gave up would read "PROC".
    assert result["dead_peer_status"] == "ERR" or result["dead_peer_status"].startswith("refused")
    assert result["registered_after_close"] == 0 and result["handles_after_close"] == 0


@needs_mooncake
def test_notifications_arrive_in_order_after_their_data():
    result = run_isolated("scenario_notif_order", engine_wait_s=10)
    assert result["statuses"] == ["DONE", "DONE"]
    assert result["seen"] == ["a:w1", "a:w2", "a:after", "a:end"]
    assert result["complete_when_seen"] == {"w1": True, "w2": True}


# ---- the range check, no engine needed -------------------------------------------------------------

spans = st.lists(st.tuples(st.integers(0, 200), st.integers(1, 60)), max_size=6)
row_lists = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 80)), min_size=1, max_size=20)


@given(spans, row_lists)
def test_region_table_matches_a_brute_force_check(regions, rows):
    table = RegionTable(regions)
    addrs = np.array([a for a, _ in rows], dtype=np.uint64)
    nbytes = np.array([n for _, n in rows], dtype=np.uint64)
    expected = [not any(p <= a and a + n <= p + size for p, size in regions) for a, n in rows]
    assert table.outside(addrs, nbytes).tolist() == expected


def test_check_rows_names_the_first_bad_row_and_side():
    local, remote = RegionTable([(1000, 100)]), RegionTable([(5000, 100), (5100, 100)])
    ok = np.array([[1000, 5000, 100], [1050, 5150, 50]], dtype=np.uint64)
    check_rows(ok, local, remote, "peer0")  # inside, on both sides
    spanning = np.array([[1000, 5000, 10], [1000, 5050, 100]], dtype=np.uint64)  # across two adjacent regions
    with pytest.raises(TransferError, match=r"row 1 \(destination 0x13ba, 100 B\).*peer 'peer0' \(1 of 2 rows"):
        check_rows(spanning, local, remote, "peer0")
    past = np.array([[1099, 5000, 2], [1100, 5000, 1]], dtype=np.uint64)
    with pytest.raises(TransferError, match=r"row 0 \(source 0x44b, 2 B\).*this side \(2 of 2 rows"):
        check_rows(past, local, remote, "peer0")
    with pytest.raises(TransferError, match="row 0"):
        check_rows(ok, RegionTable([]), remote, "peer0")  # nothing registered: every row is outside


def test_open_backend_refuses_an_unknown_engine():
    from sparsekv.srt.disaggregation.engines import load_engine, open_backend

    with pytest.raises(ValueError, match=r"argument `engine` must be one of \('nixl', 'mooncake'\), got 'ucx'"):
        open_backend("ucx")
    with pytest.raises(ValueError, match="argument `engine`"):
        load_engine("ucx")


def test_missing_system_libraries_are_named(tmp_path):
    # A fresh process whose library directory is empty: it loads only if the system has the
    # libraries itself; otherwise the error names each missing one and how to get it.
    code = ("import ctypes, json\n"
            "try:\n    ctypes.CDLL('libibverbs.so.1'); system = True\nexcept OSError:\n    system = False\n"
            "from sparsekv.srt.disaggregation.mooncake_backend import load_mooncake_engine\n"
            "try:\n    load_mooncake_engine(); error = ''\nexcept ImportError as e:\n    error = str(e)\n"
            "print(json.dumps({'system': system, 'error': error}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPARSEKV_MOONCAKE_LIBDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if importlib.util.find_spec("mooncake") is None:
        assert "Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda" in result["error"]
    elif result["system"]:
        assert result["error"] == ""
    else:
        assert "libibverbs.so.1" in result["error"] and str(tmp_path) in result["error"]
        assert "apt-get install libibverbs1" in result["error"] and "fetch_mooncake_libs.sh" in result["error"]

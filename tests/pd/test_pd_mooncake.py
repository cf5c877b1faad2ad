"""What only the Mooncake backend does (the engine contract, every engine's sessions, is
``test_pd_engines.py``): a row outside the registered regions of either side is refused before
anything is posted (Mooncake itself sends from any mapped source address); notifications arrive in
order, each after its write's data; missing system libraries are named. The range check itself is
compared with a brute-force reference.

Every test that starts an engine runs it in a child process in a private network namespace where
the machine allows one (:mod:`pd_isolation`: Mooncake's listeners bind every interface); the child
runs one of the ``scenario_*`` functions of this file and prints its result as JSON; the tests
check it. The engine tests skip, with the reason, only where Mooncake cannot be imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pd_isolation import run_isolated

from sparsekv.srt.disaggregation.backend import TransferError
from sparsekv.srt.disaggregation.mooncake_backend import RegionTable, check_rows
from sparsekv.testing import components

needs_mooncake = components.needs_engine("mooncake")  # the only reason the engine tests may skip (CI: fail)

# ---- what the child processes run ----------------------------------------------------------------


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


@needs_mooncake
def test_bad_rows_are_refused_before_anything_is_posted():
    result = run_isolated(__file__, "scenario_refusals", engine_wait_s=10)
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
    result = run_isolated(__file__, "scenario_notif_order", engine_wait_s=10)
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

"""``sparsekv demo --pd``: the demo's prefill in one process, its decode in another, KV over NIXL.

The prefill process builds the all-resident stack, prefills the requests and serves them with a
:class:`~sparsekv.srt.disaggregation.conn.KVSender`: per request its full-token pages (C4 KV, C4
indexer keys, C128 KV), its SWA pages with their C4 compressor rings, and its request slot's C128
compressor ring. The decode process builds the HiSparse stack, allocates the destinations (logical
pages; host pages for the C4 KV, which lands straight in the host pool), receives every room over
NIXL on 127.0.0.1 (each region checked against the prefill's digest), admits the requests
(``admit_request_direct``), continues the compressors where the prefill stopped, and decodes. Its
outputs go back to the parent, which compares them with the single-process run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

TIMEOUT_S = 120.0


def _recv(conn, proc, what: str):
    """The next message from ``proc``; an error if it reported one, died, or stayed silent too long."""
    deadline = time.monotonic() + TIMEOUT_S
    while not conn.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"sparsekv demo --pd: the {what} exited (code {proc.exitcode}) without reporting")
        if time.monotonic() > deadline:
            raise TimeoutError(f"sparsekv demo --pd: no message from the {what} within {TIMEOUT_S:.0f} s")
    message = conn.recv()
    if isinstance(message, dict) and "error" in message:
        raise RuntimeError(f"sparsekv demo --pd: the {what} failed: {message['error']}")
    return message


def _stack(spec, hisparse):
    import torch

    from sparsekv.cli.demo.model import DemoModel, ModelShape
    from sparsekv.cli.demo.stack import Stack

    torch.set_num_threads(1)
    model = DemoModel(ModelShape(), spec.seed)
    return Stack(model, tokens=max(spec.prompts()) + spec.steps, requests=spec.requests, hisparse=hisparse,
                 hot_buffer=spec.hot_buffer, check=False, impl=spec.impl)


def prefill_main(spec, conn) -> None:
    """Prefill every request, then send each room the decode asks for."""
    from sparsekv.cli.demo.stack import PAGE_SIZE, Request
    from sparsekv.srt.disaggregation.engines import open_backend
    from sparsekv.srt.disaggregation.room import RoomStatus
    from sparsekv.srt.disaggregation.sender import KVSender
    from sparsekv.srt.disaggregation.state_routing import kv_args_of

    try:
        stack = _stack(spec, None)
        reqs = [Request(i + 1, 0) for i in range(spec.requests)]
        for req, n in zip(reqs, spec.prompts()):
            stack.prefill(req, n)
        backend = open_backend("nixl", f"demo-prefill-{os.getpid()}", timeout_s=30.0)
        sender = KVSender(kv_args_of(stack.pool), backend, timeout_s=30.0)
        conn.send({"address": sender.address})
        for req in reqs:
            pages = [req.locs[p] // PAGE_SIZE for p in range(0, len(req.locs), PAGE_SIZE)]
            sender.add_request(req.req_pool_idx, pages, [req.swa_pages, [req.req_pool_idx]])
        statuses = {req.req_pool_idx: sender.wait(req.req_pool_idx, TIMEOUT_S) for req in reqs}
        sent = sum(sender.stats(req.req_pool_idx)[0] for req in reqs)
        # The decode may still be reading its last statuses: close once it has finished.
        if not conn.poll(TIMEOUT_S):
            raise TimeoutError(f"sparsekv demo --pd: the decode did not finish within {TIMEOUT_S:.0f} s")
        conn.recv()
        sender.close()
        backend.close()
        conn.send({"ok": all(s == RoomStatus.SUCCESS for s in statuses.values()), "bytes": sent,
                   "statuses": {r: s.name for r, s in statuses.items()}})
    except BaseException as e:  # reported to the parent, which raises it
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def decode_main(spec, conn, address) -> None:
    """Receive every request into the HiSparse stack, admit it, decode; send the outputs back."""

    from sparsekv.cli.demo.stack import Request
    from sparsekv.srt.disaggregation.engines import open_backend
    from sparsekv.srt.disaggregation.hisparse_direct import alloc_direct_host_pages, hisparse_decode_kv_args
    from sparsekv.srt.disaggregation.receiver import KVReceiver

    try:
        stack = _stack(spec, spec.hisparse)
        receiver = KVReceiver(hisparse_decode_kv_args(stack.pool, stack.coordinator),
                              open_backend("nixl", f"demo-decode-{os.getpid()}", timeout_s=30.0), [address],
                              timeout_s=30.0, checksums=True)  # every region's digest checked on arrival
        reqs = [Request(i + 1, 0) for i in range(spec.requests)]
        start = time.perf_counter()
        for req, n in zip(reqs, spec.prompts()):
            pages = stack.adopt(req, n)
            host_pages = alloc_direct_host_pages(stack.coordinator, req, len(pages))
            receiver.request(req.req_pool_idx, pages, [req.swa_pages, [req.req_pool_idx]], {"c4_kv": host_pages})
        for req in reqs:
            receiver.wait(req.req_pool_idx)
            stack.coordinator.admit_request_direct(req)
        transfer_s = time.perf_counter() - start
        receiver.close()
        stack.coordinator.read_counters(reset=True)
        outputs = []
        for _ in range(spec.steps):
            out, _ = stack.decode_step(reqs)
            outputs.append([o.cpu() for o in out])
        conn.send({"outputs": [[o.numpy() for o in step] for step in outputs], "transfer_s": transfer_s})
    except BaseException as e:  # reported to the parent, which raises it
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def run_pd(spec) -> dict:
    """Run the two processes; ``{"outputs", "transfer_ok", "bytes", "transfer"}``.

    Raises
    ------
    RuntimeError, TimeoutError
        A process failed (its error in the message) or did not report in time.
    """
    import torch

    from sparsekv.testing.pd_session import reap

    ctx = mp.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    d_parent, d_child = ctx.Pipe()
    prefill = ctx.Process(target=prefill_main, args=(spec, p_child), daemon=True)
    prefill.start()
    decode = None
    try:
        address = _recv(p_parent, prefill, "prefill process")["address"]
        decode = ctx.Process(target=decode_main, args=(spec, d_child, address), daemon=True)
        decode.start()
        decoded = _recv(d_parent, decode, "decode process")
        p_parent.send({"decode_done": True})
        sent = _recv(p_parent, prefill, "prefill process")
    finally:
        reap(prefill, decode)
    outputs = [[torch.from_numpy(o) for o in step] for step in decoded["outputs"]]
    return {"outputs": outputs, "transfer_ok": sent["ok"], "bytes": sent["bytes"],
            "transfer": {"statuses": sent["statuses"], "seconds": decoded["transfer_s"]}}

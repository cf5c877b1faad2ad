"""Benchmark the host cost of planning a compressor step: ``CompressorState.extend``, old planner vs the device plan.

``extend`` plans each raw-ring step's event sources and ring writes. The planner it had before
(``plan_raw_reference``, kept as this benchmark's baseline) looped in Python over every event and
window slot, asked ``entry_slots`` for each event's slot, and copied three tables from pageable
memory; the device plan (``CompressorState.plan_raw``) hands a few ints per request to one small
kernel and calls ``entry_slots`` once with tensors.

Cases: one request's prefill chunk of T tokens in {256, 4k, 32k} (``--quick``: 256 and 4k), C4 and
C128, d = 512, fused with a V4 store (``store=``) and without. Per case, host microseconds of:

* ``old_stubbed_us`` / ``stubbed_us``: the whole ``extend`` with the compressor kernel replaced by
  a no-op, old planner (the baseline) and new (what the issue's 5.2 ms at 4k tokens measured);
* ``plan_us``: the new planning alone (``plan_raw`` and the ``entry_slots`` call);
* ``host_us``: ``stubbed_us`` with the planning kernel stubbed too: the host cost on a GPU, where
  both kernels run asynchronously (on the cpu backend the planning kernel is host work, linear in
  the events: 32k C4 tokens plan 64k window slots);
* ``extend_us``: ``extend`` with the kernels (on the cpu backend the kernel's own work is host
  time too; on the cuda backend the call returns before the kernel ends: host time, not device time).
  Runs at T <= 4k only on the cpu backend (the kernel alone takes a second at 32k there).

Each figure is the fastest of the repeats (each a loop of at least 20 ms): host cost, least
disturbed by other processes on a shared machine. ``speedup`` is ``old_stubbed_us / stubbed_us``,
``host_speedup`` ``old_stubbed_us / host_us``; ``flat`` is ``host_us`` over the same case's at 256
tokens (1.0: the host cost does not grow with the token count). Prints JSON; ``--plot PNG`` draws
the speedups per case.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

import sparsekv.srt.mem_cache.compressor_state as compressor_state
from sparsekv.cli import CliParser
from sparsekv.jit_kernel.dsv4 import RopeParams, StoreTarget
from sparsekv.jit_kernel.dsv4_compress import window
from sparsekv.kv_layout import V4
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import device_of
from sparsekv.testing.bench import bar_plot, open_sweep, time_call
from sparsekv.testing.reference.dsv4_compress import plan_raw_reference

D = 512
PAGE = 64
TOKENS = (256, 4096, 32768)
QUICK_TOKENS = (256, 4096)
CASES = tuple((t, ratio, store) for t in TOKENS for ratio in (4, 128) for store in (True, False))
QUICK_CASES = tuple(case for case in CASES if case[0] in QUICK_TOKENS)
ROPE = RopeParams(160000, 16, 65536, 32, 1)


def _old_extend(comp: CompressorState, kv, score, store, entry_slots, run) -> None:
    """``extend`` of one request's first chunk as it ran before the device plan: the host planner,
    one ``entry_slots`` call per event, three tables copied from pageable memory, then ``run``."""
    device, ratio = kv.device, comp.ratio
    sources, writes, anchors, event_requests = plan_raw_reference([[1]], [0], [kv.shape[0]], ratio, comp.ring_size,
                                                                  None)
    src, wr = sources.to(device), writes.to(device)
    if store is not None:
        slots = torch.tensor([int(entry_slots(b, a)) for b, a in zip(event_requests.tolist(), anchors.tolist())],
                             dtype=torch.int64, device=device)
        run(kv, score, comp.ape, ratio, comp.state, src, wr, anchors.to(device), slots, store)
    else:
        out = torch.empty(src.shape[0], D, dtype=torch.float32, device=device)
        run(kv, score, comp.ape, ratio, comp.state, src, wr, out)


def _noop(*args, **kwargs) -> None:
    return None


def run_case(t: int, ratio: int, with_store: bool, repeats: int, backend: str, at_256: dict) -> dict:
    device = device_of(backend)
    coff = 2 if ratio == 4 else 1
    gen = torch.Generator().manual_seed(t + ratio)
    kv, score, ape = (torch.randn(shape, generator=gen).to(device)
                      for shape in ((t, coff * D), (t, coff * D), (ratio, coff * D)))
    ring = 2 * window(ratio)
    state = torch.zeros(2 * ring, 2 * coff * D, device=device)
    cache = torch.zeros(t // ratio // PAGE + 1, V4.page_bytes(PAGE), dtype=torch.uint8, device=device)
    store = StoreTarget(cache, (torch.rand(D) + 0.5).to(device), 1e-6, PAGE, ROPE.table(t, device)) if with_store \
        else None
    kernel = "compress_store_step" if with_store else "compress_extend"
    kwargs = dict(store=store, entry_slots=lambda _b, anchor: anchor // ratio) if with_store else {}

    comp = CompressorState(state, ape, ratio, ring_size=ring)

    def new(stub: bool = True, stub_plan: bool = False):
        with contextlib.ExitStack() as stubs:
            if stub:
                stubs.enter_context(mock.patch.object(compressor_state, kernel, _noop))
            if stub_plan:
                stubs.enter_context(mock.patch.object(compressor_state, "plan_raw_step", _noop))
            comp.extend([0], [[1]], [0], kv, score, **kwargs)
        comp.release(0)

    def new_plan():
        plan = comp.plan_raw([[1]], [0], [t], None, device)
        if with_store:
            kwargs["entry_slots"](plan.event_requests, plan.anchors)

    def old(run=_noop):
        _old_extend(comp, kv, score, store, lambda _b, anchor: anchor // ratio, run)

    def time_us(fn) -> float:  # the fastest sample: host cost, least disturbed by other processes
        return time_call(fn, repeats=repeats, min_time_s=0.02).min_s * 1e6

    row = {"case": f"C{ratio} T={t} {'store' if with_store else 'entries'}", "tokens": t, "ratio": ratio,
           "store": with_store, "old_stubbed_us": time_us(old), "plan_us": time_us(new_plan),
           "stubbed_us": time_us(new), "host_us": time_us(lambda: new(stub_plan=True))}
    row["speedup"] = row["old_stubbed_us"] / row["stubbed_us"]
    row["host_speedup"] = row["old_stubbed_us"] / row["host_us"]
    key = (ratio, with_store)
    at_256.setdefault(key, row["host_us"])
    row["flat"] = row["host_us"] / at_256[key]
    if backend != "cpu" or t <= 4096:
        row["extend_us"] = time_call(lambda: new(stub=False), repeats=repeats, min_time_s=0.0).median_s * 1e6
    return row


def main() -> None:
    sweep = open_sweep(CliParser(description=__doc__.splitlines()[0]), stem="dsv4_compress_plan",
                       name="dsv4_compress step planning (host time, d=512)",
                       baseline="the host planner extend used before (plan_raw_reference, per-event entry_slots)",
                       baseline_threads=1,
                       notes=dict(timing="host clock (time.perf_counter) on every backend: this is host cost; "
                                         "on the cuda backend the kernels run asynchronously and are not in it",
                                  stub="the compressor kernel replaced by a no-op (the planning kernel runs)"))
    at_256: dict = {}
    for case in sweep.cases(CASES, QUICK_CASES):
        sweep.result.rows.append(run_case(*case, sweep.repeats, sweep.args.backend, at_256))
    sweep.report(lambda r, path: bar_plot(r, path, label_key="case", value_keys=("speedup", "host_speedup"),
                                          ylabel="host-time speedup over the old planner"))


if __name__ == "__main__":
    main()

"""Host streams: deferred work runs in order when waited for, and a failing item neither blocks the
events behind it nor poisons the queue."""

from __future__ import annotations

import pytest

from sparsekv.srt.streams import CpuStream


def test_deferred_work_runs_in_order_when_waited_for():
    stream, ran = CpuStream(deferred=True), []
    stream.submit(lambda: ran.append(1))
    first = stream.record_event()
    stream.submit(lambda: ran.append(2))
    second = stream.record_event()
    assert ran == [] and not first.query()
    first.synchronize()
    assert ran == [1] and first.query() and not second.query()
    second.synchronize()
    assert ran == [1, 2]


def test_a_failing_item_completes_and_the_events_behind_it_still_do():
    stream, ran = CpuStream(deferred=True), []

    def fails():
        raise RuntimeError("copy failed")

    stream.submit(fails)
    stream.submit(lambda: ran.append(1))
    event = stream.record_event()
    with pytest.raises(RuntimeError, match="copy failed"):
        event.synchronize()
    event.synchronize()  # the rest of the queue runs on the next wait
    assert ran == [1] and event.query()


def test_submit_takes_only_a_callable():
    stream = CpuStream(deferred=True)
    with pytest.raises(TypeError, match="fn"):
        stream.submit(None)
    assert stream.record_event().query()  # nothing was queued

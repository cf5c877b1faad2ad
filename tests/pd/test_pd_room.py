"""A room's states (one enum, one transition table), the room table's history, the wire schema of
every bootstrap message and the deadlines: pure Python, no engine."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.srt.disaggregation.deadlines import Deadlines
from sparsekv.srt.disaggregation.messages import ProtocolError
from sparsekv.srt.disaggregation.protocol import (
    KINDS,
    Bye,
    Cancel,
    Cancelled,
    Challenge,
    Hello,
    Notification,
    Proof,
    Refused,
    Status,
    Transfer,
    Welcome,
    decode,
)
from sparsekv.srt.disaggregation.room import TRANSITIONS, RoomState, RoomStatus, RoomTable


class _Record:
    def __init__(self, state: RoomState) -> None:
        self.state = state


def test_every_state_moves_only_as_the_table_says():
    for start in RoomState:
        for to in RoomState:
            table = RoomTable(history=4)
            table.add(1, _Record(start))
            if start.finished:  # a finished room is not live: it never changes
                table._finished[1] = table._live.pop(1)
                assert table.advance(1, to) is False and table.get(1).state == start
            elif to in TRANSITIONS[start]:
                assert table.advance(1, to) is True and table.get(1).state == to
            else:
                with pytest.raises(RuntimeError, match=f"from {start.value} to {to.value}"):
                    table.advance(1, to)
    assert {s for s in RoomState if s.finished} == {RoomState.SUCCESS, RoomState.FAILED}
    assert [s.status for s in RoomState] == [RoomStatus.PENDING] * 3 + [RoomStatus.SUCCESS, RoomStatus.FAILED]


@given(st.lists(st.tuples(st.sampled_from(["add", "claim", "succeed", "fail"]), st.integers(0, 5)), max_size=40),
       st.integers(1, 3))
def test_the_table_remembers_live_rooms_and_the_last_finished_ones(ops, history):
    table, live, finished = RoomTable(history), {}, []
    for op, room in ops:
        if op == "add":
            if room in live or room in finished:
                with pytest.raises(ValueError, match="already declared"):
                    table.add(room, _Record(RoomState.DECLARED))
                continue
            table.add(room, _Record(RoomState.DECLARED))
            live[room] = RoomState.DECLARED
        elif room in live:
            to = {"claim": RoomState.CLAIMED, "succeed": RoomState.SUCCESS, "fail": RoomState.FAILED}[op]
            if to not in TRANSITIONS[live[room]]:
                continue
            assert table.advance(room, to)
            live[room] = to
            if to.finished:
                del live[room]
                finished = [r for r in finished if r != room][-(history - 1):] + [room] if history > 1 else [room]
        else:
            assert table.advance(room, RoomState.FAILED) is False
    for room in range(6):
        expected = live.get(room) or (table.get(room).state if room in finished else None)
        assert (table.get(room).state if room in table else None) == expected
        assert (room in table) == (room in live or room in finished)


hex_text = st.integers(0, 15).map("0123456789abcdef".__getitem__)
messages = st.one_of(
    st.builds(Hello, st.text(max_size=8), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
              st.text(max_size=8), st.booleans(), st.just("") | st.text(hex_text, min_size=32, max_size=32),
              st.booleans()),
    st.builds(Challenge, st.text(hex_text, min_size=32, max_size=32), st.text(hex_text, min_size=64, max_size=64)),
    st.builds(Proof, st.text(hex_text, min_size=64, max_size=64)),
    st.builds(Cancel, st.integers(0, 2**63 - 1)),
    st.builds(Cancelled, st.integers(0, 2**63 - 1)),
    st.builds(Welcome, st.text(max_size=8), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)),
    st.builds(Refused, st.text(max_size=8)),
    st.builds(Transfer, st.integers(0, 2**63 - 1), st.lists(st.integers(0, 99), max_size=4),
              st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=3),
              st.dictionaries(st.text(max_size=3), st.lists(st.integers(0, 9), max_size=3), max_size=2)),
    st.builds(Status, st.integers(0, 99), st.booleans(), st.text(max_size=8), st.integers(0, 9), st.integers(0, 9),
              st.dictionaries(st.text(max_size=3), st.text(max_size=16), max_size=2), st.booleans()),
    st.just(Bye()),
)


@given(messages)
def test_every_message_decodes_to_what_was_encoded(message):
    wire = message.encode()
    assert wire["op"] == message.OP and KINDS[wire["op"]] is type(message)
    assert decode(wire, type(message)) == message


def test_decode_names_an_unknown_or_unexpected_op_and_a_bad_field():
    with pytest.raises(ProtocolError, match="unknown bootstrap op 7"):
        decode({"op": 7}, Transfer)
    with pytest.raises(ProtocolError, match="unexpected bootstrap op 'hello'.*expected transfer or bye"):
        decode(Hello("a", {}).encode(), Transfer, Bye)
    with pytest.raises(ProtocolError, match="`ok`"):
        decode({"op": "status", "room": 1}, Status)
    with pytest.raises(ProtocolError, match=r"`digests\['a'\]`"):
        decode({"op": "status", "room": 1, "ok": True, "digests": {"a": 5}}, Status)


def test_a_notification_round_trips_and_refuses_anything_else():
    for digests in (None, {}, {"c4_kv:5": "00ff", "state:1": "12"}):
        n = Notification("abc", 5000, 7, 0, 3, digests)
        assert Notification.decode(n.encode()) == n
    for bad in (b"abc:1:2:3", b"abc:1:2:3:x", b"\xff:1:2:3:4", b"abc:1:2:3:4\n[1]", b'abc:1:2:3:4\n{"a": 1}'):
        with pytest.raises(ProtocolError, match="not a room notification"):
            Notification.decode(bad)


def test_deadlines_name_each_wait_and_refuse_a_bad_bound():
    assert Deadlines.uniform(5) == Deadlines(5, 5, 5, 5, 5, 5, 5, 5)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="`write_s`"):
            Deadlines(write_s=bad)
    for bad in (True, "5"):
        with pytest.raises(TypeError, match="`write_s`"):
            Deadlines(write_s=bad)

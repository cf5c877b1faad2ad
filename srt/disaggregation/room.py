"""A room's life: one state enum, its transition table, and the table of rooms each side keeps.

A *room* is one request's transfer. On the prefill side a room is ``DECLARED`` by the scheduler
(where its data is), ``CLAIMED`` once a decode asks for it (planned, queued or being written),
then ``SUCCESS`` or ``FAILED``; a declared or claimed room may also be aborted (``FAILED``). On the
decode side a room is ``REQUESTED`` of every stage, then ``SUCCESS`` or ``FAILED``. A finished
room never changes again; asking for it again (decode) is a new room under the same id.

Callers see :class:`RoomStatus` (pending, success, failed). :class:`RoomTable` keeps the live
rooms and the last ``history`` finished ones, so a server's memory stays bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum
from typing import Generic, Protocol, TypeVar

from sparsekv.checks import int_in


class RoomStatus(str, Enum):
    """Where a room's transfer stands, as callers see it."""

    PENDING = "pending"
    SUCCESS = "success"
    FAILED = "failed"


class RoomState(str, Enum):
    """Where a room is in its life (see the module docstring)."""

    DECLARED = "declared"
    CLAIMED = "claimed"
    REQUESTED = "requested"
    SUCCESS = "success"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return not TRANSITIONS[self]

    @property
    def status(self) -> RoomStatus:
        return {RoomState.SUCCESS: RoomStatus.SUCCESS, RoomState.FAILED: RoomStatus.FAILED}.get(self,
                                                                                              RoomStatus.PENDING)


#: The states each state may move to; a finished state moves nowhere.
TRANSITIONS: dict[RoomState, frozenset[RoomState]] = {
    RoomState.DECLARED: frozenset({RoomState.CLAIMED, RoomState.FAILED}),
    RoomState.CLAIMED: frozenset({RoomState.SUCCESS, RoomState.FAILED}),
    RoomState.REQUESTED: frozenset({RoomState.SUCCESS, RoomState.FAILED}),
    RoomState.SUCCESS: frozenset(),
    RoomState.FAILED: frozenset(),
}


class Stateful(Protocol):
    state: RoomState


R = TypeVar("R", bound=Stateful)


class RoomTable(Generic[R]):
    """Rooms by id: every live one, and the last ``history`` finished ones (oldest forgotten first).

    Not thread-safe: each side guards its table with its own lock.
    """

    def __init__(self, history: int) -> None:
        self.history = int_in(history, "history", 1)
        self._live: dict[int, R] = {}
        self._finished: OrderedDict[int, R] = OrderedDict()  # oldest first

    def get(self, room: int) -> R | None:
        """The room's record, live or remembered; None if unknown or forgotten."""
        record = self._live.get(room)
        return record if record is not None else self._finished.get(room)

    def live_items(self) -> list[tuple[int, R]]:
        """``(room, record)`` of every live room, oldest first."""
        return list(self._live.items())

    def finished_items(self) -> list[tuple[int, R]]:
        """``(room, record)`` of every remembered finished room, oldest first."""
        return list(self._finished.items())

    def __contains__(self, room: int) -> bool:
        return room in self._live or room in self._finished

    def add(self, room: int, record: R, *, replace: bool = False) -> None:
        """Start a room (its record's ``state`` is its first state).

        Raises
        ------
        ValueError
            The room is known and ``replace`` is False.
        """
        if room in self and not replace:
            raise ValueError(f"sparsekv: room {room} is already declared")
        self._finished.pop(room, None)
        self._live[room] = record

    def advance(self, room: int, to: RoomState) -> bool:
        """Move a live room to state ``to``; False (nothing changes) if the room is unknown or finished.

        Raises
        ------
        RuntimeError
            ``to`` is not a transition the table allows from the room's state (a bug of the caller).
        """
        record = self._live.get(room)
        if record is None:
            return False
        if to not in TRANSITIONS[record.state]:
            raise RuntimeError(f"sparsekv: room {room} cannot go from {record.state.value} to {to.value}")
        record.state = to
        if to.finished:
            del self._live[room]
            self._finished[room] = record
            while len(self._finished) > self.history:
                self._finished.popitem(last=False)
        return True

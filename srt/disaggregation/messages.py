"""The schema of every bootstrap message a peer sends, checked before anything acts on it.

A peer's message is untrusted input: a connection thread must never die on it, and nothing it
names may be truncated or coerced (``"room": 1.9`` once became room 1, ``"room": "abc"`` killed the
connection and every room in flight on it). Each ``parse_*`` returns the message's fields in their
exact types or raises :class:`ProtocolError` naming the field; the caller answers that peer with one
refusal and carries on. Limits: integers are JSON integers (never bool or float) in ``[0, 2^63)``,
lists hold at most :data:`MAX_INDICES` entries, strings at most :data:`MAX_TEXT` characters, and
the nesting the schema allows is all there is (anything deeper is refused while parsing the frame).

Session identity and secret (README, "PD trust model"): the decode sends a random ``session`` id
in its hello; the prefill puts it in every notification it sends that decode, so notifications
from another deployment on the same host are never counted. With a shared ``secret`` configured
on both sides, the prefill refuses a hello that does not present it (compared in constant time).
"""

from __future__ import annotations

import hmac
from typing import NamedTuple

#: Most entries in one index list (a 2^20-token request at page size 1 plus room to spare).
MAX_INDICES = 1 << 22
#: Longest string field (descriptors are base64 JSON of the registered regions).
MAX_TEXT = 1 << 22
_INT_LIMIT = 1 << 63


class ProtocolError(ValueError):
    """A peer's message does not follow the schema (the message names the field)."""


def _int(value: object, field: str) -> int:
    if type(value) is not int or not 0 <= value < _INT_LIMIT:  # noqa: E721 - bool is an int subclass
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be an integer in [0, 2^63), got {value!r:.80}")
    return value


def _text(value: object, field: str) -> str:
    if type(value) is not str or len(value) > MAX_TEXT:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be a string of at most {MAX_TEXT} characters, "
                            f"got {type(value).__name__}")
    return value


def _indices(value: object, field: str) -> list[int]:
    if type(value) is not list or len(value) > MAX_INDICES:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be a list of at most {MAX_INDICES} integers, "
                            f"got {type(value).__name__}")
    for i, v in enumerate(value):
        _int(v, f"{field}[{i}]")
    return value


def _object(value: object, field: str) -> dict:
    if type(value) is not dict:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be an object, got {type(value).__name__}")
    return value


def op_of(message: dict) -> str:
    """The message's ``op`` (a string), or ProtocolError."""
    return _text(message.get("op"), "op")


class Hello(NamedTuple):
    agent: str
    manifest: dict
    session: str
    secret: str | None
    checksums: bool


def parse_hello(message: dict) -> Hello:
    """The fields of a decode's ``hello``.

    Raises
    ------
    ProtocolError
        A missing or mistyped field.
    """
    secret = message.get("secret")
    checksums = message.get("checksums", False)
    if type(checksums) is not bool:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `checksums` must be a boolean, got {checksums!r:.80}")
    return Hello(_text(message.get("agent"), "agent"), _object(message.get("manifest"), "manifest"),
                 _text(message.get("session", ""), "session"), None if secret is None else _text(secret, "secret"),
                 checksums)


class TransferRequest(NamedTuple):
    room: int
    kv_indices: list[int]
    kv_group_indices: dict[str, list[int]]
    state_indices: list[list[int]]


def parse_transfer(message: dict) -> TransferRequest:
    """The fields of a decode's ``transfer``.

    Raises
    ------
    ProtocolError
        A missing or mistyped field (``room`` checked first, so a refusal can name the room).
    """
    room = _int(message.get("room"), "room")
    groups = _object(message.get("kv_group_indices", {}), "kv_group_indices")
    states = message.get("state_indices", [])
    if type(states) is not list or len(states) > 64:  # noqa: E721
        raise ProtocolError("sparsekv: bootstrap field `state_indices` must be a list of at most 64 index lists")
    return TransferRequest(room, _indices(message.get("kv_indices"), "kv_indices"),
                           {_text(k, "kv_group_indices key"): _indices(v, f"kv_group_indices[{k!r:.40}]")
                            for k, v in groups.items()},
                           [_indices(s, f"state_indices[{i}]") for i, s in enumerate(states)])


def secret_matches(expected: str | None, presented: str | None) -> bool:
    """Whether a peer presented the configured secret (always, when none is configured); constant time."""
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())

"""The field vocabulary of the bootstrap protocol: every field a peer sends, checked before anything acts on it.

A peer's message is untrusted input: a connection thread must never die on it, and nothing it
names may be truncated or coerced (``"room": 1.9`` once became room 1, ``"room": "abc"`` killed the
connection and every room in flight on it). Each check returns a field's value in its exact type
or raises :class:`ProtocolError` naming the field; the caller answers that peer with one refusal
and carries on. The messages, each a schema of these checks, are in :mod:`.protocol`. Limits:
integers are JSON integers (never bool or float) in ``[0, 2^63)``, lists hold at most
:data:`MAX_INDICES` entries, strings at most :data:`MAX_TEXT` characters, and the nesting the
schema allows is all there is (anything deeper is refused while parsing the frame).

Session identity and secret (docs/pd.md, "PD trust model"): the decode sends a random ``session`` id
in its hello; the prefill puts it in every notification it sends that decode, so notifications
from another deployment on the same host are never counted. With a shared ``secret`` configured
on both sides, the prefill refuses a hello that does not present it (compared in constant time).
"""

from __future__ import annotations

import hmac

#: Most entries in one index list (a 2^20-token request at page size 1 plus room to spare).
MAX_INDICES = 1 << 22
#: Longest string field (descriptors are base64 JSON of the registered regions).
MAX_TEXT = 1 << 22
#: Most index lists in one message (one per state component).
MAX_LISTS = 64
_INT_LIMIT = 1 << 63


class ProtocolError(ValueError):
    """A peer's message does not follow the schema (the message names the field)."""


def integer(value: object, field: str) -> int:
    """``value`` if it is a JSON integer (never a bool or float) in ``[0, 2^63)``, else ProtocolError."""
    if type(value) is not int or not 0 <= value < _INT_LIMIT:  # noqa: E721 - bool is an int subclass
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be an integer in [0, 2^63), got {value!r:.80}")
    return value


def boolean(value: object, field: str) -> bool:
    """``value`` if it is a JSON boolean, else ProtocolError."""
    if type(value) is not bool:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be a boolean, got {value!r:.80}")
    return value


def text(value: object, field: str) -> str:
    """``value`` if it is a string of at most :data:`MAX_TEXT` characters, else ProtocolError."""
    if type(value) is not str or len(value) > MAX_TEXT:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be a string of at most {MAX_TEXT} characters, "
                            f"got {type(value).__name__}")
    return value


def optional_text(value: object, field: str) -> str | None:
    """``value`` if it is None or a :func:`text`."""
    return None if value is None else text(value, field)


def indices(value: object, field: str) -> list[int]:
    """``value`` if it is a list of at most :data:`MAX_INDICES` :func:`integer` entries, else ProtocolError."""
    if type(value) is not list or len(value) > MAX_INDICES:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be a list of at most {MAX_INDICES} integers, "
                            f"got {type(value).__name__}")
    for i, v in enumerate(value):
        integer(v, f"{field}[{i}]")
    return value


def index_lists(value: object, field: str) -> list[list[int]]:
    """``value`` if it is a list of at most :data:`MAX_LISTS` :func:`indices` lists, else ProtocolError."""
    if type(value) is not list or len(value) > MAX_LISTS:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be a list of at most {MAX_LISTS} index lists")
    return [indices(v, f"{field}[{i}]") for i, v in enumerate(value)]


def mapping(value: object, field: str) -> dict:
    """``value`` if it is a JSON object (its entries unchecked), else ProtocolError."""
    if type(value) is not dict:  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be an object, got {type(value).__name__}")
    return value


def named_indices(value: object, field: str) -> dict[str, list[int]]:
    """``value`` if it is an object of :func:`text` keys and :func:`indices` values, else ProtocolError."""
    return {text(k, f"{field} key"): indices(v, f"{field}[{k!r:.40}]") for k, v in mapping(value, field).items()}


def named_texts(value: object, field: str) -> dict[str, str]:
    """``value`` if it is an object of :func:`text` keys and values, else ProtocolError."""
    return {text(k, f"{field} key"): text(v, f"{field}[{k!r:.40}]") for k, v in mapping(value, field).items()}


def secret_matches(expected: str | None, presented: str | None) -> bool:
    """Whether a peer presented the configured secret (always, when none is configured); constant time."""
    if expected is None:
        return True
    return presented is not None and hmac.compare_digest(expected.encode(), presented.encode())

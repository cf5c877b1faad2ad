"""The field vocabulary of the bootstrap protocol: every field a peer sends, checked before anything acts on it.

A peer's message is untrusted input: a connection thread must never die on it, and nothing it
names may be truncated or coerced (``"room": 1.9`` once became room 1, ``"room": "abc"`` killed the
connection and every room in flight on it). Each check returns a field's value in its exact type
or raises :class:`ProtocolError` naming the field; the caller answers that peer with one refusal
and carries on. The messages, each a schema of these checks, are in :mod:`.protocol`. Limits:
integers are JSON integers (never bool or float) in ``[0, 2^63)``, lists hold at most
:data:`MAX_INDICES` entries, strings at most :data:`MAX_TEXT` characters, and the nesting the
schema allows is all there is (anything deeper is refused while parsing the frame).

Session identity (docs/pd.md, "PD trust model"): the decode sends a random ``session`` id in its
hello; the prefill puts it in every notification it sends that decode, so notifications from
another deployment on the same host are never counted.

Authentication: with a shared ``secret`` configured on both sides, each side proves it holds the
secret without sending it. The decode's hello carries a fresh random nonce; the prefill answers
with its own nonce and :func:`secret_proof` of its role over both nonces and the session; the
decode checks it and answers with its own proof, which the prefill checks (constant time) before
it loads the decode's engine descriptor or reveals its own. A proof is good for one pair of fresh
nonces only, so one captured on the wire cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

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


_NONCE = re.compile(r"[0-9a-f]{32}")
_PROOF = re.compile(r"[0-9a-f]{64}")


def nonce(value: object, field: str) -> str:
    """``value`` if it is a nonce (32 lowercase hex digits), else ProtocolError."""
    if type(value) is not str or not _NONCE.fullmatch(value):  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be 32 lowercase hex digits, got {value!r:.80}")
    return value


def optional_nonce(value: object, field: str) -> str:
    """``value`` if it is "" (no challenge) or a :func:`nonce`."""
    return "" if value == "" else nonce(value, field)


def proof(value: object, field: str) -> str:
    """``value`` if it is a proof (64 lowercase hex digits: an HMAC-SHA256), else ProtocolError."""
    if type(value) is not str or not _PROOF.fullmatch(value):  # noqa: E721
        raise ProtocolError(f"sparsekv: bootstrap field `{field}` must be 64 lowercase hex digits, got {value!r:.80}")
    return value


def new_nonce() -> str:
    """A fresh random challenge (128 bits)."""
    return secrets.token_hex(16)


def secret_proof(secret: str, role: str, decode_nonce: str, prefill_nonce: str, session: str) -> str:
    """The HMAC-SHA256, keyed by ``secret``, of the ``role`` (``"prefill"`` or ``"decode"``: one side's
    proof never passes for the other's) over both nonces and the decode's session id."""
    message = f"sparsekv-pd-auth/1\0{role}\0{decode_nonce}\0{prefill_nonce}\0{session}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(secret: str, role: str, decode_nonce: str, prefill_nonce: str, session: str,
                  presented: str) -> bool:
    """Whether ``presented`` is ``role``'s :func:`secret_proof` (constant-time comparison)."""
    return hmac.compare_digest(secret_proof(secret, role, decode_nonce, prefill_nonce, session), presented)

"""The PD bootstrap protocol: every message a typed value, one schema for encoding and decoding.

Each message kind is a frozen dataclass whose fields *are* its schema: every field names the check
of :mod:`.messages` that its wire value must pass, and its default when a peer may leave it out.
:meth:`Message.encode` gives the JSON object a :class:`~.bootstrap.Channel` sends;
:func:`decode` turns a received object back into its kind, checking every field (a
:class:`~.messages.ProtocolError` names the first bad one). The exchange::

    decode -> prefill   Hello      (engine descriptor, manifest, session id, checksums?, nonce)
  with a shared secret on the prefill (:mod:`.messages`, "Authentication"):
    prefill -> decode   Challenge  (the prefill's nonce, its proof)
    decode -> prefill   Proof      (the decode's proof)
  then
    prefill -> decode   Welcome    (engine descriptor, manifest)  or  Refused (then it closes)
    decode -> prefill   Transfer   (a room and its destination indices; any number, any order)
                        Cancel     (the decode gave up on a room: write nothing more of it)
    prefill -> decode   Status     (a room's outcome: batches, bytes, region digests, or its error)
                     or Cancelled  (none of the room's writes is in flight, and none will be posted)
                     or Refused    (a message that could not be read; the connection goes on)
    decode -> prefill   Bye        (nothing more will be asked)
    prefill -> decode   Bye        (the connection held no room for ``idle_s``: it closes; the
                                    decode connects again for its next room)

Besides these, each batch of writes carries a :class:`Notification` through the transfer engine,
which the engine delivers after the batch's data. A decode that says ``notified`` in its hello
completes a room from its notifications alone: the prefill then sends a ``Status`` only when a
room fails (or has nothing to write), and batch 0's notification carries the room's digests.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from sparsekv.srt.disaggregation.messages import (
    ProtocolError,
    boolean,
    index_lists,
    indices,
    integer,
    mapping,
    named_indices,
    named_texts,
    nonce,
    optional_nonce,
    proof,
    text,
)

if sys.version_info >= (3, 11):
    from typing import dataclass_transform as _dataclass_transform
else:  # the same classes at run time; only type checkers miss the hint

    def _dataclass_transform(**_):
        return lambda cls: cls


#: Every message kind by its ``op`` (each :class:`Message` subclass adds itself).
KINDS: dict[str, type[Message]] = {}


def _wire(check: Callable[[object, str], Any], **default) -> Any:
    """A message field whose wire value must pass ``check`` (``default=`` / ``default_factory=``: optional)."""
    return field(metadata={"check": check}, **default)


@_dataclass_transform(frozen_default=True, field_specifiers=(field,))
class Message:
    """A bootstrap message. A kind is a subclass that names its ``op`` and declares its fields with
    their checks (``class Bye(Message, op="bye")``): it becomes a frozen dataclass, added to :data:`KINDS`."""

    OP: ClassVar[str] = ""

    def __init_subclass__(cls, *, op: str, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.OP = op
        dataclass(frozen=True)(cls)
        KINDS[op] = cls

    def encode(self) -> dict:
        """The JSON object to send (an optional field that is None is left out)."""
        out = {"op": self.OP}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_wire(cls, message: dict) -> Message:
        """The message of kind ``cls`` in ``message``, every field checked in declaration order.

        Raises
        ------
        ProtocolError
            A missing or mistyped field (named).
        """
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in message:
                values[f.name] = f.metadata["check"](message[f.name], f.name)
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                values[f.name] = f.default_factory()
            else:
                values[f.name] = f.metadata["check"](None, f.name)  # raises, naming the missing field
        return cls(**values)


class Hello(Message, op="hello"):
    """The decode's first message to a prefill stage."""

    agent: str = _wire(text)  # the decode's engine descriptor (:func:`~.bootstrap.b64`)
    manifest: dict = _wire(mapping)  # :meth:`~.manifest.Manifest.to_dict`
    session: str = _wire(text, default="")  # echoed in every notification to this decode
    checksums: bool = _wire(boolean, default=False)  # report region digests with each room's status
    #: The decode's challenge (:func:`~.messages.new_nonce`); "" from a decode without a secret.
    nonce: str = _wire(optional_nonce, default="")
    #: Report a room's success by its notifications alone (digests in batch 0's): no success status.
    notified: bool = _wire(boolean, default=False)


class Challenge(Message, op="challenge"):
    """A prefill stage with a secret answers a hello with its own nonce and its proof of the secret."""

    nonce: str = _wire(nonce)
    proof: str = _wire(proof)


class Proof(Message, op="proof"):
    """The decode's proof of the secret, over both nonces (:func:`~.messages.secret_proof`)."""

    proof: str = _wire(proof)


class Welcome(Message, op="welcome"):
    """The prefill stage accepted the decode's hello."""

    agent: str = _wire(text)
    manifest: dict = _wire(mapping)


class Refused(Message, op="refused"):
    """A hello or a message that was refused, and why."""

    error: str = _wire(text)


class Transfer(Message, op="transfer"):
    """The decode asks for a room into these destinations (``room`` is checked first, so a refusal
    can name a valid room)."""

    room: int = _wire(integer)
    kv_indices: list[int] = _wire(indices)
    #: One destination list per state component.
    state_indices: list[list[int]] = _wire(index_lists, default_factory=list)
    #: A KV region group's own destinations (label prefix, e.g. ``"c4_kv"`` under HiSparse).
    kv_group_indices: dict[str, list[int]] = _wire(named_indices, default_factory=dict)

    def plan_request(self) -> dict:
        """The destination fields as :meth:`~.planning.RoomPlanner.plan` takes them."""
        return {"kv_indices": self.kv_indices, "state_indices": self.state_indices,
                "kv_group_indices": self.kv_group_indices}


class Status(Message, op="status"):
    """A room's outcome on one prefill stage."""

    room: int = _wire(integer)
    ok: bool = _wire(boolean)
    error: str = _wire(text, default="")
    batches: int = _wire(integer, default=0)  # notifications the room's writes carry
    bytes: int = _wire(integer, default=0)
    #: XXH3-64 hex digest of each host region as sent (when the decode asked for checksums).
    digests: dict[str, str] = _wire(named_texts, default_factory=dict)
    #: A failure whose writes may still be in flight (they did not stop within the sender's bound):
    #: the room's destinations are not free yet.
    inflight: bool = _wire(boolean, default=False)


class Cancel(Message, op="cancel"):
    """The decode gave up on a room (timeout, abort, close): write nothing more of it."""

    room: int = _wire(integer)


class Cancelled(Message, op="cancelled"):
    """The answer to a :class:`Cancel`: no write of the room is in flight on this connection and
    none will be posted (the room's destinations may be reused as far as this stage goes)."""

    room: int = _wire(integer)


class Bye(Message, op="bye"):
    """The sender waits for nothing more on this connection (from the decode: it asks for nothing
    more; from the prefill: the connection held no room for its idle bound, and closes)."""



def decode(message: dict, *expected: type[Message]) -> Message:
    """The typed message in a received JSON object, which must be one of the ``expected`` kinds.

    Raises
    ------
    ProtocolError
        An unknown or unexpected ``op``, or a field that fails its check.
    """

    op = message.get("op")
    kind = KINDS.get(op) if type(op) is str else None  # noqa: E721
    if kind is None:
        raise ProtocolError(f"sparsekv: unknown bootstrap op {op!r:.80}")
    if kind not in expected:
        raise ProtocolError(f"sparsekv: unexpected bootstrap op {op!r} here (expected "
                            f"{' or '.join(k.OP for k in expected)})")
    return kind.from_wire(message)


class Notification(NamedTuple):
    """What each batch of a room's writes carries through the engine: ``b"<session>:<stage port>:
    <room>:<batch>:<batches>"`` (``session``: the decode's id from its hello, so no other
    deployment's notification counts), then, for a decode that completes rooms from their
    notifications (``Hello.notified``), a newline and the room's region digests as a JSON object
    (batch 0's only; ``{}`` without checksums)."""

    session: str
    port: int
    room: int
    batch: int
    batches: int
    digests: dict[str, str] | None = None

    def encode(self) -> bytes:
        head = f"{self.session}:{self.port}:{self.room}:{self.batch}:{self.batches}"
        return (head if self.digests is None else f"{head}\n{json.dumps(self.digests)}").encode()

    @classmethod
    def decode(cls, data: bytes) -> Notification:
        """The notification in ``data``.

        Raises
        ------
        ProtocolError
            ``data`` is not one.
        """
        try:
            head, *tail = data.decode().split("\n", 1)
            session, *fields = head.split(":")
            port, room, batch, batches = (int(x) for x in fields)
            digests = named_texts(json.loads(tail[0]), "digests") if tail else None
        except (UnicodeDecodeError, ValueError, RecursionError):  # ProtocolError is a ValueError
            raise ProtocolError(f"sparsekv: not a room notification: {data[:80]!r}") from None
        return cls(session, port, room, batch, batches, digests)

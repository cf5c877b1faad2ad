"""``Deadlines``: the bound of each wait of a PD transfer, one object for both ends.

Every wait is bounded, so a peer that stops answering is an error, never a hang. The waits are
different things and may want different bounds (a room's writes of a 1M-token request take longer
than a handshake), so each has its own name; :meth:`Deadlines.uniform` gives every wait one bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sparsekv.checks import as_float


@dataclass(frozen=True)
class Deadlines:
    """Seconds each wait may last.

    Attributes
    ----------
    handshake_s : float
        Decode: opening the connection to a stage and its welcome; prefill: the decode's hello.
    message_s : float
        The rest of a message once its first bytes arrived (both ends).
    source_s : float
        Prefill: a room the decode asked for being declared by the prefill's scheduler.
    write_s : float
        Prefill: a room's writes completing in the engine.
    arrival_s : float
        Decode: a room arriving (the default of :meth:`~.receiver.KVReceiver.wait`).
    idle_s : float
        Prefill: a decode connection holding no room (none asked for and unanswered) is closed
        after this long (the decode connects again for its next room).
    quarantine_s : float
        Decode: a given-up room's destinations stay unreleased this long after a stage that did
        not confirm it stopped writing closed its connection (data it had already sent may still
        land meanwhile; docs/pd.md, "PD trust model").
    close_s : float
        Either end: each of its threads stopping on close.
    """

    handshake_s: float = 30.0
    message_s: float = 30.0
    source_s: float = 30.0
    write_s: float = 30.0
    arrival_s: float = 30.0
    idle_s: float = 300.0
    quarantine_s: float = 5.0
    close_s: float = 30.0

    def __post_init__(self) -> None:
        for f in fields(self):
            seconds = as_float(getattr(self, f.name), f.name, finite=True)
            if not seconds > 0:
                raise ValueError(f"sparsekv: argument `{f.name}` must be a finite number of seconds > 0, got {seconds}")

    @classmethod
    def uniform(cls, seconds: float) -> Deadlines:
        """Every wait bounded by ``seconds``."""
        return cls(**{f.name: seconds for f in fields(cls)})

"""Which transfer engines PD disaggregation can open, and opening one (:func:`open_backend`).

Its own module, so that the interface (:mod:`.backend`) does not import the engines that
implement it: each engine module is imported only when asked for (neither library is needed to
import sparsekv).
"""

from __future__ import annotations

from sparsekv.srt.disaggregation.backend import TransferBackend

#: Engines :func:`open_backend` knows, the first the default.
ENGINES = ("nixl", "mooncake")


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"sparsekv: argument `engine` must be one of {ENGINES}, got {engine!r}")


def load_engine(engine: str) -> None:
    """Check that ``engine``'s library can be imported (e.g. before starting processes that use it).

    Raises
    ------
    ValueError
        Unknown engine.
    ImportError
        The engine's library (or a system library it needs) is missing; the message says how to install it.
    """
    _check_engine(engine)
    if engine == "nixl":
        from sparsekv.srt.disaggregation.nixl_backend import load_nixl_api

        load_nixl_api()
    else:
        from sparsekv.srt.disaggregation.mooncake_backend import load_mooncake_engine

        load_mooncake_engine()


def open_backend(engine: str, name: str | None = None, *, timeout_s: float = 30.0) -> TransferBackend:
    """A loopback endpoint of ``engine`` (``"nixl"``: UCX on ``lo``; ``"mooncake"``: TCP on 127.0.0.1).

    Raises
    ------
    ValueError
        Unknown engine.
    ImportError
        See :func:`load_engine`.
    """
    _check_engine(engine)
    if engine == "nixl":
        from sparsekv.srt.disaggregation.nixl_backend import NixlBackend

        return NixlBackend(name, net_devices="lo")
    from sparsekv.srt.disaggregation.mooncake_backend import MooncakeBackend

    return MooncakeBackend(name, timeout_s=timeout_s)

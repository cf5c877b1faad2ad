"""Which transfer engines PD disaggregation can open: the :data:`ENGINES` table, and opening one.

Its own module, so that the interface (:mod:`.backend`) does not import the engines that
implement it: each engine module is imported only when asked for (neither library is needed to
import sparsekv). A new engine is a :class:`~.backend.TransferBackend` module and one row here;
``pd-demo --engine``, the bench and the engine-contract tests (``tests/pd/test_pd_engines.py``)
take every row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from sparsekv.srt.disaggregation.backend import TransferBackend


@dataclass(frozen=True)
class Engine:
    """One transfer engine: where it lives and how to open a loopback endpoint of it.

    Attributes
    ----------
    label : str
        How reports name it (e.g. ``"NIXL/UCX"``).
    module : str
        Its backend module under :mod:`sparsekv.srt.disaggregation`, imported only when asked for.
    loader : str
        The module's function that imports the engine's library; its ``ImportError`` says how to
        install what is missing.
    factory : str
        The module's callable (dotted within it) that opens a loopback endpoint:
        ``factory(name, *, timeout_s)``.
    binds_every_interface : bool
        Its listeners bind every interface even for loopback traffic: run it in a private network
        namespace where one is at hand (``unshare -rn``).
    """

    label: str
    module: str
    loader: str
    factory: str
    binds_every_interface: bool = False

    def _attribute(self, dotted: str):
        value = importlib.import_module(f"sparsekv.srt.disaggregation.{self.module}")
        for part in dotted.split("."):
            value = getattr(value, part)
        return value

    def load(self) -> None:
        """Import the engine's library (e.g. before starting processes that use it).

        Raises
        ------
        ImportError
            The library (or a system library it needs) is missing; the message says how to install it.
        """
        self._attribute(self.loader)()

    def open(self, name: str | None = None, *, timeout_s: float = 30.0) -> TransferBackend:
        """A loopback endpoint named ``name`` (default: random), its own waits bounded by ``timeout_s``."""
        return self._attribute(self.factory)(name, timeout_s=timeout_s)


#: Every engine by its name (``--engine``), the first the default.
ENGINES: dict[str, Engine] = {
    "nixl": Engine("NIXL/UCX", "nixl_backend", "load_nixl_api", "NixlBackend.loopback"),
    "mooncake": Engine("Mooncake TE/TCP", "mooncake_backend", "load_mooncake_engine", "MooncakeBackend.loopback",
                       binds_every_interface=True),
}
DEFAULT_ENGINE = next(iter(ENGINES))


def find_engine(engine: str) -> Engine:
    """The row of :data:`ENGINES` named ``engine``.

    Raises
    ------
    ValueError
        Unknown engine.
    """
    if engine not in ENGINES:
        raise ValueError(f"sparsekv: argument `engine` must be one of {tuple(ENGINES)}, got {engine!r}")
    return ENGINES[engine]


def load_engine(engine: str) -> None:
    """:meth:`Engine.load` of the engine named ``engine``.

    Raises
    ------
    ValueError
        Unknown engine.
    ImportError
        See :meth:`Engine.load`.
    """
    find_engine(engine).load()


def open_backend(engine: str, name: str | None = None, *, timeout_s: float = 30.0) -> TransferBackend:
    """:meth:`Engine.open` of the engine named ``engine`` (``"nixl"``: UCX on ``lo``; ``"mooncake"``:
    TCP on 127.0.0.1).

    Raises
    ------
    ValueError
        Unknown engine.
    ImportError
        See :meth:`Engine.load`.
    """
    return find_engine(engine).open(name, timeout_s=timeout_s)

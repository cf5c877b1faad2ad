"""Logging for sparsekv: every module logs on a ``sparsekv.*`` logger; this shows those records.

The library never configures logging on import and never touches the root logger. This module is
the one place that attaches a handler: the ``sparsekv`` command calls :func:`configure` (``-v`` for
INFO, ``-vv`` or ``--debug`` for DEBUG, else ``SPARSEKV_LOG_LEVEL``, else WARNING), and the JIT
loader calls :func:`configure_from_environment` on its first module load, so a program that set
``SPARSEKV_LOG_LEVEL`` or ``SPARSEKV_JIT_VERBOSE=1`` sees the records without configuring logging.
From Python, either configure the ``sparsekv`` logger yourself or call
``sparsekv.log.configure("INFO")`` (or ``configure()`` to read the environment); the JIT loader then
logs one line per compile with its time, e.g.
``sparsekv.jit INFO: JIT: compiled gather_rows<1> (cpu) in 1.62 s``.
"""

from __future__ import annotations

import logging
import sys

from sparsekv import env

LOGGER_NAME = "sparsekv"
#: The JIT loader's logger: ``SPARSEKV_JIT_VERBOSE=1`` shows its DEBUG records (compiler command lines).
JIT_LOGGER_NAME = "sparsekv.jit"
FORMAT = "%(name)s %(levelname)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record (pytest captures, redirects)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def parse_level(text: str, source: str = "SPARSEKV_LOG_LEVEL") -> int:
    """The logging level named by ``text`` (``INFO``, ``debug``, ``20``...).

    Raises
    ------
    ValueError
        ``text`` names no level; the message names ``source``.
    """
    value = text.strip().upper()
    if value in LEVELS:
        return logging.getLevelName(value)
    if value.isdigit():
        return int(value)
    raise ValueError(f"{source} must be one of {', '.join(LEVELS)} (or a number), got {text!r}")


def configure(level: int | str | None = None) -> logging.Logger:
    """Show ``sparsekv.*`` records at ``level`` and above on stderr; returns the ``sparsekv`` logger.

    Calling it again changes the level; there is only ever one handler of ours. Records still
    propagate, so an application that configures the root logger itself should not call this.

    Parameters
    ----------
    level : int or str, optional
        A logging level or its name. Default: ``SPARSEKV_LOG_LEVEL``, else WARNING.
        ``SPARSEKV_JIT_VERBOSE=1`` shows the ``sparsekv.jit`` logger at DEBUG whatever the level.

    Raises
    ------
    ValueError
        An unknown level name (in ``level`` or ``SPARSEKV_LOG_LEVEL``).
    """
    if level is None:
        configured = env.log_level()
        level = parse_level(configured) if configured else logging.WARNING
    elif isinstance(level, str):
        level = parse_level(level, "level")
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    if env.verbose_build():
        logging.getLogger(JIT_LOGGER_NAME).setLevel(logging.DEBUG)
    return logger


def configure_from_environment() -> None:
    """What a library process without logging setup shows: nothing, unless ``SPARSEKV_LOG_LEVEL`` or
    ``SPARSEKV_JIT_VERBOSE=1`` is set; then :func:`configure`, unless the ``sparsekv`` logger has a
    handler already (the command's, or the application's: then only the JIT logger's level is set).

    Raises
    ------
    ValueError
        ``SPARSEKV_LOG_LEVEL`` names no level.
    """
    if not (env.log_level() or env.verbose_build()):
        return
    if not logging.getLogger(LOGGER_NAME).handlers:
        configure()
    elif env.verbose_build():
        logging.getLogger(JIT_LOGGER_NAME).setLevel(logging.DEBUG)

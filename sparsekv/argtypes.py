"""argparse ``type=`` functions for every command and tool: a bad value is a usage error at parse time.

argparse turns the :class:`argparse.ArgumentTypeError` these raise into one line naming the flag
and exit code 2, before anything runs (``--layers 0``, ``--timeout nan``, ``--seq-lens ''`` once
reached the run and failed there, with a traceback or after a long stall). Output paths are
checked the same way (``--json`` to an unwritable place once failed only after the whole run).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from sparsekv.checks import describe_range

__all__ = ["int_list", "int_range", "number_range", "output_path"]


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (``hi`` None: no upper bound), the range convention of :mod:`sparsekv.checks`."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer {describe_range(lo, hi)}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected an integer {describe_range(lo, hi)}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number_range(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN and infinities are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        bad = not math.isfinite(value) or value < lo or (lo_open and value == lo) or (hi is not None and value > hi)
        if bad:
            low = f"({lo}" if lo_open else f"[{lo}"
            high = f"{hi}]" if hi is not None else "inf)"
            raise argparse.ArgumentTypeError(f"expected a finite number in {low}, {high}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def int_list(lo: int, hi: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """A non-empty comma-separated list of integers, each in ``[lo, hi]``."""
    item = int_range(lo, hi)

    def parse(text: str) -> tuple[int, ...]:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers {describe_range(lo, hi)}, "
                                             f"got {text!r}")
        return tuple(item(p) for p in parts)

    parse.__name__ = "list"
    return parse


def output_path(text: str) -> str:
    """A file path that can be written: its folder exists and is writable, and it is not a folder."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder} is not a writable folder")
    if os.path.exists(text) and not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: the file is not writable")
    return text

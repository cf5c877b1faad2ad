"""Scalar argument checks for every layer: one type rule, one range convention, torch-free.

Each check returns the normalized value or raises naming the argument, before the caller writes
anything:

* ``TypeError`` for the wrong kind of value: ``bool`` or ``float`` where an int is meant (Python
  would silently take ``True`` as 1 or truncate ``3.7``), a string where a number is meant;
* ``IndexError`` for an index outside its table, negative ones included (Python and torch would
  wrap ``-1`` to the last row);
* ``ValueError`` for any other out-of-range value.

The one type rule: an int is anything :func:`operator.index` takes (``int``, numpy integers,
one-element integer tensors) except a bool of any kind. The one range convention: bounds are
closed, ``[lo, hi]``, and either may be ``None`` (unbounded); :func:`describe_range` words a range
the same way for every message, the command-line flags' included (``sparsekv.argtypes``).

A message reads ``sparsekv: [owner ]argument `name` must be ...``: ``owner`` names the kernel
family or class whose argument it is, when that helps the reader.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable

__all__ = ["as_bool", "as_float", "as_int", "describe_range", "index_in", "int_in", "named_as", "one_of"]


def _subject(name: str, owner: str) -> str:
    return f"sparsekv: {owner + ' ' if owner else ''}argument `{name}`"


def _is_bool(value: object) -> bool:
    # A Python bool, numpy.bool_ and a bool tensor all pass operator.index as 0 or 1.
    dtype = str(getattr(value, "dtype", ""))
    return isinstance(value, bool) or type(value).__name__ == "bool_" or dtype == "torch.bool"


def describe_range(lo: int | float | None, hi: int | float | None) -> str:
    """``in [lo, hi]``, ``>= lo``, ``<= hi`` or ``any value``: the words of every range message."""
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    if lo is not None:
        return f">= {lo}"
    return f"<= {hi}" if hi is not None else "any value"


def as_int(value: object, name: str, *, owner: str = "") -> int:
    """``value`` as a Python int: ints, numpy ints and one-element integer tensors, never a bool or a float.

    Raises
    ------
    TypeError
        Anything else; the message names ``name``.
    """
    if type(value) is int:  # the common case, first: a bool's type is bool
        return value
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{_subject(name, owner)} must be an int, got {type(value).__name__} ({value!r})")


def int_in(value: object, name: str, lo: int | None = None, hi: int | None = None, *, why: str = "",
           owner: str = "") -> int:
    """:func:`as_int` of ``value``, in ``[lo, hi]`` (``None``: no bound on that side).

    ``why`` says what sets the limit (e.g. ``"int16 slot ids"``); it follows the range in the message.

    Raises
    ------
    TypeError
        As :func:`as_int`.
    ValueError
        Outside the range.
    """
    v = as_int(value, name, owner=owner)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        reason = f" ({why})" if why else ""
        raise ValueError(f"{_subject(name, owner)} must be an int {describe_range(lo, hi)}{reason}, got {v}")
    return v


def index_in(value: object, name: str, size: int) -> int:
    """An index in ``[0, size - 1]``; ``IndexError`` outside (a negative index is refused, never wrapped)."""
    v = as_int(value, name)
    if not 0 <= v < size:
        raise IndexError(f"sparsekv: argument `{name}` = {v} is out of range [0, {size})")
    return v


def as_bool(value: object, name: str) -> bool:
    """A ``bool`` flag (an int or a string is refused: ``"false"`` would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"sparsekv: argument `{name}` must be a bool, got {type(value).__name__} ({value!r})")
    return value


def as_float(value: object, name: str, *, finite: bool = False, lo: float | None = None) -> float:
    """``value`` as a ``float``: any real number (ints and numpy floats too), not a bool or a string.

    With ``finite``, NaN and infinities are refused; with ``lo``, values below it.

    Raises
    ------
    TypeError
        ``value`` is not a real number; the message names ``name``.
    ValueError
        Not finite (with ``finite``) or below ``lo``.
    """
    if type(value) is float:  # the common case, first: no ABC check
        v = value
    elif _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"sparsekv: argument `{name}` must be a real number, got {type(value).__name__} ({value!r})")
    else:
        v = float(value)
    if (finite and not math.isfinite(v)) or (lo is not None and not v >= lo):
        what = "a finite number" if finite else "a number"
        bound = f" {describe_range(lo, None)}" if lo is not None else ""
        raise ValueError(f"sparsekv: argument `{name}` must be {what}{bound}, got {v}")
    return v


def one_of(value: object, name: str, choices: Iterable, *, owner: str = "") -> object:
    """``value`` if it is one of ``choices`` (a bool never is), else ``ValueError`` naming them."""
    choices = tuple(choices)
    if _is_bool(value) or value not in choices:
        raise ValueError(f"{_subject(name, owner)} must be one of {choices}, got {value!r}")
    return value


class named_as:  # noqa: N801 - used as a function: `with named_as(inner="public"):`
    """Inside the block, refusals name arguments as the public function calls them: a ``TypeError``,
    ``ValueError`` or ``IndexError`` whose message names ``inner`` (as `` `inner` ``) is re-raised,
    the same exception, naming ``public`` instead. For an entry whose argument names differ from its
    wrapper's (``quantize_indexer_keys`` takes ``keys``, its entry calls them ``x``). A plain context
    manager, not a generator one: it wraps decode-path calls, and costs a tenth as much. Make it where
    it is entered: torch.compile enters a context manager made in the traced code, not a global one."""

    def __init__(self, **inner_to_public: str) -> None:
        self.inner_to_public = inner_to_public

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, e: BaseException | None, traceback: object) -> bool:
        if e is not None:
            rename_arguments(e, **self.inner_to_public)
        return False  # the same exception propagates


def rename_arguments(error: BaseException, **inner_to_public: str) -> None:
    """What :class:`named_as` does to an exception raised in its block, for an ``except`` clause (a ``try``
    costs nothing until something is raised; a ``with`` makes its context every call): a ``TypeError``,
    ``ValueError`` or ``IndexError`` naming `` `inner` `` names `` `public` `` instead."""
    if isinstance(error, (TypeError, ValueError, IndexError)):
        error.args = tuple(_renamed(a, inner_to_public) if isinstance(a, str) else a for a in error.args)


def _renamed(message: str, inner_to_public: dict[str, str]) -> str:
    for inner, public in inner_to_public.items():
        message = message.replace(f"`{inner}`", f"`{public}`")
    return message

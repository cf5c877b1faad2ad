"""Argument checks shared by the runtime classes (validate first, then mutate).

Each check returns the normalized value or raises naming the argument:

* ``TypeError`` for the wrong kind of value: ``bool`` or ``float`` where an int is meant (Python
  would silently take ``True`` as 1 or truncate ``3.7``), a float or bool tensor where ids are meant;
* ``IndexError`` for an index outside its table, negative ones included (Python and torch would
  wrap ``-1`` to the last row);
* ``ValueError`` for any other out-of-range value.
"""

from __future__ import annotations

import operator

import torch


def as_int(value: object, name: str) -> int:
    """``value`` as a Python int: ints, numpy ints and one-element integer tensors, never ``bool`` or float.

    Raises
    ------
    TypeError
        Anything else.
    """
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool) or \
            type(value).__name__ == "bool_":
        raise TypeError(f"sparsekv: argument `{name}` must be an int, got a bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"sparsekv: argument `{name}` must be an int, got {type(value).__name__} ({value!r})") \
            from None


def int_in(value: object, name: str, lo: int, hi: int | None = None) -> int:
    """An int in ``[lo, hi]`` (``hi=None``: no upper bound); ``ValueError`` outside."""
    v = as_int(value, name)
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"sparsekv: argument `{name}` must be {bound}, got {v}")
    return v


def index_in(value: object, name: str, size: int) -> int:
    """An index in ``[0, size)``; ``IndexError`` outside (a negative index is refused, never wrapped)."""
    v = as_int(value, name)
    if not 0 <= v < size:
        raise IndexError(f"sparsekv: argument `{name}` = {v} is out of range [0, {size})")
    return v


def as_bool(value: object, name: str) -> bool:
    """A ``bool`` flag (an int or a string is refused: ``"false"`` would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"sparsekv: argument `{name}` must be a bool, got {type(value).__name__} ({value!r})")
    return value


def int_tensor(value: object, name: str) -> torch.Tensor:
    """``value`` if it is an integer (not bool) tensor of any shape.

    Raises
    ------
    TypeError
        Not a tensor, or a float, complex or bool tensor (ids are never rounded).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"sparsekv: argument `{name}` must be an integer tensor, got {type(value).__name__}")
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise TypeError(f"sparsekv: argument `{name}` must be an integer tensor, got {value.dtype}")
    return value


def index_table(value: object, name: str, *, ndim: int) -> torch.Tensor:
    """``value`` if it is an integer tensor of ``ndim`` dimensions (a table the caller writes): see
    :func:`int_tensor`, plus ``ValueError`` for another rank."""
    int_tensor(value, name)
    if value.dim() != ndim:
        raise ValueError(f"sparsekv: argument `{name}` must be {ndim}-D, got shape {list(value.shape)}")
    return value


def id_tensor(value: object, name: str, *, size: int | None = None, allow_negative: bool = False) -> torch.Tensor:
    """An integer tensor of ids (:func:`int_tensor`), flattened to int64 on the CPU.

    With ``size``: every id (every non-negative one with ``allow_negative``) must be below it.

    Raises
    ------
    TypeError
        As :func:`int_tensor`.
    IndexError
        An id out of range (a negative one unless ``allow_negative``).
    """
    ids = int_tensor(value, name).reshape(-1).to("cpu", torch.int64)
    if ids.numel():
        if not allow_negative and int(ids.min()) < 0:
            raise IndexError(f"sparsekv: argument `{name}` holds a negative id ({int(ids.min())})")
        if size is not None and int(ids.max()) >= size:
            raise IndexError(f"sparsekv: argument `{name}` holds id {int(ids.max())}, out of range [0, {size})")
    return ids

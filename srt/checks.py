"""Tensor argument checks shared by the runtime classes (validate first, then mutate).

The scalar checks (ints, ranges, indices, flags) are :mod:`sparsekv.checks`; these add the tensor
ones with the same manners: each returns the tensor or raises naming the argument, ``TypeError``
for a float or bool tensor where ids are meant, ``IndexError`` for an id outside its table
(negative ones included), ``ValueError`` for a wrong rank.
"""

from __future__ import annotations

import torch


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

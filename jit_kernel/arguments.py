"""The scalar argument checks every kernel wrapper runs before it calls its custom op.

One rule for scalars, everywhere: an int argument is a Python ``int`` or a numpy integer, never a
``bool`` and never a float or a string (``page_size=64.7`` was once truncated to 64, ``'64'``
parsed); a float argument is any real number except ``bool``. The checks run in the public
wrappers, before the custom op: eager and traced calls raise the same ``TypeError``. (Meta tensors
need no check: the ops' fake implementations take them.)
"""

from __future__ import annotations

import math
import numbers

__all__ = ["float_arg", "int_arg", "is_int"]


def is_int(value: object) -> bool:
    """Whether ``value`` is an int argument: ``int`` or a numpy integer, not ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy.bool_ is not Integral


def int_arg(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an ``int`` in ``[lo, hi)`` (either bound optional).

    Raises
    ------
    TypeError
        ``value`` is not an int argument (see :func:`is_int`); the message names ``name``.
    ValueError
        ``value`` is outside the range.
    """
    if not is_int(value):
        raise TypeError(f"sparsekv: argument `{name}` must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        raise ValueError(f"sparsekv: argument `{name}` must be in [{'-inf' if lo is None else lo}, "
                         f"{'inf' if hi is None else hi}), got {value}")
    return value


def float_arg(name: str, value: object, *, finite: bool = False) -> float:
    """``value`` as a ``float``: any real number (ints and numpy floats too), not ``bool`` or a string.

    Raises
    ------
    TypeError
        ``value`` is not a real number; the message names ``name``.
    ValueError
        ``finite`` and ``value`` is NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"sparsekv: argument `{name}` must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if finite and not math.isfinite(value):
        raise ValueError(f"sparsekv: argument `{name}` must be finite, got {value}")
    return value

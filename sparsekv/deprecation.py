"""Renamed keyword arguments: the old name keeps working for one release, with a ``DeprecationWarning``.

When a keyword is renamed (say ``top_k`` to the kernels' ``num_top_k``), the function is decorated
with :func:`renamed_keywords` instead of growing a second parameter: a call with the old name warns,
naming both, and the value arrives under the new name, so the function's body and signature know
only the new one. Passing both names is a ``TypeError``, as a repeated keyword is in Python.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TypeVar

__all__ = ["renamed_keywords"]

F = TypeVar("F", bound=Callable)


def renamed_keywords(**old_to_new: str) -> Callable[[F], F]:
    """Decorate a function so that each old keyword in ``old_to_new`` still reaches it under its new name.

    Parameters
    ----------
    **old_to_new : str
        ``old="new"`` for each renamed keyword.

    Returns
    -------
    callable
        The decorator. The decorated function warns with ``DeprecationWarning`` (at the caller's line)
        for each old keyword it is given, naming the old and the new keyword.

    Raises
    ------
    TypeError
        At call time: both the old and the new name of one keyword were given.

    Examples
    --------
    >>> @renamed_keywords(top_k="num_top_k")
    ... def swap_in(*, num_top_k):
    ...     return num_top_k
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     swap_in(top_k=512)
    512
    """

    old_names = frozenset(old_to_new)

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not kwargs:
                return fn(*args)
            if old_names.isdisjoint(kwargs):  # the current names: the decode path's case, one set test
                return fn(*args, **kwargs)
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"sparsekv: {fn.__qualname__}() got both `{old}` and its new name `{new}`; "
                                    f"pass `{new}` only")
                warnings.warn(f"sparsekv: argument `{old}` of {fn.__qualname__}() is renamed `{new}`; the old "
                              f"name goes in the next release", DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return decorate

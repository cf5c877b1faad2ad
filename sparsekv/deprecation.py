"""Renamed keyword arguments: the old name keeps working for one release, with a ``DeprecationWarning``.

When a keyword is renamed (say ``top_k`` to the kernels' ``num_top_k``), the function is decorated
with :func:`renamed_keywords` instead of growing a second parameter: a call with the old name warns,
naming both, and the value arrives under the new name, so the function's body and signature know
only the new one. Passing both names is a ``TypeError``, as a repeated keyword is in Python.
"""

from __future__ import annotations

import functools
import inspect
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

    def decorate(fn: F) -> F:
        def rename(kwargs: dict) -> dict:
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"sparsekv: {fn.__qualname__}() got both `{old}` and its new name `{new}`; "
                                    f"pass `{new}` only")
                warnings.warn(f"sparsekv: argument `{old}` of {fn.__qualname__}() is renamed `{new}`; the old "
                              f"name goes in the next release", DeprecationWarning, stacklevel=3)
                kwargs[new] = kwargs.pop(old)
            return kwargs

        call = _named_wrapper(fn, old_to_new, rename)
        if call is None:
            old_names = frozenset(old_to_new)

            def call(*args, **kwargs):
                if old_names.isdisjoint(kwargs):  # the current names: one set test
                    return fn(*args, **kwargs)
                return fn(*args, **rename(kwargs))

        return functools.wraps(fn)(call)

    return decorate


#: A parameter of a wrapper made by :func:`_named_wrapper` that the call did not give.
_NOT_GIVEN = object()


def _named_wrapper(fn: Callable, old_to_new: dict[str, str], rename: Callable[[dict], dict]) -> Callable | None:
    """A wrapper of ``fn`` with ``fn``'s own parameters by name plus each old name, keyword-only; None for
    a ``fn`` with positional-only, ``*args`` or ``**kwargs`` parameters.

    Why its source is generated: a wrapper of ``(*args, **kwargs)`` packs a call's keywords into a
    dict and unpacks them again, ~0.6 us of a decode call given five keywords (issue 36 item 2). This
    one binds them as ``fn`` does, tests each old name against a sentinel and calls ``fn`` with
    every parameter by name (~0.2 us). A renamed parameter the call may give by its old name, and
    every positional one after it, defaults to the sentinel: a call that gives an old name or leaves
    one of them out goes to ``rename`` (its warning, its refusal) and then to ``fn`` with what it
    gave, so a missing argument gets Python's own message, from ``fn``.
    """
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params) \
            or not set(old_to_new.values()) <= {p.name for p in params} \
            or set(old_to_new) & {p.name for p in params} \
            or any(name.startswith("_sparsekv_") for name in [p.name for p in params]):
        return None
    scope = {"_sparsekv_fn": fn, "_sparsekv_rename": rename, "_sparsekv_not_given": _NOT_GIVEN}
    heads, passes, required, star, after_renamed = [], [], [], False, False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            heads.append("*")
            star = True
        renamed = p.name in old_to_new.values()
        after_renamed = after_renamed or (renamed and p.kind is p.POSITIONAL_OR_KEYWORD)
        default = f"_sparsekv_default_{p.name}"
        if p.default is not p.empty:
            scope[default] = p.default
        by = "" if p.kind is p.POSITIONAL_OR_KEYWORD else f"{p.name}="  # by position where it can: cheaper
        if not renamed and not (after_renamed and p.kind is p.POSITIONAL_OR_KEYWORD):
            heads.append(p.name if p.default is p.empty else f"{p.name}={default}")
            passes.append(f"{by}{p.name}")
        elif p.default is p.empty:  # given by its old name, or missing: the slow path's
            heads.append(f"{p.name}=_sparsekv_not_given")
            passes.append(f"{by}{p.name}")
            required.append(p.name)
        else:  # the sentinel tells a default from a value the call gave (with the old name: both given)
            heads.append(f"{p.name}=_sparsekv_not_given")
            passes.append(f"{by}{default} if {p.name} is _sparsekv_not_given else {p.name}")
    if not star:
        heads.append("*")
    heads += [f"{old}=_sparsekv_not_given" for old in old_to_new]
    slow = [f"{name} is _sparsekv_not_given" for name in required]
    slow += [f"{old} is not _sparsekv_not_given" for old in old_to_new]
    given = ", ".join(f"{name!r}: {name}" for name in [p.name for p in params] + list(old_to_new))
    source = (f"def {fn.__name__}({', '.join(heads)}):\n"
              f"    if {' or '.join(slow)}:\n"
              f"        _sparsekv_given = {{{given}}}\n"
              f"        return _sparsekv_fn(**_sparsekv_rename({{k: v for k, v in _sparsekv_given.items() "
              f"if v is not _sparsekv_not_given}}))\n"
              f"    return _sparsekv_fn({', '.join(passes)})\n")
    exec(source, scope)  # noqa: S102 - the source above, of fn's own parameter names
    return scope[fn.__name__]

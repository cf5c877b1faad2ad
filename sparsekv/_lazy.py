"""Lazy package attributes: ``from package import Name`` imports only the module defining Name."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, modules: Mapping[str, str]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``package`` resolving each name from ``modules[name]``
    (a submodule name relative to ``package``)."""

    def __getattr__(name: str) -> object:
        if name in modules:
            return getattr(importlib.import_module(f"{package}.{modules[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

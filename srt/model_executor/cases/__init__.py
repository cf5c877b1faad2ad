"""Example memory-planning cases shipped with sparsekv (``examples.json``, package data).

``sparsekv plan-memory --list-cases`` lists them and ``--case NAME`` answers one; copy one as the
start of your own case file. The case schema is documented in ``docs/memory_cases.md``; each case
here adds a ``description``, a top-level key the planner ignores.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files

__all__ = ["catalog", "load"]


@cache
def _cases() -> tuple[dict, ...]:
    return tuple(json.loads(files(__name__).joinpath("examples.json").read_text(encoding="utf-8")))


def catalog() -> list[dict]:
    """``[{"name", "description"}]`` of every shipped case, in file order."""
    return [{"name": c["name"], "description": c["description"]} for c in _cases()]


def load(name: str) -> dict | None:
    """A copy of the shipped case called ``name``, or None."""
    for case in _cases():
        if case["name"] == name:
            return json.loads(json.dumps(case))
    return None

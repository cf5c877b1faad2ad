"""Shared test helpers: torch references (``reference``), hypothesis strategies (``strategies``)
and the backends a kernel test runs on (``backends``). Reusable by anyone testing these kernels."""

"""Shared test helpers: torch references (``reference``), hypothesis strategies (``strategies``),
the backends a kernel test runs on (``backends``) and snapshots of the runtime's whole state
(``runtime_snapshot``). Reusable by anyone testing these kernels."""

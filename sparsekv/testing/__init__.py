"""Shared test helpers: torch references (``reference``), hypothesis strategies (``strategies``),
the backends a kernel test runs on (``backends``) and helpers for HiSparse runtime tests
(``hisparse_runtime``: entry bytes, snapshots of the whole state). Reusable by anyone testing these
kernels."""

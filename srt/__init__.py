"""Runtime classes: pools, allocators, the HiSparse coordinator, memory planning.

:class:`RequestStateError` (a ``ValueError``) is the one error of a request used out of order;
see :mod:`sparsekv.srt.errors`.
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {"RequestStateError": "errors"}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

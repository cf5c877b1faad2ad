"""Runtime classes, laid out as in sglang's ``srt``: ``mem_cache`` (pools, host pools, allocators,
typed ids), ``model_executor`` (memory planning), ``managers`` (the HiSparse coordinator),
``layers`` (the attention backend an engine's model calls) and ``streams``. Import the
subpackages; each re-exports its public names.

:class:`RequestStateError` (a ``ValueError``) is the one error of a request used out of order;
see :mod:`sparsekv.srt.errors`.
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {"RequestStateError": "errors"}

__all__ = sorted([*_LAZY, "layers", "managers", "mem_cache", "model_executor", "streams"])

__getattr__ = lazy_getattr(__name__, _LAZY)

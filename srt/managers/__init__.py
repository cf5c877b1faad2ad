"""Request-level managers: :class:`HiSparseCoordinator` (staging, PD direct admission, decode
backups, swap-in, release). Names resolve lazily from their modules."""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "HiSparseCoordinator": "hisparse_coordinator",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

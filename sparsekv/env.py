"""Every ``SPARSEKV_*`` environment variable, read in one place.

Each function reads the environment when called (never at import), so tests and tools can change a
variable between calls. The README's configuration table lists the same variables and defaults.
"""

from __future__ import annotations

import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """``SPARSEKV_CACHE_DIR``: root of the JIT cache (default ``$XDG_CACHE_HOME/sparsekv`` or ``~/.cache/sparsekv``)."""
    explicit = os.environ.get("SPARSEKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sparsekv"


def log_level() -> str | None:
    """``SPARSEKV_LOG_LEVEL``: level of the ``sparsekv.*`` loggers when the CLI or
    :func:`sparsekv.log.configure` sets up logging (``DEBUG``, ``INFO``, ...; default WARNING)."""
    return os.environ.get("SPARSEKV_LOG_LEVEL", "").strip() or None


def host_compiler() -> str:
    """``SPARSEKV_CXX``: the host C++ compiler (default ``$CXX``, else ``c++``)."""
    return os.environ.get("SPARSEKV_CXX") or os.environ.get("CXX") or "c++"


def cuda_home() -> str | None:
    """``CUDA_HOME`` (or ``CUDA_PATH``): the CUDA toolkit root; None when unset."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or None


def nvcc() -> str | None:
    """``SPARSEKV_NVCC``: the nvcc to use (default ``$CUDA_HOME/bin/nvcc``); None when unset."""
    return os.environ.get("SPARSEKV_NVCC") or None


def cuda_arch() -> str | None:
    """``SPARSEKV_CUDA_ARCH``, else ``TVM_FFI_CUDA_ARCH_LIST``: target archs such as ``9.0a,10.0a``."""
    return os.environ.get("SPARSEKV_CUDA_ARCH") or os.environ.get("TVM_FFI_CUDA_ARCH_LIST") or None


def extra_cflags() -> list[str]:
    """``SPARSEKV_EXTRA_CFLAGS``: extra flags for every host and nvcc compile (part of the cache key)."""
    return os.environ.get("SPARSEKV_EXTRA_CFLAGS", "").split()


def check_indices() -> bool:
    """``SPARSEKV_CHECK_INDICES=1``: validate every index of hot-path kernels before they run."""
    return _flag("SPARSEKV_CHECK_INDICES")


def jit_strict() -> bool:
    """``SPARSEKV_JIT_STRICT=1``: a cache miss raises instead of compiling (pre-seeded images, no
    compiler on the serving path, never a compile during CUDA-graph capture)."""
    return _flag("SPARSEKV_JIT_STRICT")


def verbose_build() -> bool:
    """``SPARSEKV_JIT_VERBOSE=1``: log every compiler command line."""
    return _flag("SPARSEKV_JIT_VERBOSE")

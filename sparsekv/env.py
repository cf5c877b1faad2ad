"""Every ``SPARSEKV_*`` environment variable, read in one place.

Each function reads the environment when called (never at import), so tests and tools can change a
variable between calls. docs/configuration.md lists the same variables and defaults.
One is read outside Python: ``SPARSEKV_SIM_SEED`` (the sim backend's thread and block order, default
0), by the simulator itself (``csrc/sim/sim.h``) at every launch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def _read(name: str) -> str:
    """``os.environ.get(name, "")``, cheap when ``name`` is unset: the decode path reads
    ``SPARSEKV_CPU_BACKEND`` and ``SPARSEKV_CHECK_INDICES`` on every call, and ``os.environ.get`` raises and
    catches a ``KeyError`` for an unset variable (~2 us, more than a kernel call's FFI crossing: issue
    36 item 2). ``os.environ`` keeps its encoded copy in ``_data``, which every change through
    ``os.environ`` (``monkeypatch.setenv`` too) updates."""
    environ = os.environ
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = environ.encodekey(name)
    value = environ._data.get(key)
    return "" if value is None else environ.decodevalue(value)


#: Each name :func:`_read` looked up, as ``os.environ`` stores it (bytes on POSIX).
_ENCODED: dict[str, object] = {}


def _flag(name: str) -> bool:
    value = _read(name)
    return bool(value) and value.strip().lower() in ("1", "true", "yes", "on")  # unset: the decode path's case


def configured_cache_dir() -> Path | None:
    """``SPARSEKV_CACHE_DIR``: the JIT cache root, the only one read and written when set; None when unset."""
    explicit = os.environ.get("SPARSEKV_CACHE_DIR")
    return Path(explicit).expanduser() if explicit else None


def cache_dir() -> Path:
    """The JIT cache root: ``SPARSEKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/sparsekv`` or ``~/.cache/sparsekv``
    (when that default cannot be created or written, the cache uses ``$TMPDIR/sparsekv-cache-<uid>``)."""
    explicit = configured_cache_dir()
    if explicit is not None:
        return explicit
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


def triton_interpret() -> bool:
    """``TRITON_INTERPRET`` (triton's own): whether ``@triton.jit`` kernels run under its interpreter (``1``),
    read as cheaply as a flag (a Triton twin's call on CPU tensors reads it every call)."""
    return _read("TRITON_INTERPRET") == "1"


def cuda_arch() -> str | None:
    """``SPARSEKV_CUDA_ARCH``, else ``TVM_FFI_CUDA_ARCH_LIST``: target archs such as ``9.0a,10.0a``."""
    return os.environ.get("SPARSEKV_CUDA_ARCH") or os.environ.get("TVM_FFI_CUDA_ARCH_LIST") or None


def extra_cflags() -> list[str]:
    """``SPARSEKV_EXTRA_CFLAGS``: extra flags for every host and nvcc compile (part of the cache key)."""
    return os.environ.get("SPARSEKV_EXTRA_CFLAGS", "").split()


def check_indices() -> bool:
    """``SPARSEKV_CHECK_INDICES=1``: validate every index of hot-path kernels before they run."""
    return _flag("SPARSEKV_CHECK_INDICES")


def require_all() -> bool:
    """``SPARSEKV_REQUIRE_ALL=1`` (CI): a test whose optional component (NIXL, Mooncake, nvcc, ...) is
    missing fails with the reason instead of skipping."""
    return _flag("SPARSEKV_REQUIRE_ALL")


CPU_BACKENDS = ("cpu", "sim")


def cpu_backend() -> str:
    """``SPARSEKV_CPU_BACKEND``: the build that runs kernels on CPU tensors: ``cpu`` (default, the
    headers' host implementations) or ``sim`` (their CUDA path in the simulator, see ``csrc/sim/sim.h``)."""
    key = _ENCODED.get("SPARSEKV_CPU_BACKEND")
    if key is not None and key not in os.environ._data:  # unset, on every CPU kernel call: _read inlined
        return "cpu"
    name = _read("SPARSEKV_CPU_BACKEND")
    if not name:
        return "cpu"
    name = name.strip() or "cpu"
    if name not in CPU_BACKENDS:
        raise ValueError(f"sparsekv: SPARSEKV_CPU_BACKEND must be one of {CPU_BACKENDS}, got {name!r}")
    return name


def jit_strict() -> bool:
    """``SPARSEKV_JIT_STRICT=1``: a cache miss raises instead of compiling (pre-seeded images, no
    compiler on the serving path, never a compile during CUDA-graph capture)."""
    return _flag("SPARSEKV_JIT_STRICT")


def verbose_build() -> bool:
    """``SPARSEKV_JIT_VERBOSE=1``: show every compile on stderr (one line with its time, on the
    ``sparsekv.jit`` logger) and the compiler command lines."""
    return _flag("SPARSEKV_JIT_VERBOSE")


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"sparsekv: {name} must be a positive number of seconds, got {text!r}")
    return value


def jit_compile_timeout() -> float:
    """``SPARSEKV_JIT_COMPILE_TIMEOUT``: seconds one module's build may take; then its compilers are
    killed and the load raises ``JitCompileTimeoutError`` (default 600)."""
    return _seconds("SPARSEKV_JIT_COMPILE_TIMEOUT", 600.0)


def jit_lock_timeout() -> float:
    """``SPARSEKV_JIT_LOCK_TIMEOUT``: seconds a load waits for another process's build of the same
    module (default: the compile timeout plus 60); a builder that is stopped, or gone while its lock
    is held, ends the wait sooner (after at most 10 s). Either raises ``CacheLockTimeoutError``
    naming the builder's pid."""
    return _seconds("SPARSEKV_JIT_LOCK_TIMEOUT", jit_compile_timeout() + 60.0)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str, what: str = "size") -> int:
    """``"20G"``, ``"20GiB"``, ``"512MB"``, ``"1048576"`` -> bytes (binary units: ``G`` = ``GiB`` = 2**30).

    Raises
    ------
    ValueError
        Names ``what`` and shows the accepted forms.
    """
    match = _SIZE.match(str(text))
    if match is None:
        raise ValueError(f"sparsekv: {what} {text!r} is not a size; use e.g. 20G, 512MiB or a byte count")
    return int(float(match.group(1)) * 1024 ** _SIZE_UNITS[match.group(2).upper()])


def cache_max_size() -> int | None:
    """``SPARSEKV_CACHE_MAX_SIZE``: size cap of the JIT cache (e.g. ``20G``); after each build the least
    recently loaded entries are removed until the cache fits. None (no cap) when unset."""
    text = os.environ.get("SPARSEKV_CACHE_MAX_SIZE", "").strip()
    return parse_size(text, "SPARSEKV_CACHE_MAX_SIZE") if text else None


def max_jobs() -> int | None:
    """``SPARSEKV_MAX_JOBS``: parallel compiles of ``sparsekv jit build`` (default: from free cores and
    memory, cgroup limits included). None when unset."""
    text = os.environ.get("SPARSEKV_MAX_JOBS", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"sparsekv: SPARSEKV_MAX_JOBS must be a positive integer, got {text!r}")
    return int(text)


SANITIZERS = ("address", "undefined")


def sanitize() -> tuple[str, ...]:
    """``SPARSEKV_SANITIZE=address,undefined``: build cpu-backend modules with these sanitizers (part of
    the cache key; ``address`` needs the compiler's libasan preloaded, see ``make test-sanitize``)."""
    names = tuple(sorted({n.strip() for n in os.environ.get("SPARSEKV_SANITIZE", "").split(",") if n.strip()}))
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown:
        raise ValueError(f"sparsekv: SPARSEKV_SANITIZE names unknown sanitizers {unknown}; supported: {SANITIZERS}")
    return names


def mooncake_libdir() -> Path | None:
    """``SPARSEKV_MOONCAKE_LIBDIR``: where Mooncake's system libraries (``libibverbs.so.1``,
    ``libnl-3.so.200``, ``libnl-route-3.so.200``) are, when the system has none: a directory of the
    libraries, or the root the Debian packages were extracted into. None when unset (then
    ``<venv>/sysroot`` and the system's loader path are searched)."""
    text = os.environ.get("SPARSEKV_MOONCAKE_LIBDIR", "").strip()
    return Path(text).expanduser() if text else None

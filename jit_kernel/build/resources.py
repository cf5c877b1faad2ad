"""How many compiles a machine can run at once: cores and free memory, container (cgroup) limits included.

A compile of one module peaks at about :data:`COMPILE_BYTES` of resident memory; running more of them
than memory allows sends the host into swap or the OOM killer, which is what a plain
``cpu_count()`` job count does inside a memory-limited container.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparsekv import env

#: Peak resident memory of one compile (measured: g++ 12 on a tvm-ffi module ~0.4 GiB, nvcc + cicc
#: for sm_90a and sm_100a ~1.2 GiB), rounded up for headroom.
COMPILE_BYTES = {"cpu": 1 << 30, "cuda": 2 << 30}

_CGROUP = Path("/sys/fs/cgroup")
_MEMINFO = Path("/proc/meminfo")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dir() -> Path:
    """This process's cgroup v2 directory (the unified hierarchy's root when unknown)."""
    text = _read(Path("/proc/self/cgroup")) or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            candidate = _CGROUP / line[3:].lstrip("/")
            if candidate.is_dir():
                return candidate
    return _CGROUP


def available_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = _read(_cgroup_dir() / "cpu.max") or ""  # v2: "<quota> <period>" or "max <period>"
    parts = quota.split()
    if len(parts) == 2 and parts[0].isdigit():
        cores = min(cores, max(1, int(parts[0]) // int(parts[1])))
    v1_quota, v1_period = _read(_CGROUP / "cpu" / "cpu.cfs_quota_us"), _read(_CGROUP / "cpu" / "cpu.cfs_period_us")
    if v1_quota and v1_period and v1_quota.lstrip("-").isdigit() and int(v1_quota) > 0:
        cores = min(cores, max(1, int(v1_quota) // int(v1_period)))
    return max(1, cores)


def available_memory() -> int:
    """Bytes that can be allocated without swapping: ``MemAvailable``, capped by the cgroup's headroom."""
    available = None
    for line in (_read(_MEMINFO) or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    group = _cgroup_dir()
    for limit_file, usage_file in ((group / "memory.max", group / "memory.current"),
                                   (_CGROUP / "memory" / "memory.limit_in_bytes",
                                    _CGROUP / "memory" / "memory.usage_in_bytes")):
        limit, usage = _read(limit_file), _read(usage_file)
        # v1 reports "no limit" as a huge number; v2 as "max".
        if limit and usage and limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            available = min(available, max(0, int(limit) - int(usage)))
    return available


def build_jobs(backend: str, requested: int | None = None, *, cores: int | None = None,
               memory: int | None = None) -> int:
    """Parallel compiles for ``backend``: ``requested`` (``--jobs``), else ``SPARSEKV_MAX_JOBS``, else
    the smaller of the usable cores and the free memory divided by :data:`COMPILE_BYTES`; at least 1.

    ``cores`` and ``memory`` (bytes) default to :func:`available_cores` and :func:`available_memory`,
    this machine's state at the call; a caller (a test) may pass them instead.
    """
    explicit = requested or env.max_jobs()
    if explicit:
        return explicit
    cores = available_cores() if cores is None else cores
    memory = available_memory() if memory is None else memory
    return max(1, min(cores, memory // COMPILE_BYTES[backend]))

"""``sparsekv jit doctor``: what the JIT needs on this machine, what is missing, and how to fix it.

Each check is a :class:`Check` with a status: ``ok``, ``warn`` (a feature is unavailable, e.g. the
cuda backend without a driver) or ``fail`` (the cpu backend cannot work: no C++ compiler, no
tvm-ffi, an unusable cache). The report is meant to be pasted into a bug report as it is.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import stat
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sparsekv import env


@dataclass
class Check:
    """One line of the report: ``name``, ``status`` (ok / warn / fail), what was found, and the fix."""

    name: str
    status: str
    value: str
    fix: str = ""


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions() -> list[Check]:
    checks = [Check("python", "ok", f"{sys.version.split()[0]} ({platform.machine()}, {platform.system()})")]
    for label, dist in (("torch", "torch"), ("triton", "triton"), ("tvm-ffi", "apache-tvm-ffi"),
                        ("cuda-python", "cuda-python"), ("sparsekv", "sparsekv")):
        value = _version(dist)
        missing = value == "not installed"
        status = "fail" if missing and label in ("tvm-ffi", "torch") else "ok"
        checks.append(Check(label, status, value, f"pip install {dist}" if status == "fail" else ""))
    return checks


def _version_of(compiler) -> str:
    """The compiler's ``--version`` line (its identity without the leading file name)."""
    return compiler.identity.removeprefix(Path(compiler.path).name + " ")


def _compilers() -> list[Check]:
    from sparsekv.jit_kernel.build import toolchain

    checks = []
    try:
        cxx = toolchain.host_compiler(None)
        checks.append(Check("host compiler", "ok", f"{cxx.path}: {_version_of(cxx)}"))
    except toolchain.ToolchainError as exc:
        checks.append(Check("host compiler", "fail", str(exc).removeprefix("sparsekv: "),
                            "install g++ (e.g. `apt-get install g++`) or set SPARSEKV_CXX to a C++17 compiler"))
    try:
        home = toolchain.cuda_home()
        nvcc = toolchain.nvcc(None)
        checks.append(Check("nvcc", "ok", f"{nvcc.path}: {_version_of(nvcc)}"))
        cudart = home / "lib64" / "libcudart.so"
        checks.append(Check("CUDA home", "ok" if cudart.exists() else "warn",
                            f"{home} ({'has' if cudart.exists() else 'no'} lib64/libcudart.so)",
                            "" if cudart.exists() else "point CUDA_HOME at a full toolkit (the cuda backend links "
                                                       "lib64/libcudart.so)"))
    except toolchain.ToolchainError as exc:
        checks.append(Check("nvcc", "warn", str(exc).removeprefix("sparsekv: "),
                            "only needed for the cuda backend: install the CUDA toolkit and set CUDA_HOME"))
    return checks


def _gpu() -> list[Check]:
    """Driver, device, arch and shared-memory opt-in through cuda-python; a clean line without a driver."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return [Check("GPU", "warn", "cuda-python is not installed", "pip install cuda-python")]
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # cuda-python raises when libcuda.so cannot be loaded
        return [Check("GPU", "warn", f"no NVIDIA driver ({exc})",
                      "the cuda backend cannot run here; the cpu backend works. Install the NVIDIA driver on a "
                      "GPU machine")]
    if int(err) != 0:
        return [Check("GPU", "warn", f"no usable NVIDIA driver (cuInit: {err.name})",
                      "the cuda backend cannot run here; the cpu backend works")]
    checks = []
    _, version = driver.cuDriverGetVersion()
    checks.append(Check("driver", "ok", f"CUDA driver API {version // 1000}.{version % 1000 // 10}"))
    _, count = driver.cuDeviceGetCount()
    if count == 0:
        return checks + [Check("GPU", "warn", "driver present, no visible device", "check CUDA_VISIBLE_DEVICES")]
    attr = driver.CUdevice_attribute
    for ordinal in range(count):
        _, device = driver.cuDeviceGet(ordinal)
        _, name = driver.cuDeviceGetName(64, device)
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        _, smem = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device)
        checks.append(Check(f"GPU {ordinal}", "ok",
                            f"{name.decode(errors='replace').rstrip(chr(0))}, sm_{major}{minor}, shared memory "
                            f"opt-in {smem // 1024} KiB per block (bounds the swap-in's top-k and hot buffer)"))
    return checks


def _cache() -> list[Check]:
    from sparsekv.jit_kernel.build import cache

    checks, readable = [], ()
    try:
        roots = cache.open_roots()
        readable = roots.read
        write = roots.write
    except cache.CacheUnwritableError as exc:
        if not readable:
            return [Check("cache", "fail", str(exc).removeprefix("sparsekv: "),
                          "set SPARSEKV_CACHE_DIR to a private directory you can write")]
        write = None  # a read-only, pre-seeded cache: its modules load, nothing new can be built
        checks.append(Check("cache", "warn", f"{roots.root} is read-only: its modules load, a miss is an error",
                            "prebuild every module this deployment loads (`sparsekv jit build --model ...`)"))
    except PermissionError as exc:
        return [Check("cache", "fail", str(exc).removeprefix("sparsekv: "),
                      "set SPARSEKV_CACHE_DIR to a private directory you can write")]
    if write is not None:
        st = write.stat()
        usage = shutil.disk_usage(write)
        owner = "this user" if st.st_uid == os.getuid() else f"uid {st.st_uid}"
        low = usage.free < 1 << 30
        checks.append(Check("cache", "warn" if low else "ok",
                            f"{write} (owner {owner}, mode {stat.S_IMODE(st.st_mode):o}, {usage.free / 2**30:.1f} GiB "
                            f"free)" + ("" if write == roots.primary else f"; the default {roots.primary} is unusable"),
                            "free disk space or set SPARSEKV_CACHE_DIR elsewhere" if low else ""))
    count = sum(len(cache.entries(r)) for r in readable)
    checks.append(Check("cached modules", "ok", str(count)))
    leftovers = [p for r in readable for p in cache.sweep_leftovers(r, dry_run=True) if p.parent.name == ".staging"]
    if leftovers:
        checks.append(Check("leftovers", "warn", f"{len(leftovers)} staging directories of dead or failed builds",
                            "sparsekv jit clean --stale"))
    return checks


def _settings() -> list[Check]:
    strict = env.jit_strict()
    checks = [Check("strict mode", "ok", "on (a cache miss raises)" if strict else "off (misses compile)")]
    try:
        sanitize = env.sanitize()
        checks.append(Check("sanitizers", "ok", ",".join(sanitize) or "off"))
    except ValueError as exc:
        checks.append(Check("sanitizers", "fail", str(exc).removeprefix("sparsekv: "), "fix SPARSEKV_SANITIZE"))
    set_vars = sorted(k for k in os.environ if k.startswith("SPARSEKV_") or k in ("CUDA_HOME", "CUDA_PATH", "CXX"))
    checks.append(Check("environment", "ok", ", ".join(f"{k}={os.environ[k]}" for k in set_vars) or "nothing set"))
    return checks


def run_checks() -> list[Check]:
    """Every check, in report order."""
    return _versions() + _compilers() + _gpu() + _cache() + _settings()


def usable(checks: list[Check]) -> bool:
    """Whether the cpu backend can build and load modules (no check failed)."""
    return all(c.status != "fail" for c in checks)


def as_json(checks: list[Check]) -> dict:
    return {"usable": usable(checks), "checks": [asdict(c) for c in checks]}


def as_text(checks: list[Check]) -> str:
    lines = ["sparsekv jit doctor"]
    for c in checks:
        lines.append(f"[{c.status:>4}] {c.name}: {c.value}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    lines.append("cpu backend: usable" if usable(checks) else "cpu backend: NOT usable (see [fail] lines)")
    return "\n".join(lines)


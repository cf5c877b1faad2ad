"""Compilers: where they are and who they are.

A compiler's identity (its name and ``--version`` line, never its path) enters the cache key. The
``--version`` probe is cached in-process and on disk, keyed by the compiler file's path, size and
mtime, so a warm load spawns no process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from sparsekv import env


class ToolchainError(RuntimeError):
    """A compiler or toolkit the build needs is missing or unusable."""


@dataclass(frozen=True)
class Compiler:
    """A compiler found on this machine.

    Attributes
    ----------
    path : str
        Absolute path used to run it (never part of the cache key).
    identity : str
        ``"<basename> <first --version line>"``, e.g. ``"g++ g++ (Debian 12.2.0-14) 12.2.0"``.
    """

    path: str
    identity: str


_probe_lock = threading.Lock()
_probed: dict[tuple[str, int, int], str] = {}

# nvcc prints a banner first; its version is on the "release" line.
_NVCC_RELEASE = re.compile(r"release [0-9.]+, V[0-9.]+")


def _version_line(path: str) -> str:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ToolchainError(f"sparsekv: `{path} --version` failed: {exc}") from exc
    match = _NVCC_RELEASE.search(out)
    if match:
        return "nvcc " + match.group(0)
    return out.strip().splitlines()[0] if out.strip() else "unknown"


def identify(path: str, probe_dir: Path | None) -> Compiler:
    """Return the identity of the compiler at ``path``, probing it at most once per file version.

    Parameters
    ----------
    path : str
        Absolute path of the compiler.
    probe_dir : Path or None
        Directory for the on-disk probe cache (None: in-process only).
    """
    st = os.stat(path)
    memo_key = (path, st.st_size, st.st_mtime_ns)
    with _probe_lock:
        cached = _probed.get(memo_key)
    if cached is None:
        record = None
        if probe_dir is not None:
            digest = hashlib.sha256(repr(memo_key).encode()).hexdigest()[:16]
            record = probe_dir / f"{Path(path).name}-{digest}.json"
            try:
                cached = json.loads(record.read_text())["version"]
            except (OSError, ValueError, KeyError):
                cached = None
        if cached is None:
            cached = _version_line(path)
            if record is not None:
                try:
                    record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    tmp = record.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps({"path": path, "version": cached}))
                    os.replace(tmp, record)
                except OSError:
                    pass  # a read-only cache only costs a probe per process
        with _probe_lock:
            _probed[memo_key] = cached
    return Compiler(path=path, identity=f"{Path(path).name} {cached}")


def host_compiler_path() -> str:
    """Absolute path of the host C++ compiler (``SPARSEKV_CXX``, ``CXX`` or ``c++``)."""
    name = env.host_compiler()
    path = shutil.which(name)
    if path is None:
        raise ToolchainError(
            f"sparsekv: host C++ compiler {name!r} not found on PATH; install g++ or set SPARSEKV_CXX"
        )
    return path


def host_compiler(probe_dir: Path | None) -> Compiler:
    """The host C++ compiler and its identity."""
    return identify(host_compiler_path(), probe_dir)


def cuda_home() -> Path:
    """The CUDA toolkit root: ``CUDA_HOME``/``CUDA_PATH``, else ``/usr/local/cuda`` when it exists."""
    root = env.cuda_home()
    if root is None and Path("/usr/local/cuda/bin/nvcc").exists():
        root = "/usr/local/cuda"
    if root is None:
        raise ToolchainError(
            "sparsekv: the cuda backend needs the CUDA toolkit; set CUDA_HOME to its root "
            "(the directory holding bin/nvcc and lib64/libcudart.so)"
        )
    if not (Path(root) / "bin" / "nvcc").exists() and env.nvcc() is None:
        raise ToolchainError(f"sparsekv: CUDA_HOME={root} has no bin/nvcc; point CUDA_HOME at the toolkit root")
    return Path(root)


def nvcc_path() -> str:
    """Absolute path of nvcc: ``SPARSEKV_NVCC``, else ``$CUDA_HOME/bin/nvcc``."""
    explicit = env.nvcc()
    path = shutil.which(explicit) if explicit else str(cuda_home() / "bin" / "nvcc")
    if path is None or not os.path.exists(path):
        raise ToolchainError(
            f"sparsekv: nvcc not found ({explicit or path}); install the CUDA toolkit or set SPARSEKV_NVCC"
        )
    return path


def nvcc(probe_dir: Path | None) -> Compiler:
    """nvcc and its identity."""
    return identify(nvcc_path(), probe_dir)

"""CUDA target architectures: parse, validate and resolve them.

An arch is ``major.minor`` with an optional ``a``/``f`` suffix (``9.0a`` -> ``sm_90a``). Resolution
order: an explicit list, ``SPARSEKV_CUDA_ARCH``, ``TVM_FFI_CUDA_ARCH_LIST``, then the visible
device through cuda-python.
"""

from __future__ import annotations

import re

from sparsekv import env

_ARCH = re.compile(r"^(\d+)\.(\d)([af]?)$")
# CUDA 13 dropped everything below Turing.
MIN_ARCH = (7, 5)


class ArchError(ValueError):
    """An arch list that is malformed, unsupported or cannot be resolved."""


def parse_arch_list(text: str) -> tuple[str, ...]:
    """Parse ``"9.0a,10.0a"`` or ``"9.0a 10.0a"`` into a sorted, de-duplicated tuple.

    Raises
    ------
    ArchError
        An entry is malformed or older than sm_75.
    """
    archs = []
    for token in re.split(r"[,;\s]+", text.strip()):
        if not token:
            continue
        match = _ARCH.match(token)
        if match is None:
            raise ArchError(f"sparsekv: CUDA arch {token!r} is malformed; expected e.g. '9.0a' or '10.0a'")
        if (int(match.group(1)), int(match.group(2))) < MIN_ARCH:
            raise ArchError(f"sparsekv: CUDA arch {token!r} is not supported by CUDA 13 (sm_75 or newer)")
        archs.append(token)
    if not archs:
        raise ArchError("sparsekv: empty CUDA arch list")
    return tuple(sorted(set(archs), key=lambda a: (int(a.split(".")[0]), a)))


def sm_name(arch: str) -> str:
    """``"9.0a"`` -> ``"90a"``."""
    major, rest = arch.split(".")
    return major + rest


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    """SASS for every arch plus PTX of the newest, so a newer GPU can still JIT the code."""
    flags = [f"-gencode=arch=compute_{sm_name(a)},code=sm_{sm_name(a)}" for a in archs]
    newest = sm_name(archs[-1])
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


def _visible_device_arch() -> str:
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise ArchError(
            "sparsekv: no CUDA arch given and cuda-python is not installed; pass --arch or set SPARSEKV_CUDA_ARCH"
        ) from exc
    try:
        err, device = runtime.cudaGetDevice()
        if int(err) == 0:
            attr = runtime.cudaDeviceAttr
            err, major = runtime.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device)
            err2, minor = runtime.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device)
            if int(err) == 0 and int(err2) == 0:
                # Hopper and Blackwell datacenter parts need the arch-specific ("a") target for their features.
                return f"{major}.{minor}" + ("a" if major in (9, 10) else "")
    except RuntimeError as exc:  # cuda-python raises DynamicLibNotFoundError (a RuntimeError) without a driver
        raise ArchError("sparsekv: no CUDA arch given and no NVIDIA driver to ask the GPU's; pass --arch or set "
                        "SPARSEKV_CUDA_ARCH, e.g. '9.0a'") from exc
    raise ArchError(
        f"sparsekv: no CUDA arch given and no visible CUDA device ({getattr(err, 'name', err)}); pass --arch or "
        f"set SPARSEKV_CUDA_ARCH, e.g. '9.0a'"
    )


def resolve_arch_list(explicit: str | tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The arch list to build for (see module docstring for the order)."""
    if explicit:
        return parse_arch_list(explicit if isinstance(explicit, str) else ",".join(explicit))
    configured = env.cuda_arch()
    if configured:
        return parse_arch_list(configured)
    return parse_arch_list(_visible_device_arch())

"""Triton twins of the tensor-core-bound kernels, one module per kernel stem (``triton/<stem>.py``).

The public functions of :mod:`sparsekv.jit_kernel.dsv4` take ``impl="auto" | "header" | "triton"``;
this package holds the Triton sources and launchers they call for ``"triton"``, the Python mirror
of the header's input contract (:mod:`.checks`) and the ahead-of-time compile (:mod:`.aot`).
Nothing here imports triton at package import: ``TRITON_INTERPRET=1`` is read when the kernels are
decorated, so the launchers' modules load on first use.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["IMPLS", "interpreting", "resolve_impl"]

#: The values of the public functions' ``impl=`` keyword.
IMPLS = ("auto", "header", "triton")


def interpreting() -> bool:
    """Whether ``@triton.jit`` kernels run under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_INSTALLED: list[bool] = []  # memo: a find_spec that misses scans sys.path (~0.1 ms on every attention call)


def _installed() -> bool:
    if not _INSTALLED:
        _INSTALLED.append(importlib.util.find_spec("triton") is not None)
    return _INSTALLED[0]


def resolve_impl(impl: str, device, *, auto_triton_on_cuda: bool) -> str:
    """``"header"`` or ``"triton"`` for a call on ``device`` (a ``torch.device``).

    ``"auto"`` picks ``"triton"`` for CUDA tensors when the function's Triton twin is the faster one
    (``auto_triton_on_cuda``: the tensor-core kernels) and triton is installed, else ``"header"``; CPU
    tensors always get the header (the interpreter is a test vehicle, not speed).

    Raises
    ------
    ValueError
        ``impl`` is not one of :data:`IMPLS`, or ``"triton"`` on CPU tensors without
        ``TRITON_INTERPRET=1`` or without triton installed.
    """
    if impl not in IMPLS:
        raise ValueError(f"sparsekv: argument `impl` must be one of {list(IMPLS)}, got {impl!r}")
    installed = _installed()
    if impl == "auto":
        return "triton" if device.type == "cuda" and auto_triton_on_cuda and installed else "header"
    if impl == "triton":
        if not installed:
            raise ValueError("sparsekv: argument `impl` is 'triton', but triton is not installed")
        if device.type != "cuda" and not interpreting():
            raise ValueError("sparsekv: argument `impl` is 'triton' on CPU tensors, which runs only under the "
                             "Triton interpreter: set TRITON_INTERPRET=1 before triton is imported")
    return impl

"""Triton twins of the tensor-core-bound kernels, one module per kernel stem (``triton/<stem>.py``).

The public functions of :mod:`sparsekv.jit_kernel.dsv4` take ``impl="auto" | "header" | "triton"``;
this package holds the Triton sources and launchers they call for ``"triton"``, the Python mirror
of the header's input contract (:mod:`.checks`) and the ahead-of-time compile (:mod:`.aot`).
Nothing here imports triton at package import: ``TRITON_INTERPRET=1`` is read when the kernels are
decorated, so the launchers' modules load on first use.
"""

from __future__ import annotations

import importlib.util

import torch

from sparsekv import env

__all__ = ["IMPLS", "interpreting", "resolve_impl"]

#: The values of the public functions' ``impl=`` keyword.
IMPLS = ("auto", "header", "triton")


def interpreting() -> bool:
    """Whether ``@triton.jit`` kernels run under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return env.triton_interpret()


_INSTALLED: list[bool] = []  # memo: a find_spec that misses scans sys.path (~0.1 ms on every attention call)


def _installed() -> bool:
    if not _INSTALLED:
        _INSTALLED.append(importlib.util.find_spec("triton") is not None)
    return _INSTALLED[0]


def resolve_impl(impl: str, device) -> str:
    """``"header"`` or ``"triton"`` for a call on ``device`` (a ``torch.device``, or a tensor on it: its
    device is read only for ``"triton"``, off the decode path's ``"auto"`` and ``"header"``).

    ``"auto"`` picks ``"header"`` on every device, for every kernel: the one GPU measurement so far
    (an H200, docs/sim-and-triton.md) has the header ahead wherever both ran (attention at
    batch 1, indexer scores over 64k entries, the top-k), and the memory-bound twins are not timed
    yet; on CPU tensors the interpreter is a test vehicle, not speed. ``"triton"`` must be asked for.

    Raises
    ------
    ValueError
        ``impl`` is not one of :data:`IMPLS`, or ``"triton"`` on CPU tensors without
        ``TRITON_INTERPRET=1`` or without triton installed.
    """
    if impl == "auto" or impl == "header":  # the decode path's cases first
        return "header"
    if impl not in IMPLS:
        raise ValueError(f"sparsekv: argument `impl` must be one of {list(IMPLS)}, got {impl!r}")
    if not _installed():
        raise ValueError("sparsekv: argument `impl` is 'triton', but triton is not installed")
    # A tensor's flag, where it is one: a device's `.type` makes a new str at each read (~0.35 us).
    on_gpu = device.is_cuda if isinstance(device, torch.Tensor) else device.type == "cuda"
    if not on_gpu and not interpreting():
        raise ValueError("sparsekv: argument `impl` is 'triton' on CPU tensors, which runs only under the "
                         "Triton interpreter: set TRITON_INTERPRET=1 before triton is imported")
    return impl

"""Which backends kernel tests run on.

``SPARSEKV_TEST_BACKENDS`` (comma list) forces a set, e.g. ``cpu,cuda`` for ``make test-gpu``;
otherwise ``cpu`` always, plus ``cuda`` when torch sees a GPU.
"""

from __future__ import annotations

import os

import torch


def kernel_backends() -> list[str]:
    """Backends to parametrize kernel tests over."""
    forced = os.environ.get("SPARSEKV_TEST_BACKENDS")
    if forced:
        backends = [b.strip() for b in forced.split(",") if b.strip()]
        if "cuda" in backends and not torch.cuda.is_available():
            raise RuntimeError("SPARSEKV_TEST_BACKENDS asks for cuda, but torch sees no GPU")
        return backends
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def device_of(backend: str) -> torch.device:
    """The torch device a backend's tensors live on."""
    return torch.device("cuda" if backend == "cuda" else "cpu")

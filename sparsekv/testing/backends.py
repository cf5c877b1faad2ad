"""Which backends kernel tests run on, and how a test moves its tensors there.

``SPARSEKV_TEST_BACKENDS`` (comma list) forces a set, e.g. ``cpu,cuda`` for ``make test-gpu`` or
``sim`` for ``make test-sim``; otherwise ``cpu`` always, plus ``cuda`` when torch sees a GPU. Forcing
``cuda`` without a GPU still collects the cuda tests (so the set of tests can be checked anywhere);
they fail at run time with the reason (``tests/conftest.py``).

The sim backend takes CPU tensors: while a sim test runs, ``SPARSEKV_CPU_BACKEND=sim`` routes every
call on CPU tensors to the sim build (:func:`cpu_backend`), so a test runs there unchanged.

On a non-cpu backend, :func:`run_on_backend` first runs the cpu build of the same header on copies
of the inputs: the cpu build is the reference the cuda and sim builds must match bit for bit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import overload

import torch

from sparsekv.jit_kernel.build.loader import BACKENDS


def kernel_backends() -> list[str]:
    """Backends to parametrize kernel tests over.

    Raises
    ------
    ValueError
        ``SPARSEKV_TEST_BACKENDS`` names an unknown backend.
    """
    forced = os.environ.get("SPARSEKV_TEST_BACKENDS")
    if forced:
        backends = [b.strip() for b in forced.split(",") if b.strip()]
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"SPARSEKV_TEST_BACKENDS names unknown backends {unknown}; known: {list(BACKENDS)}")
        return backends
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def core_backends() -> list:
    """Backends for each kernel family's core property test, as ``pytest.param`` values marked ``core``:
    :func:`kernel_backends`, plus ``sim`` in a session that did not choose its backends (``make test``),
    so a plain ``make test`` runs every family's CUDA path at the test's small count too (``make
    test-sim`` runs every test there). The mark lets CI's ``make test-sim``, which runs after ``make
    test``, leave out (``-m "not core"``) the sim runs ``make test`` already made."""
    import pytest

    backends = kernel_backends()
    if not (os.environ.get("SPARSEKV_TEST_BACKENDS") or "sim" in backends):
        backends = [*backends, "sim"]
    return [pytest.param(backend, marks=pytest.mark.core) for backend in backends]


def unavailable_reason(backend: str) -> str | None:
    """Why ``backend`` cannot run here, or None when it can."""
    if backend == "cuda" and not torch.cuda.is_available():
        return "SPARSEKV_TEST_BACKENDS asks for cuda, but torch sees no GPU"
    return None


def triton_unavailable_reason(backend: str) -> str | None:
    """Why the Triton kernels cannot run on ``backend``'s tensors in this process, or None when they can.

    CPU tensors need the interpreter (``TRITON_INTERPRET=1`` when triton was imported: ``tests/conftest.py``
    turns it on for a session without the cuda backend); CUDA tensors need it off and a GPU.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "cuda":
        return "the Triton interpreter is on in this session" if interpreting else unavailable_reason(backend)
    if not interpreting:
        return ("Triton on CPU tensors needs TRITON_INTERPRET=1 at triton's import: a session without the cuda "
                "backend sets it (SPARSEKV_TEST_BACKENDS=cpu)")
    return None


def skip_unless_triton_runs(backend: str) -> None:
    """Skip the running test where the Triton twins cannot run on ``backend``'s tensors: for want of triton
    (a missing component: :func:`sparsekv.testing.components.component_missing`), or because the session
    has the cuda backend and so the interpreter is on or off for all (a GPU skip)."""
    from sparsekv.testing.components import component_missing, skip_for_gpu

    reason = triton_unavailable_reason(backend)
    if reason is None:
        return
    if importlib.util.find_spec("triton") is None:
        component_missing("triton", reason)
    skip_for_gpu(reason)


def triton_examples() -> int:
    """Hypothesis examples for a Triton-twin property test: the interpreter costs about a second per
    example at the tests' shapes, so a fifth of the active profile's count (at least 4)."""
    from hypothesis import settings

    return max(4, settings().max_examples // 5)


def device_of(backend: str) -> torch.device:
    """The torch device a backend's tensors live on (the sim backend's are CPU tensors)."""
    return torch.device("cuda" if backend == "cuda" else "cpu")


def host_readable(backend: str) -> bool:
    """Whether the host entry can read ``backend``'s tensors (and so validates indices in full)."""
    return device_of(backend).type == "cpu"


@contextlib.contextmanager
def cpu_backend(name: str) -> Iterator[None]:
    """Run the calls on CPU tensors inside the block on the ``name`` build (``cpu`` or ``sim``):
    ``SPARSEKV_CPU_BACKEND`` is set for the block and restored after it."""
    before = os.environ.get("SPARSEKV_CPU_BACKEND")
    os.environ["SPARSEKV_CPU_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPARSEKV_CPU_BACKEND", None)
        else:
            os.environ["SPARSEKV_CPU_BACKEND"] = before


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """``torch.set_num_threads(count)`` inside the block, restored after it (the cpu backend's prefill
    kernels split their items over that many host threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@overload
def to_backend(backend: str, values: Mapping[str, object]) -> dict[str, object]: ...
@overload
def to_backend(backend: str, values: Sequence[object]) -> list[object]: ...


def to_backend(backend, values):
    """``values`` (a mapping or a sequence) with every tensor moved to ``backend``'s device, others unchanged."""
    return to_device(device_of(backend), values)


def to_device(device: torch.device, values):
    """``values`` with every tensor on ``device`` as the same view of a moved buffer.

    ``Tensor.to`` packs a view that is not dense (``x[..., 0]``, ``x[::2]``) into a fresh contiguous
    tensor and moves two views of one buffer into two buffers, so a bad-input test of a strided or
    aliased argument would pass on the CPU and test nothing on a GPU (seen on an H200). Here each
    buffer moves once, and every tensor is rebuilt on it with its sizes, strides and offset.
    """
    moved: dict[int, torch.Tensor] = {}

    def move(v):
        if not isinstance(v, torch.Tensor) or v.device == torch.device(device):
            return v
        storage = v.untyped_storage()
        key = storage.data_ptr()
        if key not in moved:
            moved[key] = torch.empty(0, dtype=torch.uint8).set_(storage).to(device)
        return moved[key].view(v.dtype).as_strided(v.size(), v.stride(), v.storage_offset())

    if isinstance(values, Mapping):
        return {k: move(v) for k, v in values.items()}
    return [move(v) for v in values]


def run_on_backend(backend: str, fn: Callable[..., object], tensors: Mapping[str, object], **scalars: object) -> None:
    """Call ``fn(**tensors, **scalars)`` on ``backend``; updated tensors are copied back in place.

    ``tensors`` live on the CPU (None entries pass through). On a non-cpu backend the same call first
    runs on CPU clones (the cpu build), and afterwards every tensor must equal the cpu build's.

    Raises
    ------
    AssertionError
        The two builds disagree on some tensor (the message names it).
    """
    if backend == "cpu":
        fn(**tensors, **scalars)
        return
    reference = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    with cpu_backend("cpu"):
        fn(**reference, **scalars)
    moved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in to_backend(backend, tensors).items()}
    with cpu_backend(backend if backend == "sim" else "cpu"):
        fn(**moved, **scalars)
    if backend == "cuda":
        torch.cuda.synchronize()
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            value.copy_(moved[name].cpu())
            assert torch.equal(value, reference[name]), f"the {backend} and cpu builds disagree on `{name}`"

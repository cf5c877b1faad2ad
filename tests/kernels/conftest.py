"""Every test under tests/kernels runs once per kernel backend (cpu; cuda too on a GPU; sim on request).

The autouse fixture parametrizes each test with ``backend``; a test that runs a kernel takes the
``backend`` argument and puts its tensors on ``device_of(backend)`` (or goes through
``run_on_backend``, which also checks the cuda or sim build against the cpu build). While a sim test
runs, calls on CPU tensors go to the sim build (``SPARSEKV_CPU_BACKEND=sim``), so the same test body
exercises the kernels' CUDA path. A test whose body
does not depend on the backend (it runs no kernel, or only a documented CPU example) says so with
``@pytest.mark.no_backend("why")``. ``tests/test_backend_coverage.py`` checks
both: every test is collected per backend, and every test body uses its backend or carries the mark.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.testing.backends import cpu_backend, kernel_backends, skip_unless_triton_runs


@pytest.fixture(params=kernel_backends(), autouse=True, scope="module")
def backend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _cpu_tensors_go_to_the_sim_build_in_sim_tests(request):
    # Per test, from the test's own `backend` parameter: a test may parametrize `backend` itself.
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend") if callspec else None
    with cpu_backend("sim" if backend == "sim" else "cpu"):
        yield


@pytest.fixture(autouse=True)
def _a_cuda_fault_fails_the_test_that_made_it(request):
    # A device fault (illegal address, trap) is sticky: every later CUDA call of the process fails, so
    # on the H200 one kernel fault showed up only as 20 unrelated failures of one worker. Waiting for the
    # device after each cuda test reports the fault, as a teardown error, on the test that launched it.
    yield
    callspec = getattr(request.node, "callspec", None)
    if (callspec.params.get("backend") if callspec else None) != "cuda":
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError as fault:
        pytest.fail(f"this test left a CUDA fault; later cuda tests of this process fail from it too: {fault}",
                    pytrace=False)


@pytest.fixture
def index_checks(backend, monkeypatch) -> None:
    """Full index validation wherever the wrappers make it opt-in (the GPU: ``SPARSEKV_CHECK_INDICES=1``).

    The cpu build always checks indices; on the device a bad-input test asks for the check, so the
    same table of bad inputs must raise the same errors there, with nothing written.
    """
    if backend != "cpu":
        monkeypatch.setenv("SPARSEKV_CHECK_INDICES", "1")


@pytest.fixture
def triton_runs_here(backend) -> None:
    """Skip a test of a Triton twin where the twin cannot run on ``backend`` in this process (CPU
    tensors need the interpreter, which ``tests/conftest.py`` turns on for sessions without cuda)."""
    skip_unless_triton_runs(backend)

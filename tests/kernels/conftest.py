"""Every test under tests/kernels runs once per kernel backend (cpu; cuda too on a GPU).

The autouse fixture parametrizes each test with ``backend``; a test that runs a kernel takes the
``backend`` argument and puts its tensors on ``device_of(backend)`` (or goes through
``run_on_backend``, which also checks the cuda build against the cpu build). A new kernel family's
tests get both backends without asking; ``tests/test_backend_coverage.py`` checks it.
"""

from __future__ import annotations

import pytest

from sparsekv.testing.backends import kernel_backends


@pytest.fixture(params=kernel_backends(), autouse=True, scope="module")
def backend(request) -> str:
    return request.param

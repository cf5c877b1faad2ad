"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Snapshots (``sparsekv.testing.hisparse_runtime.snapshot``) copy the byte pools at every refused
    call; on a loaded 2-core machine torch's multi-threaded copies of these sub-megabyte buffers are
    500x slower than a single thread's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

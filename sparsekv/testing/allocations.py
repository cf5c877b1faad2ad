"""What allocated memory while a call ran: the probe of the "given its buffers, a call allocates nothing" tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["allocations"]


def allocations(call: Callable[[], object]) -> list[str]:
    """The ops that allocated memory (host or device) while ``call`` ran."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        call()
    return [e.name for e in prof.events() if e.cpu_memory_usage > 0 or e.device_memory_usage > 0]

"""``HostStaging``: a planner's tables reach the device through buffers it owns, reused step after
step and never moved once a CUDA graph captured a copy from them; a captured ``CompressorState``
step replays right after the pinned memory around it was reused (GPU).

Off a GPU the buffers are checked on the ``meta`` device (a real host buffer, a device buffer
without storage): what is staged, what is reused, when it grows and when growing is refused.
"""

from __future__ import annotations

import pytest
import torch

from sparsekv.srt.mem_cache import CompressorState, HostStaging

META = torch.device("meta")


def test_on_the_cpu_the_tables_are_used_as_given():
    staging = HostStaging("cpu")
    values = torch.arange(5)
    assert staging.upload(values) is values and staging.capacity == 0


def test_the_buffers_are_allocated_once_and_reused_while_they_hold_the_step():
    staging = HostStaging(META)
    staging.reserve(8)
    host = staging.host.data_ptr()
    first = staging.upload(torch.tensor([[3, 1], [4, 1]]))
    assert first.shape == (2, 2) and first.device == META
    assert staging.host[:4].tolist() == [3, 1, 4, 1]
    staging.upload(torch.tensor([5, 9, 2, 6, 5, 3, 5, 8]))
    assert staging.host.data_ptr() == host and staging.capacity == 8
    assert staging.host.tolist() == [5, 9, 2, 6, 5, 3, 5, 8]
    staging.upload(torch.arange(12))  # a larger step, before any capture: the buffers grow
    assert staging.capacity == 12 and staging.host.tolist() == list(range(12))


def test_after_a_capture_the_buffers_never_move():
    staging = HostStaging(META)
    staging.upload(torch.arange(4))
    staging.captured = True  # what an upload inside a CUDA-graph capture records
    host = staging.host
    staging.upload(torch.tensor([7, 7]))  # within the captured buffers: fine
    with pytest.raises(RuntimeError, match=r"grow to 6 after a CUDA graph captured .* reserve\(\)"):
        staging.upload(torch.arange(6))
    with pytest.raises(RuntimeError, match="reserve"):
        staging.reserve(5)
    assert staging.host is host and staging.host[:2].tolist() == [7, 7] and staging.capacity == 4


def test_a_compressor_state_stages_every_step_through_its_own_buffer():
    d = 64
    comp = CompressorState(torch.empty(4 * 16, 4 * d, device=META), torch.empty(4, 2 * d, device=META), 4, 16)
    comp.staging.reserve(64)
    host = comp.staging.host
    for start, length in ((0, 9), (9, 300), (309, 1)):
        comp.plan_raw([[1]], [start], [length], None, META)
        assert comp.staging.host is host
        # The request's numbers lead the block: its start, then its first input row.
        assert comp.staging.host[:2].tolist() == [start, 0]
    with pytest.raises(TypeError, match="`n`"):
        comp.staging.reserve(1.5)


@pytest.mark.gpu
def test_a_captured_compressor_step_replays_after_its_pinned_neighbours_are_reused():
    """Capture ``CompressorState.extend`` (fused store), free and reuse pinned memory (the blocks a
    pinned temporary would have gone back to), replay: the ring and the cache equal an eager twin."""
    from sparsekv.jit_kernel.dsv4 import RopeParams, StoreTarget
    from sparsekv.kv_layout import V4

    device, d, tokens = torch.device("cuda"), 512, 40
    g = torch.Generator().manual_seed(0)
    kv, score = (torch.randn(tokens, 2 * d, generator=g).to(device) for _ in range(2))
    ape, weight = torch.randn(4, 2 * d, generator=g).to(device), torch.rand(d, generator=g).to(device) + 0.5
    rope = RopeParams(10000).table(256, device)

    def make():
        state = CompressorState(torch.zeros(4 * 16, 4 * d, device=device), ape, 4, 16)
        cache = torch.zeros(4, V4.page_bytes(64), dtype=torch.uint8, device=device)
        return state, StoreTarget(cache, weight, 1e-6, 64, rope)

    def step(state, store, start):
        state.release(0)
        state.resume(0, start)
        state.extend([0], [[1]], [start], kv[start:], score[start:], store=store,
                     entry_slots=lambda _b, anchor: anchor // 4)

    eager, eager_store = make()
    captured, captured_store = make()
    step(eager, eager_store, 0)
    step(captured, captured_store, 0)  # loads the modules
    captured.staging.reserve(64)  # the largest step's numbers, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(captured, captured_store, 8)
    for _ in range(8):  # pinned allocations of the same sizes, filled with junk
        torch.full((64,), -7, dtype=torch.int64).pin_memory()
    captured.state.zero_()
    captured_store.cache.zero_()
    eager.state.zero_()
    eager_store.cache.zero_()
    step(eager, eager_store, 8)
    graph.replay()
    torch.cuda.synchronize()
    assert captured.staging.captured
    assert torch.equal(captured.state, eager.state) and torch.equal(captured_store.cache, eager_store.cache)

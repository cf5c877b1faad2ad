"""``Dsv4AttentionBackend``: a decode step of the demo model's layers (window, C4, C128) through the
backend, compiled whole under ``torch.compile(fullgraph=True)`` with the HiSparse swap-in, equals
eager byte for byte (outputs and every cache, ring and hot-buffer table it writes); given the graph
state it allocates nothing; on a GPU it is captured in a CUDA graph and replayed with padding rows.
MTP verify blocks (several tokens per request, drafts rejected and rewritten) equal decoding one
token at a time, bit for bit.

The stack around the backend is the demo's (``sparsekv.cli.demo.stack``: plan, pools, the
scheduler's tables, the model's projections), which ``tests/test_demo.py`` checks against fp64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparsekv.cli.demo.model import HEAD_DIM, DemoModel, ModelShape
from sparsekv.cli.demo.stack import Request, Stack
from sparsekv.srt.layers import ForwardBatch
from sparsekv.testing.allocations import allocations
from sparsekv.testing.backends import cpu_backend
from sparsekv.testing.profiles import scaled_examples

PROMPTS = (300, 131)  # one request with C128 entries, one with a partial C4 page


def prefilled(hisparse: int | None, device: str = "cpu", draft_tokens: int | None = None,
              prompts: tuple[int, ...] = PROMPTS) -> tuple[Stack, list[Request]]:
    model = DemoModel(ModelShape())
    stack = Stack(model, tokens=max(prompts) + 16, requests=len(prompts), hisparse=hisparse, hot_buffer=64,
                  device=device, check=False, draft_tokens=draft_tokens)
    reqs = [Request(i, 0) for i in range(len(prompts))]
    for req, n in zip(reqs, prompts):
        stack.prefill(req, n)
    if hisparse is not None:
        stack.back_up(reqs)
    return stack, reqs


def step_inputs(stack: Stack, reqs: list[Request], tokens: int = 1) -> list[tuple]:
    """Start the next decode step (tables, metadata) of ``tokens`` per request (an MTP block when
    more than 1) and return each layer's inputs."""
    n_before = [r.kv_allocated_len for r in reqs]
    for req, n in zip(reqs, n_before):
        stack._grow(req, n + tokens, decode=True)
    stack.backend.init_forward_metadata(ForwardBatch(torch.tensor([r.req_pool_idx for r in reqs]),
                                                     [n + tokens for n in n_before], tokens_per_request=tokens))
    x = torch.cat([stack.model.hidden(r.req_pool_idx, n, n + tokens)
                   for r, n in zip(reqs, n_before)]).to(stack.device)
    rows = len(x)
    inputs = []
    for w in stack.model.layers:
        args = [(x @ w.wq).reshape(rows, -1, HEAD_DIM), x @ w.w_kv]
        if w.ratio:
            args += [x @ w.w_ckv, x @ w.w_cscore]
        if w.ratio == 4:
            args += [x @ w.w_ikv, x @ w.w_iscore, (x @ w.w_iq).reshape(rows, -1, 128), torch.sigmoid(x @ w.w_iw)]
        inputs.append(tuple(args))
    return inputs


def decode(backend, inputs) -> list[torch.Tensor]:
    return [backend.forward_decode(layer, *args).clone() for layer, args in enumerate(inputs)]


def written_state(stack: Stack) -> dict[str, torch.Tensor]:
    """Every buffer a decode step writes: caches, rings, and the HiSparse tables and hot pool."""
    pool, state = stack.pool, {}
    for layer, ratio in enumerate(stack.ratios):
        state[f"swa{layer}"] = pool.get_swa_kv_buffer(layer)
        if ratio:
            state[f"kv{layer}"] = stack.backend.compressed_cache(layer)
            state[f"ring{layer}"] = pool.get_compress_state(layer)
        if ratio == 4:
            state[f"index{layer}"] = pool.get_indexer_buffer(layer)
            state[f"index_ring{layer}"] = pool.get_indexer_state(layer)
    if stack.coordinator is not None:
        c = stack.coordinator
        state |= {"buffer_tokens": c.req_device_buffer_tokens, "lru": c.lru_slots,
                  "host": torch.stack(list(c.mem_pool_host.kv_buffer))}
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("hisparse,tokens", [(None, 1), (2, 1), (None, 3)], ids=["resident", "hisparse", "mtp"])
def test_a_compiled_decode_step_equals_eager_byte_for_byte(hisparse, tokens):
    eager_stack, eager_reqs = prefilled(hisparse, draft_tokens=4)
    compiled_stack, compiled_reqs = prefilled(hisparse, draft_tokens=4)
    compiled = torch.compile(decode, fullgraph=True, backend="aot_eager")  # aot_eager runs the ops' fakes
    for _ in range(3):  # the third step completes a C4 entry of the second request (131 + 1 = 132)
        expected = decode(eager_stack.backend, step_inputs(eager_stack, eager_reqs, tokens))
        got = compiled(compiled_stack.backend, step_inputs(compiled_stack, compiled_reqs, tokens))
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
        want, have = written_state(eager_stack), written_state(compiled_stack)
        assert [k for k in want if not torch.equal(want[k], have[k])] == []


@pytest.mark.parametrize("hisparse,tokens", [(None, 1), (2, 1), (None, 3)], ids=["resident", "hisparse", "mtp"])
def test_a_decode_step_given_its_graph_state_allocates_nothing(hisparse, tokens):
    stack, reqs = prefilled(hisparse, draft_tokens=4)
    stack.backend.init_cuda_graph_state(6)
    inputs = step_inputs(stack, reqs, tokens)
    decode(stack.backend, inputs)  # first call: loads the kernels
    inputs = step_inputs(stack, reqs, tokens)
    assert allocations(lambda: [stack.backend.forward_decode(layer, *args) for layer, args in enumerate(inputs)]) \
        == []


def test_hisparse_decode_through_the_backend_equals_all_resident():
    resident, resident_reqs = prefilled(None)
    hot, hot_reqs = prefilled(2)
    for _ in range(5):
        a = decode(resident.backend, step_inputs(resident, resident_reqs))
        b = decode(hot.backend, step_inputs(hot, hot_reqs))
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_mtp_blocks_with_rejected_drafts_equal_one_token_at_a_time():
    """Verify blocks of 2-4 tokens per request, some drafts rejected (the next block starts at the
    accepted length and rewrites them), across a C128 entry (position 127) and C4 entries, equal a
    twin stack decoding the accepted tokens one at a time, bit for bit, every layer."""
    prompts = (126, 129)
    mtp, mtp_reqs = prefilled(None, draft_tokens=4, prompts=prompts)
    single, single_reqs = prefilled(None, draft_tokens=4, prompts=prompts)
    for tokens, accepted in ((3, [1, 3]), (4, [2, 4]), (2, [2, 1]), (4, [4, 3]), (3, [3, 2])):
        block, _ = mtp.decode_step(mtp_reqs, tokens, accepted)
        for k in range(max(accepted)):
            live = [i for i in range(len(prompts)) if accepted[i] > k]
            one, _ = single.decode_step([single_reqs[i] for i in live])
            for row, i in enumerate(live):
                assert all(torch.equal(b[i * tokens + k], o[row]) for b, o in zip(block, one)), (tokens, k, i)
    assert [r.kv_allocated_len for r in mtp_reqs] == [r.kv_allocated_len for r in single_reqs] == [138, 142]


def test_mtp_rows_with_hisparse_are_refused_before_anything_changes():
    stack, reqs = prefilled(2, draft_tokens=4)
    before = written_state(stack)
    with pytest.raises(ValueError, match="`tokens_per_request` = 2: MTP rows with HiSparse"):
        stack.backend.init_forward_metadata(ForwardBatch(torch.tensor([0, 1]), [r.kv_allocated_len + 2 for r in reqs],
                                                         tokens_per_request=2))
    after = written_state(stack)
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def padded_step(stack: Stack, reqs: list[Request], bs: int):
    """The next step's inputs padded to ``bs`` rows, as a CUDA-graph runner pads a batch: the padding
    rows name the spare request row at position 0 (its tables are zeros: the allocators' reserved
    page 0), and copy row 0's activations. Returns (inputs, rows, positions)."""
    inputs = step_inputs(stack, reqs)
    pad = bs - len(reqs)
    rows = torch.tensor([r.req_pool_idx for r in reqs] + [len(PROMPTS)] * pad, device=stack.device)
    positions = torch.cat([stack.backend.metadata("positions"), torch.zeros(pad, dtype=torch.int64,
                                                                            device=stack.device)])
    padded = [tuple(torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) for t in args) for args in inputs]
    return padded, rows, positions


# On sim the HiSparse stack (every kernel of the resident one, and the swap-in) by default: the
# resident stack's sim run (the demo model's decode under the simulator, 25 s of an idle core) is the
# same replay over the same kernels, and runs under --slow.
@pytest.mark.parametrize("backend, hisparse", [
    ("cpu", None), ("cpu", 2), pytest.param("sim", None, marks=pytest.mark.slow), ("sim", 2),
    pytest.param("cuda", None, marks=pytest.mark.gpu), pytest.param("cuda", 2, marks=pytest.mark.gpu),
], ids=[f"{backend}-{stack}" for backend in ("cpu", "sim", "cuda") for stack in ("resident", "hisparse")])
def test_a_replay_with_a_padding_row_equals_eager_for_its_real_rows(backend, hisparse):
    """bs = 3 graph rows, 2 real and one padding row, over 3 steps (the last completes a C4 entry):
    the real rows' outputs equal an eager step of the same two requests in a twin stack. On cuda the
    step is captured once in a CUDA graph (on padding only: num_real = 0 writes and swaps in nothing
    real) and each step replays it after refilling the graph state and the static inputs; on cpu
    and sim the padded step runs on the refilled graph state, which is what a replay runs (sim: the
    CUDA code path, blocks in random order; the prefills run on the cpu build, the twin's steps on
    the same build as the padded ones)."""
    device = "cuda" if backend == "cuda" else "cpu"
    stack, reqs = prefilled(hisparse, device)  # on the host: the cpu build (sim's bytes are the same)
    twin, twin_reqs = prefilled(hisparse, device)
    backend_, bs = stack.backend, 3
    backend_.init_cuda_graph_state(bs)
    graph = static = outs = None
    for _ in range(3):
        padded, rows, positions = padded_step(stack, reqs, bs)
        if backend == "cuda" and graph is None:
            static = [tuple(t.clone() for t in args) for args in padded]
            spare = torch.full_like(rows, len(PROMPTS))
            backend_.init_forward_metadata_capture_cuda_graph(bs, spare, torch.zeros_like(positions))
            backend_.init_forward_metadata_replay_cuda_graph(bs, 0, spare, torch.zeros_like(positions))
            decode(backend_, static)  # warm-up on padding: loads every kernel before the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [backend_.forward_decode(layer, *args).clone() for layer, args in enumerate(static)]
        backend_.init_forward_metadata_replay_cuda_graph(bs, len(reqs), rows, positions)
        if graph is None:
            with cpu_backend(backend):  # the decode kernels on this backend's build
                got = decode(backend_, padded)
        else:
            for dst, src in zip(static, padded):
                for d, t in zip(dst, src):
                    d.copy_(t)
            graph.replay()
            torch.cuda.synchronize()
            got = outs
        with cpu_backend("sim" if backend == "sim" else "cpu"):
            expected = decode(twin.backend, step_inputs(twin, twin_reqs))
        assert all(torch.equal(want, have[: len(reqs)]) for want, have in zip(expected, got))


REPLAY_BAD = {  # (bs, num_real, rows, positions[, tokens_per_request]) -> error, argument named
    "one row for three": (lambda r, p: (3, 2, r[:1], p), ValueError, "`req_pool_indices`"),
    "short positions": (lambda r, p: (3, 2, r, p[:2]), ValueError, "`positions`"),
    "float rows": (lambda r, p: (3, 2, r.double(), p), TypeError, "`req_pool_indices`"),
    "2-D positions": (lambda r, p: (3, 2, r, p[:, None]), ValueError, "`positions`"),
    "num_real past bs": (lambda r, p: (3, 4, r, p), ValueError, "`num_real`"),
    "negative num_real": (lambda r, p: (3, -1, r, p), ValueError, "`num_real`"),
    "bs past the state": (lambda r, p: (4, 2, torch.cat([r, r[:1]]), torch.cat([p, p[:1]])), ValueError, "holds 3"),
    "MTP blocks not dividing bs": (lambda r, p: (3, 2, r, p, 2), ValueError, "`tokens_per_request` = 2 does not"),
    "no token per request": (lambda r, p: (3, 2, r, p, 0), ValueError, "`tokens_per_request`"),
}


@pytest.mark.parametrize("bad", REPLAY_BAD)
def test_bad_replay_metadata_is_refused_before_the_graph_state_changes(bad):
    stack, reqs = prefilled(None)
    stack.backend.init_cuda_graph_state(3)
    _, rows, positions = padded_step(stack, reqs, 3)
    before = {k: v.clone() for k, v in stack.backend._bufs.items()}
    make, error, match = REPLAY_BAD[bad]
    with pytest.raises(error, match=match):
        stack.backend.init_forward_metadata_replay_cuda_graph(*make(rows, positions))
    assert [k for k, v in stack.backend._bufs.items() if not torch.equal(v, before[k])] == []


# ---- the state machine --------------------------------------------------------------------------

ROWS, CONTEXT = 3, 400


class BackendMachine(RuleBasedStateMachine):
    """Requests of the demo model (window, C4, C128, C4 layers) come and go through two stacks, one
    all-resident and one with HiSparse (a hot buffer smaller than the longer requests' C4 entries),
    both planned for MTP blocks of up to 4 tokens: admitted with prompts prefilled in random chunks,
    decoded together, verified in MTP blocks with drafts rejected, finished and their rows reused.
    Every prefill, decode and MTP output is checked against the fp64 references within each
    kernel's tolerance (the stack's checks), the HiSparse outputs equal the resident ones bit for
    bit, and an MTP block's accepted rows equal the HiSparse stack decoding them one at a time."""

    def __init__(self):
        super().__init__()
        model = DemoModel(ModelShape())
        self.stacks = [Stack(model, tokens=CONTEXT, requests=ROWS, hisparse=h, hot_buffer=64, draft_tokens=4)
                       for h in (None, 2)]
        self.reqs: dict[int, list[Request]] = {}  # row -> its request in each stack

    @rule(data=st.data())
    @precondition(lambda self: len(self.reqs) < ROWS)
    def admit(self, data):
        row = min(set(range(ROWS)) - set(self.reqs))
        length = data.draw(st.integers(1, CONTEXT - 64), label="prompt")
        cuts = sorted(data.draw(st.sets(st.integers(1, max(1, length - 1)), max_size=3), label="chunk ends")
                      - {length})
        reqs = [Request(row, 0) for _ in self.stacks]
        for stack, req in zip(self.stacks, reqs):
            for start, end in zip([0, *cuts], [*cuts, length]):
                stack.prefill(req, end, start)
            if stack.hisparse is not None:
                stack.back_up([req])
        self.reqs[row] = reqs

    @rule()
    @precondition(lambda self: self.reqs and all(r[0].kv_allocated_len < CONTEXT - 8 for r in self.reqs.values()))
    def decode(self):
        rows = sorted(self.reqs)
        resident, hot = (stack.decode_step([self.reqs[r][i] for r in rows])[0] for i, stack in enumerate(self.stacks))
        for a, b in zip(resident, hot):
            assert torch.equal(a, b)

    @rule(data=st.data())
    @precondition(lambda self: self.reqs and all(r[0].kv_allocated_len < CONTEXT - 8 for r in self.reqs.values()))
    def verify(self, data):
        """An MTP verify block on the resident stack (HiSparse refuses MTP rows), some drafts rejected:
        the next step starts at the accepted length and rewrites them. The HiSparse stack decodes the
        accepted tokens one at a time; each equals its row of the block bit for bit."""
        rows = sorted(self.reqs)
        tokens = data.draw(st.integers(2, 4), label="tokens per request")
        accepted = [data.draw(st.integers(1, tokens), label=f"accepted of row {r}") for r in rows]
        resident, hot = self.stacks
        block, _ = resident.decode_step([self.reqs[r][0] for r in rows], tokens, accepted)
        for k in range(max(accepted)):
            live = [i for i, m in enumerate(accepted) if m > k]
            one, _ = hot.decode_step([self.reqs[rows[i]][1] for i in live])
            for row, i in enumerate(live):
                assert all(torch.equal(b[i * tokens + k], o[row]) for b, o in zip(block, one))

    @rule(data=st.data())
    @precondition(lambda self: self.reqs)
    def finish(self, data):
        row = data.draw(st.sampled_from(sorted(self.reqs)), label="finished row")
        for stack, req in zip(self.stacks, self.reqs.pop(row)):
            stack.finish(req)

    @invariant()
    def every_output_is_within_its_tolerance_of_fp64(self):
        for stack in self.stacks:
            assert stack.errors.ok, stack.errors


BackendMachine.TestCase.settings = settings(max_examples=scaled_examples(2), stateful_step_count=6, deadline=None,
                                              # a failure is reported as drawn: shrinking runs whole prefills
                                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
test_backend_state_machine = BackendMachine.TestCase

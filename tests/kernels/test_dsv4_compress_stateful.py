"""CompressorState as a state machine: ragged batches of prefill chunks, decode steps and MTP blocks
with rejections over several requests sharing one ring buffer; committed entries always equal the
one-shot compressor over each request's accepted tokens."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from sparsekv.jit_kernel.dsv4 import compress_pool
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.testing.backends import device_of
from sparsekv.testing.profiles import scaled_examples

D = 8
RATIO = 4
RING = 16
REQUESTS = 3


class Streaming(RuleBasedStateMachine):
    backend = "cpu"

    def __init__(self):
        super().__init__()
        self.device = device_of(self.backend)
        self.gen = torch.Generator().manual_seed(0)
        self.ape = torch.randn(RATIO, 2 * D, generator=self.gen).to(self.device)
        self.state = torch.zeros((REQUESTS + 1) * RING, 4 * D, device=self.device)
        self.comp = CompressorState(self.state, self.ape, RATIO, ring_size=RING)
        self.kv = {r: torch.zeros(0, 2 * D) for r in range(REQUESTS)}
        self.score = {r: torch.zeros(0, 2 * D) for r in range(REQUESTS)}
        self.entries = {r: [] for r in range(REQUESTS)}

    def _rows(self, n):
        return torch.randn(n, 2 * D, generator=self.gen), torch.randn(n, 2 * D, generator=self.gen)

    @precondition(lambda self: min(len(v) for v in self.kv.values()) < 200)
    @rule(steps=st.lists(st.tuples(st.integers(0, REQUESTS - 1), st.integers(1, 20), st.integers(0, 8)), min_size=1,
                         max_size=REQUESTS, unique_by=lambda s: s[0]))
    def batch(self, steps):
        ids, rings, starts, lengths, kvs, scores, keep = [], [], [], [], [], [], []
        for r, n, rejected in steps:
            # A block that loses drafts holds at most 8 tokens, what a 16-row ring can take back.
            n = min(n, 8) if rejected else n
            accepted = max(n - rejected, 0)
            kv, score = self._rows(n)
            ids.append(r), rings.append([r + 1]), starts.append(len(self.kv[r])), lengths.append(n)
            kvs.append(kv), scores.append(score), keep.append(accepted)
        out, anchors = self.comp.extend(ids, rings, starts, torch.cat(kvs).to(self.device),
                                        torch.cat(scores).to(self.device), lengths=lengths)
        out = out.cpu()
        k = 0
        for r, s, n, accepted, kv, score in zip(ids, starts, lengths, keep, kvs, scores):
            count = (s + n) // RATIO - s // RATIO
            for e, a in zip(out[k : k + count], anchors[k : k + count].tolist()):
                if a + RATIO - 1 < s + accepted:
                    self.entries[r].append(e)
            k += count
            self.kv[r] = torch.cat([self.kv[r], kv[:accepted]])
            self.score[r] = torch.cat([self.score[r], score[:accepted]])

    @invariant()
    def committed_entries_are_the_one_shot_entries(self):
        for r in range(REQUESTS):
            expected = compress_pool(self.kv[r].to(self.device), self.score[r].to(self.device), self.ape, RATIO).cpu()
            got = torch.stack(self.entries[r]) if self.entries[r] else torch.zeros(0, D)
            assert torch.equal(got, expected)


def test_streaming_state_machine(backend):
    machine = type(f"Streaming_{backend}", (Streaming,), {"backend": backend})
    run_state_machine_as_test(machine, settings=settings(max_examples=scaled_examples(10), stateful_step_count=12,
                                                         deadline=None))

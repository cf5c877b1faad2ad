"""The demo's serving stack: plan, pools, prefill and decode of the demo model through the kernels.

One :class:`Stack` is one server process: the memory plan of the model for a budget
(:func:`~sparsekv.srt.model_executor.plan_pipeline`, what ``sparsekv plan-memory`` runs), the
``DeepSeekV4TokenToKVPool`` built from it, with HiSparse the C4 hot pool, its host pool and the
:class:`~sparsekv.srt.managers.HiSparseCoordinator`, and the
:class:`~sparsekv.srt.layers.Dsv4AttentionBackend` every layer's attention goes through (the stack
keeps the model's projections, the scheduler's tables and the checks). Each step is checked as it runs:

* prefill: the compressors' entries against the fp64 torch compressor; the fused norm + RoPE +
  quantize + store's bytes against the torch store reference, byte for byte;
* decode: each C4 layer's indexer scores against the fp64 indexer, each layer's attention against
  the fp64 attention over the same selected slots of the same (dequantized) cache bytes.

With ``trace_source`` it also records, per C4 layer, the top-k each request asked for at each
decode step (:class:`~sparsekv.testing.hisparse_traces.TraceRecorder`), and with HiSparse the
swap-in's hits and loads of that layer: the traces ``tools/hisparse_sim.py`` replays.

Errors are kept as a fraction of each kernel's documented tolerance (1.0 = at the bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import torch

from sparsekv.cli.demo.model import EPS, HEAD_DIM, WINDOW, DemoModel
from sparsekv.jit_kernel.dsv4 import dequantize_fp8_ds_mla
from sparsekv.jit_kernel.dsv4_indexer import visible_entries
from sparsekv.srt.layers.dsv4_attention_backend import Dsv4AttentionBackend, Dsv4LayerParams, ForwardBatch
from sparsekv.srt.mem_cache.allocators import PagedAllocator
from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
from sparsekv.srt.model_executor import DSV4ModelSpec, ServerSpec, SpeculativeSpec, plan_pipeline
from sparsekv.testing.hisparse_traces import TraceRecorder
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.reference.dsv4_compress import compress_pool_reference
from sparsekv.testing.reference.dsv4_indexer import decode_indexer_keys, entry_slots, indexer_scores_reference
from sparsekv.testing.reference.dsv4_store import normalize_rotate

PAGE_SIZE = 256
C4_PAGE = PAGE_SIZE // 4
C128_PAGE = PAGE_SIZE // 128
#: Documented tolerances against the fp64 references (the kernels' module docstrings).
#: Attention, per implementation. header: |x - ref| <= tol + tol |ref| for out and lse. triton (bf16
#: tensor cores, against the reference of the bf16-rounded q): |out - ref| <= tol max(1, max |ref|) and
#: |lse - ref| <= tol + tol |ref|.
ATTENTION_TOL = {"header": 2e-4, "triton": 1e-2}
COMPRESS_TOL = 1e-5  # |x - ref| <= tol + tol |ref|
INDEXER_TOL = 1e-5  # |s - ref| <= tol * sum_h |w_h| |q_h| |k|
STORE_REL_TOL, STORE_ABS_TOL = 2.0**-4, 2.0**-16  # stored value vs the normalized, rotated value


@dataclass
class Request:
    """One request of the demo: its row, length and where its tokens live."""

    req_pool_idx: int
    kv_allocated_len: int
    locs: list[int] = field(default_factory=list)  # full-token location of each position
    swa_pages: list[int] = field(default_factory=list)


@dataclass
class Errors:
    """Worst error of each check, as a fraction of its tolerance, plus the largest absolute errors."""

    compress: float = 0.0
    store: float = 0.0
    indexer: float = 0.0
    attention: float = 0.0
    attention_abs: float = 0.0

    def merge(self, other: Errors) -> None:
        for name in (f.name for f in fields(self)):
            setattr(self, name, max(getattr(self, name), getattr(other, name)))

    @property
    def ok(self) -> bool:
        return max(self.compress, self.store, self.indexer, self.attention) <= 1.0


@dataclass
class StepStats:
    """One decode step: C4 hot-buffer hits and misses, bytes moved host -> device, wall time."""

    hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    seconds: float = 0.0


def _rel(x: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """max ``|x - ref| / (tol + tol |ref|)``."""
    if x.numel() == 0:
        return 0.0
    return float(((x.double().cpu() - ref.double()).abs() / (tol + tol * ref.double().abs())).max())


def plan(model: DemoModel, *, tokens: int, hisparse: int | None, requests: int, draft_tokens: int | None = None):
    """The plan of one PP rank for the smallest power-of-two budget (from 16 MiB) that holds
    ``requests`` requests of ``tokens`` tokens (with ``draft_tokens``: MTP verify blocks of that many
    tokens, the speculative plan's rings): ``(budget_bytes, rank_plan, server)``."""
    spec = DSV4ModelSpec(num_hidden_layers=len(model.shape.compress_ratios),
                         compress_ratios=model.shape.compress_ratios, context_len=max(4096, 2 * tokens))
    speculative = None if draft_tokens is None else SpeculativeSpec(num_draft_tokens=draft_tokens)
    server = ServerSpec(page_size=PAGE_SIZE, max_running_requests=requests, swa_full_tokens_ratio=0.5,
                        enable_hisparse=hisparse is not None, hisparse_host_to_device_ratio=hisparse or 2,
                        speculative=speculative)
    need = requests * (-(-tokens // PAGE_SIZE) + 1) * PAGE_SIZE
    budget = 16 << 20
    while True:
        rank = plan_pipeline(spec, server, budget).ranks[0]
        if rank.config.swa_max_total_num_tokens >= need and rank.config.full_max_total_num_tokens >= need * (
                hisparse or 1):
            return budget, rank, server
        budget *= 2


class Stack:
    """One process's pools, tables and attention backend for the demo model (see the module docstring).

    Parameters
    ----------
    model : DemoModel
    tokens : int
        Longest sequence any request reaches (prompt + decode steps): sizes the plan.
    requests : int
        Request rows.
    hisparse : int or None
        HiSparse host:device ratio of the C4 KV; None keeps every C4 entry on the device.
    hot_buffer : int
        HiSparse hot slots per request and C4 layer (>= top-k).
    device : str
        ``"cpu"`` (the cpu backend) or ``"cuda"``.
    check : bool
        Run the fp64 reference checks.
    impl : str
        ``"header"`` or ``"triton"``: the implementation of the indexer and the attention (the
        functions with a Triton twin; on CPU tensors Triton runs under ``TRITON_INTERPRET=1``).
    trace_source : dict, optional
        Record every C4 layer's top-k (``recorders``, by model layer); each trace's ``source`` is
        this plus the layer, and with HiSparse the hot buffer, the policy and the swap-in's counts.
        Recording reads the top-k (and the counters) back each step: it waits for the device.
    draft_tokens : int, optional
        MTP: plan for verify blocks of up to this many tokens per request (:meth:`decode_step`'s
        ``tokens``): the speculative plan's compressor rings, which keep a rejected draft's rows
        from overwriting what the accepted length still reads.
    """

    def __init__(self, model: DemoModel, *, tokens: int, requests: int, hisparse: int | None, hot_buffer: int,
                 device: str = "cpu", check: bool = True, impl: str = "header", trace_source: dict | None = None,
                 draft_tokens: int | None = None):
        self.model = model
        self.device = torch.device(device)
        self.check = check
        self.hisparse = hisparse
        self.budget, rank, self.server = plan(model, tokens=tokens, hisparse=hisparse, requests=requests,
                                              draft_tokens=draft_tokens)
        self.config = rank.config
        self.pool = DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device=self.device)
        self.ratios = model.shape.compress_ratios
        self.swa_alloc = PagedAllocator(self.config.swa_max_total_num_tokens // PAGE_SIZE + 1, PAGE_SIZE, "swa")
        context = tokens + PAGE_SIZE
        self.req_to_token = torch.zeros(requests + 1, context, dtype=torch.int64)
        self.req_to_swa_loc = torch.zeros(requests + 1, context, dtype=torch.int64, device=self.device)
        self.coordinator = None
        c4_layers = sum(r == 4 for r in self.ratios)
        if hisparse is None:
            self.full_alloc = PagedAllocator(self.pool.size // PAGE_SIZE + 1, PAGE_SIZE, "full")
        else:
            from sparsekv.srt.managers import HiSparseCoordinator
            from sparsekv.srt.mem_cache import HiSparseC4DevicePool, HiSparseTokenToKVPoolAllocator

            self.allocator = HiSparseTokenToKVPoolAllocator(self.pool.size // hisparse, PAGE_SIZE,
                                                            host_to_device_ratio=hisparse, device=self.device)
            self.c4_pool = HiSparseC4DevicePool(self.allocator, c4_layers, self.device)
            self.coordinator = HiSparseCoordinator(
                SimpleNamespace(req_to_token=self.req_to_token), self.allocator, self.c4_pool,
                num_top_k=model.shape.top_k, hot_buffer_size=hot_buffer, collect_counters=True)
        rope = {w.rope: w.rope.table(tokens + PAGE_SIZE, self.device) for w in model.layers}
        layers = [Dsv4LayerParams(w.ratio, w.sink.to(self.device), w.kv_norm.to(self.device), rope[w.rope],
                                  *((w.ape, w.c_norm) if w.ratio else (None, None)),
                                  *((w.i_ape, w.i_norm) if w.ratio == 4 else (None, None)), eps=EPS)
                  for w in model.layers]
        self.backend = Dsv4AttentionBackend(self.pool, layers, self.req_to_token, self.req_to_swa_loc,
                                            num_top_k=model.shape.top_k, window=WINDOW, coordinator=self.coordinator,
                                            impl=impl)
        self.c4_index = self.backend.c4_index
        self.recorders: dict[int, TraceRecorder] = {}
        if trace_source is not None:
            swap_in = {} if self.coordinator is None else {"hot_buffer": hot_buffer,
                                                           "policy": self.coordinator.swap_in_policy}
            self.recorders = {layer: TraceRecorder(model.shape.top_k, {**trace_source, "layer": layer, **swap_in})
                              for layer in self.c4_index}
        self.impl = impl
        self.errors = Errors()

    # ---- addressing (the scheduler's part) -----------------------------------------------------

    def _grow(self, req: Request, length: int, *, decode: bool = False) -> None:
        """Give ``req`` full-token locations and SWA pages up to ``length`` tokens (a prefill chunk,
        or with ``decode`` the decode token: under HiSparse its C4 entry's device slot is the hot
        buffer's, which the backend routes)."""
        have = len(req.locs)
        if self.hisparse is None:
            while len(req.locs) < length:
                if len(req.locs) % PAGE_SIZE == 0:
                    req.page = int(self.full_alloc.alloc(1)[0])
                req.locs.append(req.page * PAGE_SIZE + len(req.locs) % PAGE_SIZE)
        elif not decode:
            full = self.allocator.alloc_extend(self.req_to_token, req.req_pool_idx, have, length)
            req.locs += full.tolist()
        else:
            for n in range(have + 1, length + 1):
                req.locs.append(self.allocator.alloc_decode(self.req_to_token, req.req_pool_idx, n))
        if self.hisparse is None:
            self.req_to_token[req.req_pool_idx, have:length] = torch.tensor(req.locs[have:length])
        self._grow_swa(req, have, length)
        req.kv_allocated_len = length

    def _grow_swa(self, req: Request, have: int, length: int) -> None:
        while len(req.swa_pages) * PAGE_SIZE < length:
            req.swa_pages.append(int(self.swa_alloc.alloc(1)[0]))
        self.req_to_swa_loc[req.req_pool_idx, have:length] = self._swa_slots(req, range(have, length)).to(self.device)

    def adopt(self, req: Request, length: int) -> list[int]:
        """PD decode: allocate a request whose first ``length`` tokens another process prefilled
        (logical locations without device slots, SWA pages), continue its compressors at ``length``;
        returns its full-token pages (the transfer's KV destinations)."""
        full = self.allocator.alloc_extend(self.req_to_token, req.req_pool_idx, 0, length, with_device=False)
        req.locs = full.tolist()
        self._grow_swa(req, 0, length)
        req.kv_allocated_len = length
        self.backend.admit_transferred(req, length)
        return [req.locs[p] // PAGE_SIZE for p in range(0, length, PAGE_SIZE)]

    def _swa_slots(self, req: Request, positions) -> torch.Tensor:
        return torch.tensor([req.swa_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions],
                            dtype=torch.int64)

    def _c4_cache(self, layer: int) -> torch.Tensor:
        return self.backend.compressed_cache(layer)

    # ---- prefill -------------------------------------------------------------------------------

    def _check_store(self, x, weight, positions, cache, slots, page, rope, kind, errors: Errors) -> None:
        """The stored bytes at ``slots`` against the normalized, rotated ``x`` (fp64)."""
        if not self.check or not slots.numel():
            return
        exact = normalize_rotate(x.cpu(), weight.cpu(), EPS, positions.cpu(), rope.cos, rope.sin,
                                 hadamard=kind != "V4")
        if kind == "V4":
            stored = dequantize_fp8_ds_mla(cache, slots, page).cpu()
        else:
            stored = decode_indexer_keys(cache.cpu(), slots.cpu(), page, "fp8")
        # Within half an e4m3 step of the exact value (relative 2^-4), or of the subnormal step of
        # the row's scale (absolute, below 2^-16 of the row's largest value).
        bound = STORE_REL_TOL * exact.abs() + STORE_ABS_TOL * exact.abs().amax(dim=1, keepdim=True)
        errors.store = max(errors.store, float(((stored.double() - exact.double()).abs() / bound).max()))

    def prefill(self, req: Request, length: int, start: int = 0) -> Errors:
        """Prefill tokens ``start .. length - 1`` of ``req`` (a chunk: ``start`` is where the previous
        one ended) through the backend: per layer the SWA KV, the compressors (then the norm + RoPE +
        quantize + store of their entries) and the indexer keys. With HiSparse the C4 entries land in
        device slots (backed up by :meth:`back_up` once the prompt is in)."""
        errors = Errors()
        self._grow(req, length)
        backend = self.backend
        backend.init_forward_metadata(ForwardBatch(torch.tensor([req.req_pool_idx]), [length], [start]))
        whole = self.model.hidden(req.req_pool_idx, 0, length).to(self.device)  # the references need the prefix
        x = whole[start:]
        positions = torch.arange(start, length, dtype=torch.int64, device=self.device)
        swa = self.req_to_swa_loc[req.req_pool_idx, start:length]
        for layer, (w, ratio) in enumerate(zip(self.model.layers, self.ratios)):
            kv = x @ w.w_kv
            q = (x @ w.wq).reshape(len(x), -1, HEAD_DIM)
            index = dict(index_q=(x @ w.w_iq).reshape(len(x), -1, 128), weights=torch.sigmoid(x @ w.w_iw)) \
                if ratio == 4 else {}
            done = backend.forward_extend(layer, kv, *((x @ w.w_ckv, x @ w.w_cscore) if ratio else (None, None)),
                                          *((x @ w.w_ikv, x @ w.w_iscore) if ratio == 4 else (None, None)), q=q,
                                          **index)
            if self.check:
                self._check_attention(q, w, done["out"], done["lse"], dict(done["attention_inputs"]), errors)
            rope = backend.layers[layer].rope
            self._check_store(kv, w.kv_norm, positions, self.pool.get_swa_kv_buffer(layer), swa, PAGE_SIZE, rope,
                              "V4", errors)
            if not ratio:
                continue
            entries, anchors = done["entries"][0], done["anchors"][0]
            if self.check:
                errors.compress = max(errors.compress, _rel(entries, compress_pool_reference(
                    (whole @ w.w_ckv).cpu(), (whole @ w.w_cscore).cpu(), w.ape, ratio)[anchors // ratio],
                    COMPRESS_TOL))
            hot = ratio == 4 and self.hisparse is not None
            slots = backend.entry_slots(req.req_pool_idx, anchors, ratio, hot=hot)
            self._check_store(entries, w.c_norm, anchors.to(self.device), self._c4_cache(layer) if ratio == 4 else
                              self.pool.get_compressed_kv_buffer(layer), slots, C4_PAGE if ratio == 4 else C128_PAGE,
                              rope, "V4", errors)
            if ratio == 4:
                keys, anchors = done["index_entries"][0], done["index_anchors"][0]
                if self.check:
                    errors.compress = max(errors.compress, _rel(keys, compress_pool_reference(
                        (whole @ w.w_ikv).cpu(), (whole @ w.w_iscore).cpu(), w.i_ape, 4)[anchors // 4],
                        COMPRESS_TOL))
                islots = backend.entry_slots(req.req_pool_idx, anchors, 4, hot=False)
                self._check_store(keys, w.i_norm, anchors.to(self.device), self.pool.get_indexer_buffer(layer),
                                  islots, C4_PAGE, rope, "INDEXER_FP8", errors)
        self.errors.merge(errors)
        return errors

    def finish(self, req: Request) -> None:
        """Release a finished request: the backend's state (with HiSparse the coordinator's), then
        its full-token and SWA pages; its row can take a new request."""
        self.backend.finish(req)
        rid = req.req_pool_idx
        if self.hisparse is None:
            self.full_alloc.free(torch.tensor(sorted({loc // PAGE_SIZE for loc in req.locs})))
        else:
            self.allocator.free_logical(self.req_to_token[rid, : len(req.locs)].clone(), rid=rid)
        self.swa_alloc.free(torch.tensor(req.swa_pages))
        self.req_to_token[rid] = 0
        self.req_to_swa_loc[rid] = 0
        req.locs, req.swa_pages, req.kv_allocated_len = [], [], 0

    def back_up(self, reqs: list[Request]) -> None:
        """HiSparse: back the prefilled C4 KV up to the host pool, keep only the hot buffers."""
        self.backend.admit(reqs)
        self.coordinator.read_counters(reset=True)

    # ---- decode --------------------------------------------------------------------------------

    def decode_step(self, reqs: list[Request], tokens: int = 1,
                    accepted: list[int] | None = None) -> tuple[list[torch.Tensor], StepStats]:
        """One decode token (or an MTP verify block of ``tokens``) for every request through the
        backend: store its SWA KV, compress (fused store), select the top-k C4 entries with the
        indexer, swap them in (HiSparse) and attend with the sink.

        ``accepted`` (MTP): how many of each request's ``tokens`` the verify accepts (default all);
        the request's length then ends there, and its next step rewrites the rejected positions
        (their locations are kept for them).

        Returns the attention output of every layer (float32 ``[B * tokens, heads, 512]``, request
        after request) and the step's stats.
        """
        t0 = time.perf_counter()
        errors = Errors()
        if tokens > 1 and self.recorders:
            raise ValueError("sparsekv: argument `tokens`: traces record one decode token per request and step")
        n_before = [r.kv_allocated_len for r in reqs]
        for req, n in zip(reqs, n_before):
            self._grow(req, n + tokens, decode=True)
        rids = [r.req_pool_idx for r in reqs]
        backend = self.backend
        backend.init_forward_metadata(ForwardBatch(torch.tensor(rids), [n + tokens for n in n_before],
                                                   tokens_per_request=tokens))
        x = torch.cat([self.model.hidden(r.req_pool_idx, n, n + tokens)
                       for r, n in zip(reqs, n_before)]).to(self.device)
        rows = len(reqs) * tokens

        def project(weight: torch.Tensor) -> torch.Tensor:
            # Row by row: BLAS picks its blocking by the row count, so a batched product's bits depend
            # on the batch; this way a token's inputs are the same alone, in a batch or in an MTP block.
            return torch.cat([x[i : i + 1] @ weight for i in range(rows)])

        positions = backend.metadata("positions")
        outputs = []
        for layer, (w, ratio) in enumerate(zip(self.model.layers, self.ratios)):
            q = project(w.wq).reshape(rows, -1, HEAD_DIM)
            args = [project(w.w_kv), *((project(w.w_ckv), project(w.w_cscore)) if ratio else (None, None))]
            if ratio == 4:
                iq = project(w.w_iq).reshape(rows, -1, 128)
                weights = torch.sigmoid(project(w.w_iw))
                args += [project(w.w_ikv), project(w.w_iscore), iq, weights]
            recorder = self.recorders.get(layer)
            before = self.coordinator.read_counters() if recorder is not None and self.coordinator else None
            out = backend.forward_decode(layer, q, *args).clone()
            if ratio == 4:
                if self.check:
                    self._check_indexer(layer, iq, weights, positions, errors)
                if recorder is not None:
                    c4_lens = [(n + 1) // 4 for n in n_before]
                    selected = backend.metadata("tokens").tolist()
                    if before is None:
                        recorder.record(rids, c4_lens, selected)
                    else:
                        after = self.coordinator.read_counters()
                        recorder.record(rids, c4_lens, selected, (after["hits"] - before["hits"],
                                                                after["misses"] - before["misses"]))
            if self.check:
                self._check_attention(q, w, out, backend.metadata("lse"), backend.attention_inputs(layer), errors)
            outputs.append(out)
        for req, n, m in zip(reqs, n_before, accepted or [tokens] * len(reqs)):
            req.kv_allocated_len = n + m
        stats = StepStats()
        if self.coordinator is not None:
            counters = self.coordinator.read_counters(reset=True)
            stats.hits, stats.misses, stats.bytes_h2d = counters["hits"], counters["misses"], counters["bytes"]
        stats.seconds = time.perf_counter() - t0
        self.errors.merge(errors)
        return outputs, stats

    def _check_attention(self, q, w, out, lse, inputs: dict, errors: Errors) -> None:
        """Attention output and lse against the fp64 attention over the same cache bytes and indices."""
        tol = ATTENTION_TOL[self.impl]
        if self.impl == "triton":  # its tensor cores take q rounded to bf16 once
            q = q.bfloat16().to(q.dtype)
        ref_out, ref_lse = sparse_decode_attention_reference(q, inputs.pop("kv_cache"), inputs.pop("indices"), w.sink,
                                                             inputs.pop("page_slots"), **inputs)
        if self.impl == "triton":
            out_error = float((out.cpu().double() - ref_out).abs().max()) / (tol * max(1.0, float(ref_out.abs().max())))
        else:
            out_error = _rel(out, ref_out, tol)
        errors.attention = max(errors.attention, out_error, _rel(lse, ref_lse, tol))
        errors.attention_abs = max(errors.attention_abs, float((out.cpu().double() - ref_out).abs().max()))

    def _check_indexer(self, layer, iq, weights, positions, errors: Errors) -> None:
        """The backend's indexer scores of a C4 layer against the fp64 indexer."""
        page_table = self.backend.metadata("page_table")
        k_cache = self.pool.get_indexer_buffer(layer)
        scores = self.backend.metadata("scores")
        ref = indexer_scores_reference(iq, weights, k_cache, page_table, positions, page_slots=C4_PAGE,
                                       layout="fp8", width=scores.shape[1])
        finite = torch.isfinite(ref)
        # sum_h |w_h| |q_h| |k| <= (sum_h |w_h| |q_h|) * max |k|: the bound per row, with the row's largest key.
        wq = (weights.abs().double().cpu() * iq.double().cpu().norm(dim=2)).sum(dim=1, keepdim=True)
        kmax = self._max_key_norm(k_cache, page_table, positions)
        bound = INDEXER_TOL * wq * kmax[:, None]
        visible = torch.arange(scores.shape[1])[None] < ((positions.cpu() + 1) // 4)[:, None]
        diff = (scores.cpu().double() - ref).abs()
        keep = finite & visible
        if bool(keep.any()):
            errors.indexer = max(errors.indexer, float((diff[keep] / bound.expand_as(diff)[keep]).max()))

    def _max_key_norm(self, k_cache, page_table, positions) -> torch.Tensor:
        norms = []
        for b in range(page_table.shape[0]):
            n = int(visible_entries(positions[b : b + 1].cpu())[0])
            keys = decode_indexer_keys(k_cache.cpu(), entry_slots(page_table[b].cpu(), n, C4_PAGE), C4_PAGE, "fp8")
            norms.append(float(keys.norm(dim=1).max()) if n else 0.0)
        return torch.tensor(norms, dtype=torch.float64)

"""The demo's serving stack: plan, pools, prefill and decode of the demo model through the kernels.

One :class:`Stack` is one server process: the memory plan of the model for a budget
(:func:`~sparsekv.srt.model_executor.plan_pipeline`, what ``sparsekv plan-memory`` runs), the
``DeepSeekV4TokenToKVPool`` built from it, and with HiSparse the C4 hot pool, its host pool and the
:class:`~sparsekv.srt.managers.HiSparseCoordinator`. Each step is checked as it runs:

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
from sparsekv.jit_kernel.dsv4 import (
    dequantize_fp8_ds_mla,
    indexer_scores,
    indexer_topk,
    norm_rope_store,
    sparse_decode_attention,
)
from sparsekv.jit_kernel.dsv4_indexer import visible_entries
from sparsekv.jit_kernel.dsv4_store import RopeTable, StoreTarget
from sparsekv.srt.mem_cache.allocators import PagedAllocator
from sparsekv.srt.mem_cache.compressor_state import CompressorState
from sparsekv.srt.mem_cache.deepseekv4_memory_pool import DeepSeekV4TokenToKVPool
from sparsekv.srt.model_executor import DSV4ModelSpec, ServerSpec, plan_pipeline
from sparsekv.testing.hisparse_traces import TraceRecorder
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.reference.dsv4_compress import compress_pool_reference
from sparsekv.testing.reference.dsv4_indexer import decode_indexer_keys, entry_slots, indexer_scores_reference
from sparsekv.testing.reference.dsv4_store import normalize_rotate

PAGE_SIZE = 256
C4_PAGE = PAGE_SIZE // 4
C128_PAGE = PAGE_SIZE // 128
#: Documented tolerances against the fp64 references (the kernels' module docstrings).
ATTENTION_TOL = 2e-4  # |x - ref| <= tol + tol |ref|, out and lse
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


def plan(model: DemoModel, *, tokens: int, hisparse: int | None, requests: int):
    """The plan of one PP rank for the smallest power-of-two budget (from 16 MiB) that holds
    ``requests`` requests of ``tokens`` tokens: ``(budget_bytes, rank_plan, server)``."""
    spec = DSV4ModelSpec(num_hidden_layers=len(model.shape.compress_ratios),
                         compress_ratios=model.shape.compress_ratios, context_len=max(4096, 2 * tokens))
    server = ServerSpec(page_size=PAGE_SIZE, max_running_requests=requests, swa_full_tokens_ratio=0.5,
                        enable_hisparse=hisparse is not None, hisparse_host_to_device_ratio=hisparse or 2)
    need = requests * (-(-tokens // PAGE_SIZE) + 1) * PAGE_SIZE
    budget = 16 << 20
    while True:
        rank = plan_pipeline(spec, server, budget).ranks[0]
        if rank.config.swa_max_total_num_tokens >= need and rank.config.full_max_total_num_tokens >= need * (
                hisparse or 1):
            return budget, rank, server
        budget *= 2


class Stack:
    """One process's pools and compressor states for the demo model (see the module docstring).

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
    """

    def __init__(self, model: DemoModel, *, tokens: int, requests: int, hisparse: int | None, hot_buffer: int,
                 device: str = "cpu", check: bool = True, impl: str = "header", trace_source: dict | None = None):
        self.model = model
        self.impl = impl
        self.device = torch.device(device)
        self.check = check
        # The model's float32 RoPE tables, one per RoPE setting, covering every position a request reaches.
        self.rope_tables = {w.rope: w.rope.table(tokens + PAGE_SIZE, self.device) for w in model.layers}
        self.hisparse = hisparse
        self.budget, rank, self.server = plan(model, tokens=tokens, hisparse=hisparse, requests=requests)
        self.config = rank.config
        self.pool = DeepSeekV4TokenToKVPool(rank.config, rank.configurator, device=self.device)
        self.ratios = model.shape.compress_ratios
        self.c4_index = {layer: i for i, layer in enumerate(j for j, r in enumerate(self.ratios) if r == 4)}
        self.swa_alloc = PagedAllocator(self.config.swa_max_total_num_tokens // PAGE_SIZE + 1, PAGE_SIZE, "swa")
        self.req_to_token = torch.zeros(requests + 1, tokens + PAGE_SIZE, dtype=torch.int64)
        self.coordinator = None
        if hisparse is None:
            self.full_alloc = PagedAllocator(self.pool.size // PAGE_SIZE + 1, PAGE_SIZE, "full")
        else:
            from sparsekv.srt.managers import HiSparseCoordinator
            from sparsekv.srt.mem_cache import HiSparseC4DevicePool, HiSparseTokenToKVPoolAllocator

            self.allocator = HiSparseTokenToKVPoolAllocator(self.pool.size // hisparse, PAGE_SIZE,
                                                            host_to_device_ratio=hisparse, device=self.device)
            self.c4_pool = HiSparseC4DevicePool(self.allocator, len(self.c4_index), self.device)
            self.coordinator = HiSparseCoordinator(
                SimpleNamespace(req_to_token=self.req_to_token), self.allocator, self.c4_pool,
                num_top_k=model.shape.top_k, hot_buffer_size=hot_buffer, collect_counters=True)
        self.recorders: dict[int, TraceRecorder] = {}
        if trace_source is not None:
            swap_in = {} if self.coordinator is None else {"hot_buffer": hot_buffer,
                                                           "policy": self.coordinator.swap_in_policy}
            self.recorders = {layer: TraceRecorder(model.shape.top_k, {**trace_source, "layer": layer, **swap_in})
                              for layer in self.c4_index}
        rings = self.pool.ring_sizes
        self.kv_state, self.index_state = {}, {}
        for layer, (w, ratio) in enumerate(zip(model.layers, self.ratios)):
            if ratio:
                self.kv_state[layer] = CompressorState(self.pool.get_compress_state(layer), w.ape, ratio, rings[ratio])
            if ratio == 4:
                self.index_state[layer] = CompressorState(self.pool.get_indexer_state(layer), w.i_ape, 4, rings[4])
        self.errors = Errors()

    # ---- addressing ----------------------------------------------------------------------------

    def _grow(self, req: Request, length: int) -> None:
        """Give ``req`` full-token locations and SWA pages up to ``length`` tokens."""
        have = len(req.locs)
        if self.hisparse is None:
            while len(req.locs) < length:
                if len(req.locs) % PAGE_SIZE == 0:
                    req.page = int(self.full_alloc.alloc(1)[0])
                req.locs.append(req.page * PAGE_SIZE + len(req.locs) % PAGE_SIZE)
        elif have == 0:
            full = self.allocator.alloc_extend(self.req_to_token, req.req_pool_idx, 0, length)
            req.locs = full.tolist()
        else:
            for n in range(have + 1, length + 1):
                req.locs.append(self.allocator.alloc_decode(self.req_to_token, req.req_pool_idx, n))
        if self.hisparse is None:
            self.req_to_token[req.req_pool_idx, have:length] = torch.tensor(req.locs[have:length])
        while len(req.swa_pages) * PAGE_SIZE < length:
            req.swa_pages.append(int(self.swa_alloc.alloc(1)[0]))
        req.kv_allocated_len = length

    def adopt(self, req: Request, length: int) -> list[int]:
        """PD decode: allocate a request whose first ``length`` tokens another process prefilled
        (logical locations without device slots, SWA pages), continue its compressors at ``length``;
        returns its full-token pages (the transfer's KV destinations)."""
        full = self.allocator.alloc_extend(self.req_to_token, req.req_pool_idx, 0, length, with_device=False)
        req.locs = full.tolist()
        while len(req.swa_pages) * PAGE_SIZE < length:
            req.swa_pages.append(int(self.swa_alloc.alloc(1)[0]))
        req.kv_allocated_len = length
        for state in (*self.kv_state.values(), *self.index_state.values()):
            state.resume(req.req_pool_idx, length)
        return [req.locs[p] // PAGE_SIZE for p in range(0, length, PAGE_SIZE)]

    def _swa_slots(self, req: Request, positions) -> torch.Tensor:
        return torch.tensor([req.swa_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions],
                            dtype=torch.int64)

    def _entry_slot(self, req: Request, ratio: int, anchor: int, *, hot: bool) -> int:
        """Cache slot of the entry anchored at ``anchor``: ``loc // ratio`` of its last token (C4 KV
        under HiSparse: the device slot the allocator mapped it to)."""
        loc = req.locs[anchor + ratio - 1] // ratio
        if hot:
            return int(self.allocator.full_to_hisparse_device_index_mapping[loc])
        return loc

    def _entry_slots(self, reqs: list[Request], ratio: int, *, hot: bool):
        """``entry_slots`` of ``CompressorState.extend`` for a batch of ``reqs``: :meth:`_entry_slot` of
        each entry, gathered on the device from the batch's rows of ``req_to_token``."""
        locs = self.req_to_token[[r.req_pool_idx for r in reqs]].to(self.device)
        mapping = self.allocator.full_to_hisparse_device_index_mapping if hot else None

        def slots(b: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
            loc = locs[b, anchor + ratio - 1] // ratio
            return mapping[loc] if hot else loc

        return slots

    def _rope(self, w) -> RopeTable:
        return self.rope_tables[w.rope]

    def _c4_cache(self, layer: int) -> torch.Tensor:
        if self.hisparse is None:
            return self.pool.get_compressed_kv_buffer(layer)
        return self.c4_pool.kv_buffer[self.c4_index[layer]]

    def _rings(self, req: Request, ratio: int) -> tuple[list[int], int | None]:
        return (req.swa_pages, PAGE_SIZE) if ratio == 4 else ([req.req_pool_idx], None)

    # ---- prefill -------------------------------------------------------------------------------

    def _store(self, x, weight, positions, cache, slots, page, rope, kind, errors: Errors) -> None:
        norm_rope_store(x, weight, EPS, positions, cache, slots, page, rope, kind)
        if self.check and slots.numel():
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

    def prefill(self, req: Request, length: int) -> Errors:
        """Prefill ``length`` tokens of ``req``: per layer the SWA KV, the compressors (then the
        fused norm + RoPE + quantize + store of their entries) and the indexer keys. With HiSparse
        the C4 entries land in device slots and the request is then backed up to the host pool."""
        errors = Errors()
        self._grow(req, length)
        x = self.model.hidden(req.req_pool_idx, 0, length).to(self.device)
        positions = torch.arange(length, dtype=torch.int64, device=self.device)
        swa = self._swa_slots(req, range(length)).to(self.device)
        for layer, (w, ratio) in enumerate(zip(self.model.layers, self.ratios)):
            self._store(x @ w.w_kv, w.kv_norm, positions, self.pool.get_swa_kv_buffer(layer), swa, PAGE_SIZE,
                        self._rope(w), "V4", errors)
            if not ratio:
                continue
            kv, score = x @ w.w_ckv, x @ w.w_cscore
            rings, span = self._rings(req, ratio)
            entries, anchors = self.kv_state[layer].extend([req.req_pool_idx], [rings], [0], kv, score, span)
            if self.check:
                errors.compress = max(errors.compress, _rel(entries, compress_pool_reference(
                    kv.cpu(), score.cpu(), w.ape, ratio), COMPRESS_TOL))
            hot = ratio == 4 and self.hisparse is not None
            slots = torch.tensor([self._entry_slot(req, ratio, int(a), hot=hot) for a in anchors],
                                 dtype=torch.int64, device=self.device)
            cache = self._c4_cache(layer) if ratio == 4 else self.pool.get_compressed_kv_buffer(layer)
            self._store(entries, w.c_norm, anchors.to(self.device), cache, slots, C4_PAGE if ratio == 4 else C128_PAGE,
                        self._rope(w), "V4", errors)
            if ratio == 4:
                ikv, iscore = x @ w.w_ikv, x @ w.w_iscore
                keys, anchors = self.index_state[layer].extend([req.req_pool_idx], [rings], [0], ikv, iscore, span)
                if self.check:
                    errors.compress = max(errors.compress, _rel(keys, compress_pool_reference(
                        ikv.cpu(), iscore.cpu(), w.i_ape, 4), COMPRESS_TOL))
                islots = torch.tensor([self._entry_slot(req, 4, int(a), hot=False) for a in anchors],
                                      dtype=torch.int64, device=self.device)
                self._store(keys, w.i_norm, anchors.to(self.device), self.pool.get_indexer_buffer(layer), islots,
                            C4_PAGE, self._rope(w), "INDEXER_FP8", errors)
        self.errors.merge(errors)
        return errors

    def back_up(self, reqs: list[Request]) -> None:
        """HiSparse: back the prefilled C4 KV up to the host pool, keep only the hot buffers."""
        for req in reqs:
            self.coordinator.admit_request_into_staging(req)
        ready = self.coordinator.collect_ready_reqs()
        if sorted(r.req_pool_idx for r in ready) != sorted(r.req_pool_idx for r in reqs):
            raise RuntimeError("sparsekv demo: a staged request did not become ready")
        self.coordinator.read_counters(reset=True)

    # ---- decode --------------------------------------------------------------------------------

    def decode_step(self, reqs: list[Request]) -> tuple[list[torch.Tensor], StepStats]:
        """One decode token for every request: store its SWA KV, compress (fused store), select the
        top-k C4 entries with the indexer, swap them in (HiSparse) and attend with the sink.

        Returns the attention output of every layer (float32 ``[B, heads, 512]``) and the step's stats.
        """
        t0 = time.perf_counter()
        errors = Errors()
        n_before = [r.kv_allocated_len for r in reqs]
        for req, n in zip(reqs, n_before):
            self._grow(req, n + 1)
        if self.coordinator is not None:
            self.coordinator.map_last_loc_to_buffer([r.req_pool_idx for r in reqs], [n + 1 for n in n_before],
                                                    [r.locs[n] for r, n in zip(reqs, n_before)])
        dev = self.device
        x = torch.cat([self.model.hidden(r.req_pool_idx, n, n + 1) for r, n in zip(reqs, n_before)]).to(dev)
        positions = torch.tensor(n_before, dtype=torch.int64, device=dev)
        swa_new = torch.cat([self._swa_slots(r, [n]) for r, n in zip(reqs, n_before)]).to(dev)
        window = torch.full((len(reqs), WINDOW), -1, dtype=torch.int32)
        for b, (r, n) in enumerate(zip(reqs, n_before)):
            lo = max(0, n + 1 - WINDOW)
            window[b, : n + 1 - lo] = self._swa_slots(r, range(lo, n + 1)).to(torch.int32)
        window = window.to(dev)
        rids = [r.req_pool_idx for r in reqs]
        outputs = []
        for layer, (w, ratio) in enumerate(zip(self.model.layers, self.ratios)):
            swa_cache = self.pool.get_swa_kv_buffer(layer)
            norm_rope_store(x @ w.w_kv, w.kv_norm, EPS, positions, swa_cache, swa_new, PAGE_SIZE, self._rope(w), "V4")
            q = (x @ w.wq).reshape(len(reqs), -1, HEAD_DIM)
            extra = {}
            if ratio:
                hot = ratio == 4 and self.hisparse is not None
                page = C4_PAGE if ratio == 4 else C128_PAGE
                cache = self._c4_cache(layer) if ratio == 4 else self.pool.get_compressed_kv_buffer(layer)
                target = StoreTarget(cache, w.c_norm, EPS, page, self._rope(w))
                ring_args = [self._rings(r, ratio) for r in reqs]
                self.kv_state[layer].extend(
                    rids, [a for a, _ in ring_args], n_before, x @ w.w_ckv, x @ w.w_cscore, ring_args[0][1],
                    lengths=[1] * len(reqs), store=target, entry_slots=self._entry_slots(reqs, ratio, hot=hot))
            if ratio == 128:
                visible = [(n + 1) // 128 for n in n_before]
                c128 = torch.full((len(reqs), max(1, max(visible))), -1, dtype=torch.int32)
                for b, r in enumerate(reqs):
                    c128[b, : visible[b]] = torch.tensor([self._entry_slot(r, 128, 128 * i, hot=False)
                                                          for i in range(visible[b])], dtype=torch.int32)
                extra = dict(extra_kv_cache=cache, extra_indices=c128.to(dev), extra_page_size=C128_PAGE)
            elif ratio == 4:
                extra = self._select_c4(layer, w, reqs, rids, n_before, x, positions, cache, errors)
            out, lse = sparse_decode_attention(q, swa_cache, window, w.sink, PAGE_SIZE, impl=self.impl, **extra)
            if self.check:
                ref_out, ref_lse = sparse_decode_attention_reference(q, swa_cache, window, w.sink, PAGE_SIZE, **extra)
                errors.attention = max(errors.attention, _rel(out, ref_out, ATTENTION_TOL),
                                       _rel(lse, ref_lse, ATTENTION_TOL))
                errors.attention_abs = max(errors.attention_abs, float((out.cpu().double() - ref_out).abs().max()))
            outputs.append(out)
        stats = StepStats()
        if self.coordinator is not None:
            counters = self.coordinator.read_counters(reset=True)
            stats.hits, stats.misses, stats.bytes_h2d = counters["hits"], counters["misses"], counters["bytes"]
        stats.seconds = time.perf_counter() - t0
        self.errors.merge(errors)
        return outputs, stats

    def _select_c4(self, layer, w, reqs, rids, n_before, x, positions, cache, errors: Errors) -> dict:
        """The indexer's top-k of a C4 layer, as attention's extra cache and slots."""
        dev = self.device
        self.index_state[layer].extend(
            rids, [r.swa_pages for r in reqs], n_before, x @ w.w_ikv, x @ w.w_iscore, PAGE_SIZE,
            lengths=[1] * len(reqs),
            store=StoreTarget(self.pool.get_indexer_buffer(layer), w.i_norm, EPS, C4_PAGE, self._rope(w),
                              "INDEXER_FP8"),
            entry_slots=self._entry_slots(reqs, 4, hot=False))
        pages = max(-(-len(r.locs) // PAGE_SIZE) for r in reqs)
        page_table = torch.zeros(len(reqs), pages, dtype=torch.int32)
        for b, r in enumerate(reqs):
            ids = [r.locs[p] // PAGE_SIZE for p in range(0, len(r.locs), PAGE_SIZE)]
            page_table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        page_table = page_table.to(dev)
        iq = (x @ w.w_iq).reshape(len(reqs), -1, 128)
        weights = torch.sigmoid(x @ w.w_iw)
        k_cache = self.pool.get_indexer_buffer(layer)
        scores = indexer_scores(iq, weights, k_cache, page_table, positions, page_size=C4_PAGE, layout="fp8",
                                impl=self.impl)
        if self.check:
            ref = indexer_scores_reference(iq, weights, k_cache, page_table, positions, page_size=C4_PAGE,
                                           layout="fp8", width=scores.shape[1])
            finite = torch.isfinite(ref)
            # sum_h |w_h| |q_h| |k| <= (sum_h |w_h| |q_h|) * max |k|: the bound per row, with the row's largest key.
            wq = (weights.abs().double().cpu() * iq.double().cpu().norm(dim=2)).sum(dim=1, keepdim=True)
            kmax = self._max_key_norm(k_cache, page_table, positions)
            bound = INDEXER_TOL * wq * kmax[:, None]
            diff = (scores.cpu().double() - ref).abs()
            if bool(finite.any()):
                errors.indexer = max(errors.indexer, float((diff[finite] / bound.expand_as(diff)[finite]).max()))
        tokens, slots = indexer_topk(scores, positions, self.model.shape.top_k, page_table=page_table,
                                     page_size=C4_PAGE, impl=self.impl)
        recorder = self.recorders.get(layer)
        if self.coordinator is None:
            if recorder is not None:
                recorder.record(rids, [(n + 1) // 4 for n in n_before], tokens.tolist())
            return dict(extra_kv_cache=cache, extra_indices=slots, extra_page_size=C4_PAGE)
        c4_lens = torch.tensor([(n + 1) // 4 for n in n_before], dtype=torch.int32, device=dev)
        before = self.coordinator.read_counters() if recorder is not None else None
        locs = self.coordinator.swap_in_selected_pages(torch.tensor(rids, device=dev), c4_lens, tokens,
                                                       self.c4_index[layer])
        if recorder is not None:
            after = self.coordinator.read_counters()
            recorder.record(rids, c4_lens.tolist(), tokens.tolist(),
                            (after["hits"] - before["hits"], after["misses"] - before["misses"]))
        return dict(extra_kv_cache=cache, extra_indices=locs, extra_page_size=C4_PAGE)

    def _max_key_norm(self, k_cache, page_table, positions) -> torch.Tensor:
        norms = []
        for b in range(page_table.shape[0]):
            n = int(visible_entries(positions[b : b + 1].cpu())[0])
            keys = decode_indexer_keys(k_cache.cpu(), entry_slots(page_table[b].cpu(), n, C4_PAGE), C4_PAGE, "fp8")
            norms.append(float(keys.norm(dim=1).max()) if n else 0.0)
        return torch.tensor(norms, dtype=torch.float64)

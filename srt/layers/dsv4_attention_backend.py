"""The attention backend an engine's DSV4 model calls for each attention layer: :class:`Dsv4AttentionBackend`.

It joins the pieces an engine would otherwise wire by hand: the ``DeepSeekV4TokenToKVPool`` (SWA,
C4, C128 and indexer caches, compressor rings), the request tables (full-token and SWA locations of
every request row), the compressors' per-request state (:class:`~sparsekv.srt.mem_cache.CompressorState`)
and, with HiSparse, the :class:`~sparsekv.srt.managers.HiSparseCoordinator` (admission, backups,
swap-in, finish). Its shape is the attention-backend shape of sglang and vLLM engines:

* per batch, :meth:`init_forward_metadata` derives on the device what the kernels read: each row's
  SWA slot and window, compressor ring rows, C4 / C128 / indexer entry slots (C4: the hot-buffer
  slot under HiSparse), the C4 page table and the C128 entry list;
* per layer, :meth:`forward_extend` (prefill chunks: SWA store, compressors, stores) and
  :meth:`forward_decode` (one token per request, or an MTP block of several: SWA store, compressor
  + fused store, indexer top-k, HiSparse swap-in, sparse attention with the sink) for C4, C128 and
  window-only layers;
* CUDA graphs: :meth:`init_cuda_graph_state` allocates every buffer once for ``max_bs`` rows;
  :meth:`init_forward_metadata_capture_cuda_graph` and :meth:`init_forward_metadata_replay_cuda_graph`
  refill them in place. Given that state, :meth:`forward_decode` allocates nothing and reads nothing
  back, and traces under ``torch.compile(fullgraph=True)`` with the HiSparse swap-in included.

Layout of the tables (the engine's): ``req_to_token[row, p]`` is the full-token location of position
``p`` (C4 entry ``i`` of a request lives at ``req_to_token[row, 4 i + 3] // 4``, C128 entry ``i`` at
``req_to_token[row, 128 i + 127] // 128``); ``req_to_swa_loc[row, p]`` its SWA location (the C4 rings
are addressed by the SWA page, the C128 ring by the request row).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sparsekv.checks import int_in
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.dsv4 import (
    compress_decode_step,
    lightning_indexer,
    norm_rope_store,
    sparse_decode_attention,
)
from sparsekv.jit_kernel.dsv4_attention import workspace_floats
from sparsekv.jit_kernel.dsv4_indexer import topk_workspace_ints
from sparsekv.jit_kernel.dsv4_store import StoreTarget
from sparsekv.rope import RopeTable
from sparsekv.srt.checks import index_table
from sparsekv.srt.mem_cache.compressor_state import CompressorState

HEAD_DIM = 512
INDEXER_DIM = 128
#: The compressor's per-row tables, which an MTP block also keeps token after token (name, row shape).
COLUMN_TABLES = (("positions", ()), ("c4_state_rows", (8,)), ("c128_state_rows", (128,)), ("c4_slots", ()),
                 ("c128_slots", ()), ("index_slots", ()))


@dataclass(frozen=True)
class Dsv4LayerParams:
    """What the backend needs of one attention layer's weights (the model keeps its projections).

    Attributes
    ----------
    ratio : int
        0 (window only), 4 (C4: compressed KV chosen by the lightning indexer) or 128 (C128: every entry).
    sink : torch.Tensor
        float32 ``[heads]``: the per-head attention sink.
    kv_norm : torch.Tensor
        float32 ``[512]``: RMSNorm weight of the SWA KV.
    rope : RopeTable
        The layer's float32 cos/sin table (``RopeParams(...).table(max_position)``).
    ape, c_norm : torch.Tensor, optional
        The compressor's positional bias ``[ratio, coff * 512]`` and its entries' RMSNorm weight (ratio 4, 128).
    i_ape, i_norm : torch.Tensor, optional
        The indexer compressor's bias ``[4, 256]`` and its keys' RMSNorm weight ``[128]`` (ratio 4).
    eps : float
        RMSNorm epsilon.
    """

    ratio: int
    sink: torch.Tensor
    kv_norm: torch.Tensor
    rope: RopeTable
    ape: torch.Tensor | None = None
    c_norm: torch.Tensor | None = None
    i_ape: torch.Tensor | None = None
    i_norm: torch.Tensor | None = None
    eps: float = 1e-6


@dataclass
class ForwardBatch:
    """One batch as the scheduler describes it.

    Attributes
    ----------
    req_pool_indices : torch.Tensor
        int64 ``[B]``: the request rows.
    seq_lens : sequence of int
        Host lengths of each request after this batch (decode: including the new token).
    extend_prefix_lens : sequence of int, optional
        Extend only: tokens each request already had (its chunk starts there). Decode: ``None``.
    tokens_per_request : int
        Decode only: the tokens each request brings in this step, its last ``tokens_per_request``
        positions (1: a plain decode; more: an MTP / speculative verify block, the accepted token
        and its drafts). The step's rows are request after request, each request's tokens in
        position order. A rejected draft is undone by the next batch's ``seq_lens`` (the accepted
        length): its rows are written again when the request gets there.
    """

    req_pool_indices: torch.Tensor
    seq_lens: Sequence[int]
    extend_prefix_lens: Sequence[int] | None = None
    tokens_per_request: int = 1

    @property
    def is_decode(self) -> bool:
        return self.extend_prefix_lens is None


class Dsv4AttentionBackend:
    """Per-batch metadata and per-layer calls of DSV4 attention over a ``DeepSeekV4TokenToKVPool``.

    Parameters
    ----------
    pool : DeepSeekV4TokenToKVPool
        The rank's KV pool (page size ``pool.page_size``).
    layers : sequence of Dsv4LayerParams
        One per layer of the pool, in layer order.
    req_to_token, req_to_swa_loc : torch.Tensor
        int64 ``[rows, max_context]`` on the pool's device: the full-token and SWA location of
        every position of every request row (the engine's tables; the backend only reads them).
    num_top_k : int
        The indexer's top-k (C4 entries each token attends); formerly ``top_k=``, which still works for
        one release (with a ``DeprecationWarning``).
    window : int
        Sliding-window length of the SWA attention.
    coordinator : HiSparseCoordinator, optional
        With HiSparse: the C4 KV lives in the coordinator's hot buffers and host pool; the backend
        makes its calls (admission, backups, swap-in, finish).
    impl : str
        ``"header"``, ``"triton"`` or ``"auto"``: the indexer's and the attention's implementation.
    """

    @renamed_keywords(top_k="num_top_k")
    def __init__(self, pool, layers: Sequence[Dsv4LayerParams], req_to_token: torch.Tensor,
                 req_to_swa_loc: torch.Tensor, *, num_top_k: int, window: int, coordinator=None, impl: str = "auto"):
        if len(layers) != len(pool.layer_mapping):
            raise ValueError(f"sparsekv: argument `layers` has {len(layers)} layers, the pool "
                             f"{len(pool.layer_mapping)}")
        for name, table in (("req_to_token", req_to_token), ("req_to_swa_loc", req_to_swa_loc)):
            if table.dtype != torch.int64 or table.dim() != 2:
                raise TypeError(f"sparsekv: argument `{name}` must be a 2-D int64 tensor")
        self.pool, self.layers, self.impl = pool, list(layers), impl
        self.req_to_token, self.req_to_swa_loc = req_to_token, req_to_swa_loc
        self.device = pool.device
        self.num_top_k, self.window, self.coordinator = num_top_k, window, coordinator
        self.page_size = pool.page_size
        self.c4_page, self.c128_page = self.page_size // 4, self.page_size // 128
        self.rings = pool.ring_sizes
        ratios = [layer.ratio for layer in self.layers]
        self.c4_index = {i: n for n, i in enumerate(i for i, r in enumerate(ratios) if r == 4)}
        self.max_context = req_to_token.shape[1]
        self.heads = int(self.layers[0].sink.numel())
        # Compressor states of prefill chunks (host-planned), one per compressor of each layer.
        self.kv_state: dict[int, CompressorState] = {}
        self.index_state: dict[int, CompressorState] = {}
        self.kv_target: dict[int, StoreTarget] = {}
        self.index_target: dict[int, StoreTarget] = {}
        for i, layer in enumerate(self.layers):
            if layer.ratio:
                self.kv_state[i] = CompressorState(pool.get_compress_state(i), layer.ape, layer.ratio,
                                                   self.rings[layer.ratio])
                page = self.c4_page if layer.ratio == 4 else self.c128_page
                self.kv_target[i] = StoreTarget(self.compressed_cache(i), layer.c_norm, layer.eps, page, layer.rope)
            if layer.ratio == 4:
                self.index_state[i] = CompressorState(pool.get_indexer_state(i), layer.i_ape, 4, self.rings[4])
                self.index_target[i] = StoreTarget(pool.get_indexer_buffer(i), layer.i_norm, layer.eps, self.c4_page,
                                                   layer.rope, "INDEXER_FP8")
        self._bufs: dict[str, torch.Tensor] | None = None
        self._capacity = 0
        self.bs = 0
        self.tokens_per_request = 1

    # ---- caches -----------------------------------------------------------------------------------

    def compressed_cache(self, layer_id: int) -> torch.Tensor:
        """The paged V4 cache of a layer's compressed entries (C4 under HiSparse: the hot pool)."""
        if self.layers[layer_id].ratio == 4 and self.coordinator is not None:
            return self.coordinator.device_pool.kv_buffer[self.c4_index[layer_id]]
        return self.pool.get_compressed_kv_buffer(layer_id)

    # ---- buffers ----------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate every per-batch buffer once for up to ``max_bs`` rows (metadata and outputs; an
        MTP block of ``n`` tokens per request takes ``n`` rows per request)."""
        dev, w, n128 = self.device, self.window, max(1, self.max_context // 128)
        pages = -(-self.max_context // self.page_size)
        i64, i32, f32 = torch.int64, torch.int32, torch.float32
        self._bufs = {
            "rows": torch.zeros(max_bs, dtype=i64, device=dev),
            "positions": torch.zeros(max_bs, dtype=i64, device=dev),
            "swa_slots": torch.zeros(max_bs, dtype=i64, device=dev),
            "window": torch.full((max_bs, w), -1, dtype=i32, device=dev),
            "c4_state_rows": torch.zeros(max_bs, 8, dtype=i64, device=dev),
            "c128_state_rows": torch.zeros(max_bs, 128, dtype=i64, device=dev),
            "c4_slots": torch.zeros(max_bs, dtype=i64, device=dev),
            "c128_slots": torch.zeros(max_bs, dtype=i64, device=dev),
            "index_slots": torch.zeros(max_bs, dtype=i64, device=dev),
            "page_table": torch.zeros(max_bs, pages, dtype=i32, device=dev),
            "c128_indices": torch.full((max_bs, n128), -1, dtype=i32, device=dev),
            "c4_lens": torch.zeros(max_bs, dtype=i32, device=dev),
            # MTP blocks: the compressor's tables again, token after token (column j of every request
            # is one contiguous slice), for its steps in position order.
            **{f"column_{name}": torch.zeros(max_bs, *shape, dtype=i64, device=dev) for name, shape in COLUMN_TABLES},
            "num_real": torch.zeros(1, dtype=i32, device=dev),
            "entries": torch.zeros(max_bs, HEAD_DIM, dtype=f32, device=dev),
            "emitted": torch.zeros(max_bs, dtype=torch.bool, device=dev),
            "index_entries": torch.zeros(max_bs, INDEXER_DIM, dtype=f32, device=dev),
            "index_emitted": torch.zeros(max_bs, dtype=torch.bool, device=dev),
            "scores": torch.zeros(max_bs, pages * self.c4_page, dtype=f32, device=dev),
            "tokens": torch.zeros(max_bs, self.num_top_k, dtype=i32, device=dev),
            "top_slots": torch.zeros(max_bs, self.num_top_k, dtype=i32, device=dev),
            "out": torch.zeros(max_bs, self.heads, HEAD_DIM, dtype=f32, device=dev),
            "lse": torch.zeros(max_bs, self.heads, dtype=f32, device=dev),
            "workspace": torch.zeros(max(1, workspace_floats(max_bs, self.heads, 1)), dtype=f32, device=dev),
            # The top-k's (its rows split over several CTAs at small batch): enough for any batch up to max_bs.
            "topk_workspace": torch.zeros(max(1, max(topk_workspace_ints(bs, pages * self.c4_page, self.num_top_k)
                                                     for bs in range(1, max_bs + 1))), dtype=i32, device=dev),
        }
        self._capacity = max_bs

    def _buf(self, name: str) -> torch.Tensor:
        return self._bufs[name][: self.bs]

    def metadata(self, name: str) -> torch.Tensor:
        """The current batch's rows of one buffer (``"positions"``, ``"window"``, ``"page_table"``,
        ``"scores"`` and ``"tokens"`` of the last C4 layer, ...): for checks and traces."""
        return self._buf(name)

    # ---- per batch --------------------------------------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Derive the batch's metadata on the device (decode), or note the chunks (extend).

        Decode: with HiSparse, first routes each new C4 entry into its request's hot buffer and
        backs up the previous step's (``map_last_loc_to_buffer``, the scheduler's host step).

        Raises
        ------
        ValueError
            ``tokens_per_request`` below 1, or above 1 with HiSparse (its MTP rows are not supported
            yet: the coordinator backs up one new C4 entry per request and step).
        """
        rows = batch.req_pool_indices
        if batch.is_decode:
            n = int_in(batch.tokens_per_request, "tokens_per_request", 1)
            if n > 1 and self.coordinator is not None:
                raise ValueError(f"sparsekv: argument `tokens_per_request` = {n}: MTP rows with HiSparse are not "
                                 f"supported yet (the coordinator backs up one new C4 entry per request and step)")
            bs = rows.shape[0] * n
            if self._bufs is None or bs > self._capacity:
                self.init_cuda_graph_state(max(bs, self._capacity))
            if self.coordinator is not None:
                host_rows = rows.tolist()
                locs = [int(self.req_to_token[r, length - 1]) for r, length in zip(host_rows, batch.seq_lens)]
                self.coordinator.map_last_loc_to_buffer(host_rows, list(batch.seq_lens), locs)
            for r, length in zip(rows.tolist(), batch.seq_lens):
                for state in (*self.kv_state.values(), *self.index_state.values()):
                    state.release(r)  # the device step moves the request on: the next chunk starts after it
                    state.resume(r, length)
            ends = torch.as_tensor(list(batch.seq_lens), dtype=torch.int64, device=self.device)
            positions = (ends[:, None] - n + torch.arange(n, device=self.device)).reshape(-1)
            self._fill_decode(rows.to(self.device).repeat_interleave(n), positions, bs, bs, n)
        else:
            self.extend_rows = rows.tolist()
            self.extend_starts = list(batch.extend_prefix_lens)
            self.extend_lens = [n - s for n, s in zip(batch.seq_lens, batch.extend_prefix_lens)]

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 positions: torch.Tensor, tokens_per_request: int = 1) -> None:
        """Fill the graph state for a capture of ``bs`` rows (the buffers the captured step reads);
        ``tokens_per_request`` as :class:`ForwardBatch`'s (``bs`` rows are ``bs / n`` requests)."""
        self._fill_decode(req_pool_indices, positions, bs, bs, tokens_per_request)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, num_real: int, req_pool_indices: torch.Tensor,
                                                positions: torch.Tensor, tokens_per_request: int = 1) -> None:
        """Refill the graph state in place before a replay: ``num_real`` real rows of the ``bs``
        captured (the rest are padding: they write nothing the real rows read, and swap in nothing).
        With MTP blocks (``tokens_per_request`` rows per request, request after request) ``bs`` and
        ``num_real`` count rows.

        Raises
        ------
        TypeError
            ``req_pool_indices`` or ``positions`` is not an integer tensor.
        ValueError
            ``bs`` above the graph state's, a table that is not 1-D of ``bs`` entries, ``num_real``
            outside ``[0, bs]``, or ``bs`` not a multiple of ``tokens_per_request``; the graph state
            is left as it was.
        """
        self._fill_decode(req_pool_indices, positions, bs, num_real, tokens_per_request)

    def _fill_decode(self, rows: torch.Tensor, positions: torch.Tensor, bs: int, num_real: int,
                     tokens_per_request: int) -> None:
        # Every argument is checked before the first buffer is written: a tensor of another length would
        # broadcast (one row) or fail between two copies, leaving the graph state half refilled.
        if self._bufs is None or bs > self._capacity:
            raise ValueError(f"sparsekv: batch of {bs} rows, the graph state holds {self._capacity}")
        for name, value in (("req_pool_indices", rows), ("positions", positions)):
            if index_table(value, name, ndim=1).shape[0] != bs:
                raise ValueError(f"sparsekv: argument `{name}` must have bs = {bs} entries, got {value.shape[0]}")
        if not 0 <= num_real <= bs:
            raise ValueError(f"sparsekv: argument `num_real` must be in [0, bs = {bs}], got {num_real}")
        n = int_in(tokens_per_request, "tokens_per_request", 1)
        if bs % n:
            raise ValueError(f"sparsekv: argument `tokens_per_request` = {n} does not divide bs = {bs} rows")
        self.bs, self.tokens_per_request = bs, n
        b = self._bufs
        b["rows"][:bs].copy_(rows)
        b["positions"][:bs].copy_(positions)
        b["num_real"].fill_(num_real)
        for name, value in self._derive(b["rows"][:bs], b["positions"][:bs]).items():
            b[name][:bs].copy_(value)
        if n > 1:  # request-major rows -> token-major columns
            for name, _ in COLUMN_TABLES:
                rm = b[name][:bs]
                b[f"column_{name}"][:bs].copy_(rm.unflatten(0, (bs // n, n)).transpose(0, 1).reshape(rm.shape))

    def _derive(self, rows: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the kernels read for rows ``(rows[i], pos[i])`` (a request row and a token position each)."""
        out: dict[str, torch.Tensor] = {}
        ctx = self.max_context
        tok = self.req_to_token[rows]  # [n, ctx]
        swa = self.req_to_swa_loc[rows]
        out["swa_slots"] = swa.gather(1, pos[:, None])[:, 0]
        # The window: positions lo..pos first (oldest first), then -1.
        offs = torch.arange(self.window, device=self.device)
        span = torch.clamp(pos, max=self.window - 1)
        window = swa.gather(1, ((pos - span)[:, None] + offs).clamp(max=ctx - 1))
        out["window"] = torch.where(offs <= span[:, None], window, -1).to(torch.int32)
        # Compressor ring rows of the last 8 (C4) / 128 (C128) positions; positions before 0 are not read.
        for ratio, name in ((4, "c4_state_rows"), (128, "c128_state_rows")):
            ring = self.rings.get(ratio, 0)
            if not ring:
                continue
            w = 8 if ratio == 4 else 128
            q = (pos[:, None] - (w - 1) + torch.arange(w, device=self.device)).clamp(min=0)
            ring_id = swa.gather(1, q) // self.page_size if ratio == 4 else rows[:, None].expand(-1, w)
            out[name] = ring_id * ring + q % ring
        loc = tok.gather(1, pos[:, None])[:, 0]
        out["index_slots"] = loc // 4
        out["c128_slots"] = loc // 128
        out["c4_slots"] = self._hot(loc // 4)
        pages = -(-ctx // self.page_size)
        out["page_table"] = (tok[:, :: self.page_size][:, :pages] // self.page_size).to(torch.int32)
        n128 = max(1, ctx // 128)
        last = 128 * torch.arange(n128, device=self.device) + 127
        c128 = tok.gather(1, last.clamp(max=ctx - 1)[None].expand(rows.shape[0], -1)) // 128
        out["c128_indices"] = torch.where(last[None] <= pos[:, None], c128, -1).to(torch.int32)
        out["c4_lens"] = ((pos + 1) // 4).to(torch.int32)
        return out

    def _hot(self, c4_locs: torch.Tensor) -> torch.Tensor:
        """C4 KV slots of logical C4 locations: under HiSparse the device slots they are mapped to."""
        if self.coordinator is None:
            return c4_locs
        mapping = self.coordinator.allocator.full_to_hisparse_device_index_mapping
        return mapping[c4_locs]

    # ---- per layer --------------------------------------------------------------------------------

    def forward_decode(self, layer_id: int, q: torch.Tensor, kv: torch.Tensor, c_kv: torch.Tensor | None = None,
                       c_score: torch.Tensor | None = None, i_kv: torch.Tensor | None = None,
                       i_score: torch.Tensor | None = None, index_q: torch.Tensor | None = None,
                       weights: torch.Tensor | None = None) -> torch.Tensor:
        """One decode token of every row through layer ``layer_id``; returns the attention output.

        Parameters
        ----------
        q : torch.Tensor
            float32 ``[B, heads, 512]``: ``B`` rows, one per token (an MTP block: ``tokens_per_request``
            rows per request, request after request).
        kv : torch.Tensor
            float32 ``[B, 512]``: the new token's SWA KV before its norm (stored normalized, rotated, FP8).
        c_kv, c_score : torch.Tensor, optional
            float32 ``[B, coff * 512]``: the compressor's inputs (C4, C128 layers).
        i_kv, i_score, index_q, weights : torch.Tensor, optional
            C4 layers: the indexer compressor's inputs ``[B, 256]``, the indexer query ``[B, heads', 128]``
            and its head weights ``[B, heads']``.

        Returns
        -------
        torch.Tensor
            float32 ``[B, heads, 512]``: a view of the backend's output buffer (the next layer's call
            overwrites it: copy what you keep).
        """
        layer = self.layers[layer_id]
        pos = self._buf("positions")
        swa_cache = self.pool.get_swa_kv_buffer(layer_id)
        norm_rope_store(kv, layer.kv_norm, layer.eps, pos, swa_cache, self._buf("swa_slots"), self.page_size,
                        layer.rope, "V4")
        extra = {}
        if layer.ratio:
            rows = "c4_state_rows" if layer.ratio == 4 else "c128_state_rows"
            self._compress(c_kv, c_score, layer.ape, layer.ratio, self.pool.get_compress_state(layer_id), rows,
                           self.kv_target[layer_id], "c4_slots" if layer.ratio == 4 else "c128_slots", "")
        if layer.ratio == 128:
            extra = dict(extra_kv_cache=self.compressed_cache(layer_id), extra_indices=self._buf("c128_indices"),
                         extra_page_slots=self.c128_page)
        elif layer.ratio == 4:
            self._compress(i_kv, i_score, layer.i_ape, 4, self.pool.get_indexer_state(layer_id), "c4_state_rows",
                           self.index_target[layer_id], "index_slots", "index_")
            tokens, slots = lightning_indexer(
                index_q, weights, self.pool.get_indexer_buffer(layer_id), self._buf("page_table"), pos, self.num_top_k,
                page_slots=self.c4_page, scores=self._buf("scores"), out=self._buf("tokens"),
                out_slots=self._buf("top_slots"), workspace=self._bufs["topk_workspace"], impl=self.impl)
            if self.coordinator is not None:
                slots = self.coordinator.swap_in_selected_pages(self._buf("rows"), self._buf("c4_lens"), tokens,
                                                                self.c4_index[layer_id],
                                                                num_real_reqs=self._bufs["num_real"])
            extra = dict(extra_kv_cache=self.compressed_cache(layer_id), extra_indices=slots,
                         extra_page_slots=self.c4_page)
        out, _ = sparse_decode_attention(q, swa_cache, self._buf("window"), layer.sink, self.page_size,
                                         out=self._buf("out"), lse=self._buf("lse"), impl=self.impl, **extra)
        return out

    def _compress(self, x, score, ape, ratio, state, rows: str, target: StoreTarget, slots: str, out: str) -> None:
        """The decode step's compressor (+ fused store) over every row. An MTP block runs it once per
        token of the block, in position order (column ``j``: every request's ``j``-th token), so a
        token's window reads the ring rows its request's earlier tokens just wrote."""
        n = self.tokens_per_request
        if n == 1:
            compress_decode_step(x, score, ape, ratio, state, self._buf(rows), self._buf("positions"), store=target,
                                 entry_slots=self._buf(slots), out=self._buf(f"{out}entries"),
                                 emitted=self._buf(f"{out}emitted"))
            return
        reqs = self.bs // n
        for j in range(n):
            col = slice(j * reqs, (j + 1) * reqs)
            compress_decode_step(x.unflatten(0, (reqs, n))[:, j], score.unflatten(0, (reqs, n))[:, j], ape, ratio,
                                 state, self._bufs[f"column_{rows}"][col], self._bufs["column_positions"][col],
                                 store=target, entry_slots=self._bufs[f"column_{slots}"][col],
                                 out=self._bufs[f"{out}entries"][col], emitted=self._bufs[f"{out}emitted"][col])

    def attention_inputs(self, layer_id: int) -> dict:
        """The last decode step's attention inputs of ``layer_id`` besides the query (a check reads
        them): the SWA cache, the window, and the extra cache, indices and page size."""
        layer = self.layers[layer_id]
        inputs = dict(kv_cache=self.pool.get_swa_kv_buffer(layer_id), indices=self._buf("window"),
                      page_slots=self.page_size)
        if layer.ratio == 128:
            inputs |= dict(extra_kv_cache=self.compressed_cache(layer_id), extra_indices=self._buf("c128_indices"),
                           extra_page_slots=self.c128_page)
        elif layer.ratio == 4:
            slots = (self._buf("top_slots") if self.coordinator is None
                     else self.coordinator.top_k_device_locs_buffer[: self.bs])
            inputs |= dict(extra_kv_cache=self.compressed_cache(layer_id), extra_indices=slots,
                           extra_page_slots=self.c4_page)
        return inputs

    def forward_extend(self, layer_id: int, kv: torch.Tensor, c_kv: torch.Tensor | None = None,
                       c_score: torch.Tensor | None = None, i_kv: torch.Tensor | None = None,
                       i_score: torch.Tensor | None = None, *, q: torch.Tensor | None = None,
                       index_q: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> dict:
        """One prefill chunk of every request of the batch through layer ``layer_id``.

        The rows of each input are the batch's extend tokens, request after request (the lengths of
        :meth:`init_forward_metadata`). Writes the SWA KV, runs the compressors over the chunk
        (continuing each request's rings) and stores their entries and the indexer keys; with ``q``
        each token then attends causally: its window, and the C128 entries complete at its position
        or the indexer's top-k of the C4 entries complete at its position (``index_q``, ``weights``).

        Returns
        -------
        dict
            ``entries`` / ``anchors`` (the compressor's new entries and their first positions) and
            ``index_entries`` / ``index_anchors`` (C4), each per request, for checks; with ``q``,
            ``out`` and ``lse`` (float32 ``[T, heads, 512]`` and ``[T, heads]``) and ``attention_inputs``
            (the caches and indices each token attended).
        """
        layer = self.layers[layer_id]
        rows, starts, lens = self.extend_rows, self.extend_starts, self.extend_lens
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(self.device)
        swa_slots = torch.cat([self.req_to_swa_loc[r, s: s + n] for r, s, n in zip(rows, starts, lens)])
        norm_rope_store(kv, layer.kv_norm, layer.eps, positions, self.pool.get_swa_kv_buffer(layer_id),
                        swa_slots.to(self.device), self.page_size, layer.rope, "V4")
        done: dict = {}
        if layer.ratio:
            self._extend_compressors(layer_id, c_kv, c_score, i_kv, i_score, done)
        if q is not None:
            done |= self._extend_attention(layer_id, q, index_q, weights, positions)
        return done

    def _extend_compressors(self, layer_id: int, c_kv, c_score, i_kv, i_score, done: dict) -> None:
        layer = self.layers[layer_id]
        rows, starts, lens = self.extend_rows, self.extend_starts, self.extend_lens
        splits = torch.tensor(lens).cumsum(0).tolist()
        bounds = list(zip([0, *splits[:-1]], splits))
        for name, state, target, x, score, ratio in (
                ("", self.kv_state[layer_id], self.kv_target[layer_id], c_kv, c_score, layer.ratio),
                ("index_", self.index_state.get(layer_id), self.index_target.get(layer_id), i_kv, i_score, 4)):
            if state is None:
                continue
            entries_all, anchors_all = [], []
            for r, s, (a, z) in zip(rows, starts, bounds):
                if s == 0:
                    state.release(r)  # a new request in a reused row
                ring, span = self._ring(r, ratio)
                entries, anchors = state.extend([r], [ring], [s], x[a:z], score[a:z], span)
                hot = ratio == 4 and self.coordinator is not None and not name
                slot_of = self.entry_slots(r, anchors, ratio, hot=hot)
                norm_rope_store(entries, target.weight, target.eps, anchors.to(self.device), target.cache,
                                slot_of, target.page_slots, target.rope, target.cache_kind)
                entries_all.append(entries)
                anchors_all.append(anchors)
            done[f"{name}entries"], done[f"{name}anchors"] = entries_all, anchors_all

    def _extend_attention(self, layer_id: int, q, index_q, weights, positions: torch.Tensor) -> dict:
        layer = self.layers[layer_id]
        rows = torch.cat([torch.full((n,), r, dtype=torch.int64) for r, n in zip(self.extend_rows, self.extend_lens)])
        meta = self._derive(rows.to(self.device), positions)
        inputs = dict(kv_cache=self.pool.get_swa_kv_buffer(layer_id), indices=meta["window"], page_slots=self.page_size)
        if layer.ratio == 128:
            inputs |= dict(extra_kv_cache=self.compressed_cache(layer_id), extra_indices=meta["c128_indices"],
                           extra_page_slots=self.c128_page)
        elif layer.ratio == 4:
            _, slots = lightning_indexer(index_q, weights, self.pool.get_indexer_buffer(layer_id), meta["page_table"],
                                         positions, self.num_top_k, page_slots=self.c4_page, impl=self.impl)
            # Indexer slots are logical C4 locations; every entry of a prefill is on the device.
            hot = torch.where(slots >= 0, self._hot(slots.clamp(min=0).long()), -1).to(torch.int32)
            inputs |= dict(extra_kv_cache=self.compressed_cache(layer_id), extra_indices=hot,
                           extra_page_slots=self.c4_page)
        out, lse = sparse_decode_attention(q, inputs["kv_cache"], inputs["indices"], layer.sink, self.page_size,
                                           impl=self.impl, **{k: v for k, v in inputs.items() if k.startswith("extra")})
        return {"out": out, "lse": lse, "attention_inputs": inputs}

    def _ring(self, row: int, ratio: int) -> tuple[list[int], int | None]:
        if ratio == 128:
            return [row], None
        pages = self.req_to_swa_loc[row, :: self.page_size] // self.page_size
        return pages.tolist(), self.page_size

    def entry_slots(self, row: int, anchors: torch.Tensor, ratio: int, *, hot: bool) -> torch.Tensor:
        """Cache slots of request ``row``'s entries anchored at ``anchors``: ``loc // ratio`` of each
        entry's last token; ``hot``: the HiSparse device slot the allocator mapped it to."""
        loc = self.req_to_token[row, anchors.to(self.req_to_token.device) + ratio - 1] // ratio
        if hot:
            loc = self.coordinator.allocator.full_to_hisparse_device_index_mapping[loc]
        return loc.to(self.device)

    # ---- requests ---------------------------------------------------------------------------------

    def admit(self, reqs: Sequence) -> None:
        """HiSparse: back the prefilled requests' C4 KV up to the host pool and keep their hot buffers."""
        if self.coordinator is None:
            return
        for req in reqs:
            self.coordinator.admit_request_into_staging(req)
        ready = self.coordinator.collect_ready_reqs()
        if sorted(r.req_pool_idx for r in ready) != sorted(r.req_pool_idx for r in reqs):
            raise RuntimeError("sparsekv: a staged request did not become ready")

    def admit_transferred(self, req, length: int) -> None:
        """PD decode: a request whose first ``length`` tokens a prefill process sent (``KVReceiver``);
        its compressors continue at ``length``."""
        for state in (*self.kv_state.values(), *self.index_state.values()):
            state.release(req.req_pool_idx)
            state.resume(req.req_pool_idx, length)

    def finish(self, req) -> None:
        """Release a finished request's compressor progress and (HiSparse) its hot buffer and host slots."""
        for state in (*self.kv_state.values(), *self.index_state.values()):
            state.release(req.req_pool_idx)
        if self.coordinator is not None:
            self.coordinator.request_finished(req)

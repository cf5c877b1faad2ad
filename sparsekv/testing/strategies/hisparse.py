"""Hypothesis strategies and a small world builder for the HiSparse swap-in.

A :class:`SwapInWorld` is everything one layer of the swap-in reads: host and device caches (generic
rows or DSV4 pages) filled with random bytes, per-request tables with distinct host and device slots
in shuffled order (so a kernel that confuses a position with its slot fails), and helpers that play
the model's part (writing a new token's bytes into its device slot). :func:`top_k_row` draws one
step's top-k with the patterns the kernel must handle: hot tokens (hits), cold ones (misses), the
newest token, repeats, -1 and out-of-range entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from sparsekv.kv_layout import V4
from sparsekv.testing.reference.hisparse import token_bytes, write_token


@dataclass
class SwapInWorld:
    """One layer's caches and the per-request tables of the swap-in (all on the CPU).

    ``device_buffer_locs[r, c]`` is the device slot of column ``c`` of request row ``r`` (distinct
    across the world); ``host_cache_locs[r, p]`` the host slot of position ``p`` (distinct too).
    """

    num_top_k: int
    hot: int
    page_slots: int | None  # None: generic rows; else slots per DSV4 C4 page
    item_size_bytes: int
    host_cache: torch.Tensor
    device_buffer: torch.Tensor
    host_cache_locs: torch.Tensor
    device_buffer_locs: torch.Tensor
    device_buffer_tokens: torch.Tensor
    lru_slots: torch.Tensor
    backend: str = "cpu"  # where swap_in runs the kernel (the world's tensors stay on the CPU)
    #: When set (:meth:`use_resident_index`), swap_in runs the indexed kernel on it.
    resident_index: object = None
    #: The swap-in's replacement policy (``policy=`` of the wrapper): a name or ``(protect_recent, protect_near)``.
    policy: object = "lru"
    #: GPU threads per request (``block_size=`` of the wrapper); None: the default for ``num_top_k``.
    block_size: int | None = None

    @property
    def is_dsv4_layout(self) -> bool:
        return self.page_slots is not None

    @property
    def max_reqs(self) -> int:
        return self.host_cache_locs.shape[0]

    @property
    def max_len(self) -> int:
        return self.host_cache_locs.shape[1]

    def host_token(self, rid: int, token: int, host_cache: torch.Tensor | None = None) -> torch.Tensor:
        """The host bytes of position ``token`` of request row ``rid``."""
        cache = self.host_cache if host_cache is None else host_cache
        return token_bytes(cache, int(self.host_cache_locs[rid, token]), page_slots=self.page_slots)

    def device_token(self, loc: int, device_buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The bytes at device slot ``loc``."""
        cache = self.device_buffer if device_buffer is None else device_buffer
        return token_bytes(cache, loc, page_slots=self.page_slots)

    def place(self, rid: int, column: int, token: int, *, host_cache: torch.Tensor | None = None,
              device_buffer: torch.Tensor | None = None) -> None:
        """Write token ``token``'s bytes into the device slot of column ``column`` (what the model does
        when it produces a token: into its own slot while ``pos < H``, else into the reserved column H)."""
        loc = int(self.device_buffer_locs[rid, column])
        cache = self.device_buffer if device_buffer is None else device_buffer
        write_token(cache, loc, self.host_token(rid, token, host_cache), page_slots=self.page_slots)

    def call_args(self, top_k: list[list[int]], rids: list[int], seq_lens: list[int], /, **overrides) -> dict:
        """The public swap-in's arguments for a call on this world's tables (int32 rows and lengths, an
        output pre-filled with 7), ``overrides`` replacing any of them: for bad-input tests that call
        the wrapper themselves."""
        return dict(top_k_tokens=torch.tensor(top_k, dtype=torch.int32).reshape(len(rids), self.num_top_k),
                    device_buffer_tokens=self.device_buffer_tokens, host_cache_locs=self.host_cache_locs,
                    device_buffer_locs=self.device_buffer_locs, host_cache=self.host_cache,
                    device_buffer=self.device_buffer,
                    top_k_device_locs=torch.full((len(rids), self.num_top_k), 7, dtype=torch.int32),
                    req_pool_indices=torch.tensor(rids, dtype=torch.int32),
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32), lru_slots=self.lru_slots,
                    item_size_bytes=self.item_size_bytes, num_top_k=self.num_top_k, hot_buffer_size=self.hot) \
            | overrides

    def swap_in(self, top_k: list[list[int]], rids: list[int], seq_lens: list[int], *,
                num_real_reqs: int | None = None, plan: bool = False, miss_dst_dtype: torch.dtype = torch.int64,
                counters: torch.Tensor | None = None, index_dtype: torch.dtype = torch.int32,
                speculative: bool = False) -> dict:
        """Run the kernel on this world's backend, in place; return its outputs.

        The output starts filled with a stale value, so an entry the kernel forgets shows up. On a
        non-cpu backend the cpu build runs first on copies and must agree on every tensor
        (:func:`~sparsekv.testing.backends.run_on_backend`).
        """
        from sparsekv.jit_kernel.hisparse import load_cache_to_device_buffer_dsv4_mla, load_cache_to_device_buffer_mla
        from sparsekv.testing.backends import run_on_backend

        bs = len(rids)
        out = torch.full((bs, self.num_top_k), 31337, dtype=torch.int32)
        extra = {}
        if plan:
            extra = dict(miss_src=torch.full((bs, self.num_top_k), -9, dtype=torch.int64),
                         miss_dst=torch.full((bs, self.num_top_k), -9, dtype=miss_dst_dtype),
                         miss_count=torch.full((bs,), -9, dtype=torch.int32))
        if num_real_reqs is not None:
            extra["num_real_reqs"] = torch.tensor([num_real_reqs], dtype=torch.int32)
        fn = load_cache_to_device_buffer_dsv4_mla if self.is_dsv4_layout else load_cache_to_device_buffer_mla
        if self.resident_index is not None:
            fn = _with_resident_index(fn)
            index = self.resident_index
            extra.update(slot_of=index.slot_of, queue=index.queue, queue_pos=index.queue_pos)
        layout = {"page_slots": self.page_slots} if self.is_dsv4_layout else {}
        tensors = dict(top_k_tokens=torch.tensor(top_k, dtype=torch.int32).reshape(bs, self.num_top_k),
                       device_buffer_tokens=self.device_buffer_tokens, host_cache_locs=self.host_cache_locs,
                       device_buffer_locs=self.device_buffer_locs, host_cache=self.host_cache,
                       device_buffer=self.device_buffer, top_k_device_locs=out,
                       req_pool_indices=torch.tensor(rids, dtype=index_dtype),
                       seq_lens=torch.tensor(seq_lens, dtype=index_dtype), lru_slots=self.lru_slots,
                       counters=counters, **extra)
        run_on_backend(self.backend, fn, tensors, item_size_bytes=self.item_size_bytes, num_top_k=self.num_top_k,
                       hot_buffer_size=self.hot, speculative=speculative, policy=self.policy,
                       block_size=self.block_size, **layout)
        return dict(out=out, **{k: v for k, v in extra.items() if k not in ("slot_of", "queue", "queue_pos")})

    def reference(self, top_k: list[list[int]], rids: list[int], seq_lens: list[int], *,
                  num_real_reqs: int | None = None):
        """The torch reference's expected state for the same call (this world is not modified); its
        ``lru_slots`` is what :meth:`lru_order` must give afterwards, for either kernel."""
        from sparsekv.jit_kernel.hisparse import policy_protections
        from sparsekv.testing.reference.hisparse import load_cache_to_device_buffer_reference

        bs = len(rids)
        lru = torch.tensor([self.lru_order(r) for r in range(self.max_reqs)], dtype=torch.int16)
        protect_recent, protect_near = policy_protections(self.policy)
        return load_cache_to_device_buffer_reference(
            torch.tensor(top_k, dtype=torch.int32).reshape(bs, self.num_top_k), self.device_buffer_tokens,
            self.host_cache_locs, self.device_buffer_locs, self.host_cache, self.device_buffer,
            torch.tensor(rids), torch.tensor(seq_lens), lru, self.item_size_bytes, self.hot,
            num_real_reqs=num_real_reqs, page_slots=self.page_slots, protect_recent=protect_recent,
            protect_near=protect_near)

    def reset_request(self, rid: int, *, resident: bool) -> None:
        """Fresh tables for row ``rid``: slot i holds position i (``resident``) or nothing; LRU 0..H-1."""
        self.device_buffer_tokens[rid] = -1
        if resident:
            self.device_buffer_tokens[rid, : self.hot] = torch.arange(self.hot, dtype=torch.int32)
        self.lru_slots[rid] = torch.arange(self.hot, dtype=torch.int16)
        if self.resident_index is not None:
            self.resident_index.rebuild_rows([rid], self.device_buffer_tokens, self.lru_slots)

    def use_resident_index(self) -> None:
        """From now on swap_in runs the indexed kernel, on an index built from the current tables."""
        from sparsekv.jit_kernel.hisparse_index import ResidentIndex

        self.resident_index = ResidentIndex.build(self.device_buffer_tokens, self.lru_slots, self.max_len)

    def lru_order(self, rid: int) -> list[int]:
        """Row ``rid``'s LRU order: ``lru_slots`` for the scanning kernel, the index's queue for the indexed one."""
        if self.resident_index is None:
            return self.lru_slots[rid].tolist()
        return self.resident_index.lru_order(rid)


def _with_resident_index(fn):
    """``fn`` taking the index's three tables as tensors (so run_on_backend moves and compares them)."""
    from sparsekv.jit_kernel.hisparse_index import ResidentIndex

    def call(*, slot_of, queue, queue_pos, **kwargs):
        fn(**kwargs, resident_index=ResidentIndex(slot_of=slot_of, queue=queue, queue_pos=queue_pos))

    return call


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic random uint8 tensor."""
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def make_world(num_top_k: int, hot: int, *, is_dsv4_layout: bool, max_reqs: int, max_len: int, seed: int,
               item_size_bytes: int = 12, columns: int | None = None, page_slots: int = 64,
               backend: str = "cpu") -> SwapInWorld:
    """Build a :class:`SwapInWorld` with shuffled, distinct host and device slots.

    ``columns`` is the width of the buffer tables (``H + page_slots`` for DSV4, default ``H + 2``
    otherwise); ``page_slots`` is the DSV4 C4 page's slot count (ignored for the generic layout);
    ``backend`` is where :meth:`SwapInWorld.swap_in` runs the kernel.
    """
    gen = torch.Generator().manual_seed(seed)
    if is_dsv4_layout:
        item_size_bytes = V4.bytes_per_token
        columns = hot + page_slots
    elif columns is None:
        columns = hot + 2
    host_slots = max_reqs * max_len + 3
    device_slots = max_reqs * columns + 5
    if is_dsv4_layout:
        page_bytes = V4.page_bytes(page_slots)
        host_cache = random_bytes((-(-host_slots // page_slots), page_bytes), seed + 1)
        device_buffer = random_bytes((-(-device_slots // page_slots), page_bytes), seed + 2)
    else:
        host_cache = random_bytes((host_slots, item_size_bytes), seed + 1)
        device_buffer = random_bytes((device_slots, item_size_bytes), seed + 2)
    host_locs = torch.randperm(host_slots, generator=gen)[: max_reqs * max_len].reshape(max_reqs, max_len)
    device_locs = torch.randperm(device_slots, generator=gen)[: max_reqs * columns].reshape(max_reqs, columns)
    world = SwapInWorld(
        num_top_k=num_top_k, hot=hot, page_slots=page_slots if is_dsv4_layout else None,
        item_size_bytes=item_size_bytes,
        host_cache=host_cache, device_buffer=device_buffer, host_cache_locs=host_locs.to(torch.int64).contiguous(),
        device_buffer_locs=device_locs.to(torch.int32).contiguous(),
        device_buffer_tokens=torch.full((max_reqs, columns), -1, dtype=torch.int32),
        lru_slots=torch.zeros((max_reqs, hot), dtype=torch.int16), backend=backend,
    )
    for rid in range(max_reqs):
        world.reset_request(rid, resident=False)
    return world


@st.composite
def top_k_row(draw, num_top_k: int, seq_len: int, held: list[int]) -> list[int]:
    """One step's top-k for a request of length ``seq_len`` whose hot slots hold ``held``.

    Mostly distinct valid positions with a tunable share of hot ones; sometimes the newest token,
    repeats, -1 padding or positions at or beyond ``seq_len`` (which mean "no token").
    """
    hot_tokens = sorted({t for t in held if 0 <= t < seq_len})
    choices = [st.integers(0, max(seq_len - 1, 0))]
    if hot_tokens:
        choices.append(st.sampled_from(hot_tokens))
    if seq_len > 0:
        choices.append(st.just(seq_len - 1))
    valid = st.one_of(*choices)
    special = st.sampled_from([-1, -7, seq_len, seq_len + 3, 2**31 - 1])
    entry = st.one_of(valid, valid, valid, special) if draw(st.booleans()) else valid
    unique = draw(st.booleans())
    return draw(st.lists(entry, min_size=num_top_k, max_size=num_top_k, unique=unique and seq_len > 3 * num_top_k))

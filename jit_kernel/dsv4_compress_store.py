"""The DSV4 compressor fused with the store (kernel in ``csrc/dsv4_compress_store.cuh``).

Each entry is pooled (:mod:`~sparsekv.jit_kernel.dsv4_compress`) and, in the same pass, normalized,
rotated, quantized and stored into its paged cache slot (:mod:`~sparsekv.jit_kernel.dsv4_store`,
:class:`~sparsekv.jit_kernel.dsv4_store.StoreTarget`); no float entry goes through memory. The
stored bytes equal those of the compressor followed by :func:`~sparsekv.jit_kernel.dsv4_store.norm_rope_store`.

Two steps, on the compressor's raw state ring:

* :func:`compress_store_step`: a streaming step over planned event and ring-write tables
  (:class:`~sparsekv.srt.mem_cache.compressor_state.CompressorState` plans them:
  ``CompressorState.extend(..., store=...)`` is the public entry);
* :func:`compress_decode_step`: one decode step of a batch planned on the device, fused with the
  store when given one (without, it is the compressor's own
  :func:`~sparsekv.jit_kernel.dsv4_compress.compress_decode`).
"""

from __future__ import annotations

import torch

from sparsekv.checks import as_int, one_of
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.dsv4_compress import RATIOS, check_decode_on_cuda, check_ratio, compress_decode, decode_outputs
from sparsekv.jit_kernel.dsv4_quant import check_device_slots
from sparsekv.jit_kernel.dsv4_store import CACHE_KINDS, StoreTarget, dsv4_store_instance
from sparsekv.jit_kernel.torch_op import kernel_op
from sparsekv.jit_kernel.triton import IMPLS, resolve_impl

DSV4_COMPRESS_STORE = register(
    KernelFamily(
        name="dsv4_compress_store",
        header="dsv4_compress_store.cuh",
        exports={
            "compress_store": "sparsekv::dsv4_compress_store::compress_store",
            "compress_decode_store": "sparsekv::dsv4_compress_store::compress_decode_store",
        },
        kernels=(
            "sparsekv::dsv4_compress_store::CompressStore",
            "sparsekv::dsv4_compress_store::StoreRingWrite",
        ),
        params=("cache_kind",),
        complete=dsv4_store_instance,
        instances=tuple({"cache_kind": kind} for kind in CACHE_KINDS),
    )
)


def compress_store_step(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                        sources: torch.Tensor, writes: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        target: StoreTarget, *, impl: str = "auto") -> None:
    """One fused streaming step: pool + norm + RoPE + quantize + store every planned event, then the ring writes.

    Parameters
    ----------
    kv, score, ape, ratio, state, sources, writes
        As :func:`~sparsekv.jit_kernel.dsv4_compress.compress_extend` (the planned tables of
        :class:`~sparsekv.srt.mem_cache.compressor_state.CompressorState`, which is the public entry).
    positions : torch.Tensor
        int64 ``[E]``: each event's RoPE position (its anchor).
    slots : torch.Tensor
        int64 ``[E]``, unique: each event's slot in ``target.cache``.
    target : StoreTarget
        The cache and the store's parameters.
    impl : {"auto", "header", "triton"}
        ``"header"``: ``csrc/dsv4_compress_store.cuh``; ``"triton"``: the Triton twin
        (:mod:`sparsekv.jit_kernel.triton.dsv4_compress_store`), on a GPU or, on
        CPU tensors, under ``TRITON_INTERPRET=1``; ``"auto"``: the header.

    Raises
    ------
    TypeError, ValueError, IndexError
        As ``compress_extend`` and :func:`~sparsekv.jit_kernel.dsv4_store.norm_rope_store`; nothing is written.
    """
    impl = resolve_impl(impl, kv)
    _compress_store(kv, score, ape, ratio, state, sources, writes, target.weight, target.eps, positions,
                    target.cache, slots, target.page_slots, target.rope.cos, target.rope.sin, target.cache_kind, impl)


@kernel_op("compress_store", mutates_args=("state", "cache"))
def _compress_store(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                    sources: torch.Tensor, writes: torch.Tensor, weight: torch.Tensor, eps: float,
                    positions: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, page_slots: int,
                    rope_cos: torch.Tensor, rope_sin: torch.Tensor, cache_kind: str, impl: str) -> None:
    dsv4_store_instance(cache_kind)
    check_device_slots(slots, cache, page_slots, unique=True)
    if impl == "triton":
        from sparsekv.jit_kernel.triton import dsv4_compress_store as triton_compress_store

        triton_compress_store.compress_store(kv, score, ape, ratio, state, sources, writes, weight, eps, positions,
                                             cache, slots, page_slots, rope_cos, rope_sin, cache_kind)
        return
    module = DSV4_COMPRESS_STORE.module_for(kv, cache_kind)
    module.compress_store(kv, score, ape, ratio, state, sources, writes, weight, eps, positions, cache, slots,
                          page_slots, rope_cos, rope_sin, torch.get_num_threads())


def compress_decode_step(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                         state_rows: torch.Tensor, positions: torch.Tensor, *, store: StoreTarget | None = None,
                         entry_slots: torch.Tensor | None = None, out: torch.Tensor | None = None,
                         emitted: torch.Tensor | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a batch on the compressor's raw ring, planned on the device, optionally fused with the store.

    Row ``b`` brings one new token at ``positions[b]``; its kv and score go into ring row
    ``state_rows[b, W - 1]``. When the token completes an entry (``(positions[b] + 1) % ratio == 0``),
    the entry is pooled from the ``W`` window positions ending at it (``state_rows[b]``, then the new
    token), exactly as :meth:`~sparsekv.srt.mem_cache.compressor_state.CompressorState.extend` pools
    it. No host sync, no Python loop over rows; given ``out`` and ``emitted`` a call allocates
    nothing (CUDA-graph capturable).

    Parameters
    ----------
    kv, score : torch.Tensor
        float32 ``[B, coff * d]`` (coff = 2 for ratio 4, 1 for ratio 128), unit last stride: each row's new token.
    ape : torch.Tensor
        float32 ``[ratio, coff * d]``, contiguous.
    ratio : int
        4 or 128.
    state : torch.Tensor
        float32 or bfloat16 ``[rows, 2 * coff * d]``: the raw ring (the layout of ``CompressorState``).
    state_rows : torch.Tensor
        int32 or int64 ``[B, W]`` (W = 8 for ratio 4, 128 for ratio 128), unit last stride, on the
        device: the state rows of each row's last W positions, the new token's last (a scheduler's
        slot mapping). Rows of positions before 0 are not read.
    positions : torch.Tensor
        int64 ``[B]``, contiguous, on the device: the new tokens' positions.
    store : StoreTarget, optional
        Also normalize, rotate, quantize and store each completed entry into ``store.cache`` at
        ``entry_slots[b]`` (RoPE position: the entry's anchor ``positions[b] - ratio + 1``).
    entry_slots : torch.Tensor, optional
        int64 ``[B]``, with ``store`` only: each row's entry slot in ``store.cache`` (read for rows
        that complete an entry; for a pool, ``out_cache_loc // ratio``).
    out : torch.Tensor, optional
        float32 ``[B, d]``, contiguous, to write (default: a new tensor).
    emitted : torch.Tensor, optional
        bool ``[B]``, contiguous, to write (default: a new tensor).
    impl : {"auto", "header", "triton"}
        With ``store``: ``"header"`` runs ``csrc/dsv4_compress_store.cuh``; ``"triton"`` the Triton twin
        (:mod:`sparsekv.jit_kernel.triton.dsv4_compress_store`), on a GPU or, on
        CPU tensors, under ``TRITON_INTERPRET=1``; ``"auto"``: the header. Without ``store``, the header.

    Returns
    -------
    entries : torch.Tensor
        float32 ``[B, d]``: row ``b``'s completed entry, zeros where none.
    emitted : torch.Tensor
        bool ``[B]``: whether row ``b``'s token completed an entry.

    Raises
    ------
    TypeError, ValueError
        Wrong dtype, shape or device (the message names the argument); ``ratio`` not 4 or 128;
        ``store`` without ``entry_slots``; two rows writing one ring row (host-readable tables).
    IndexError
        A negative position, a ring row outside ``state``, or a stored slot outside the cache
        (host-readable tables; on the GPU the kernel skips them). Nothing is written when anything is raised.
    """
    ratio = as_int(ratio, "ratio")
    if impl not in IMPLS:  # also where the header runs regardless (no store)
        one_of(impl, "impl", IMPLS)
    out, emitted = decode_outputs(kv, ratio, out, emitted)
    if store is None and entry_slots is None:
        return compress_decode(kv, score, ape, ratio, state, state_rows, positions, out=out, emitted=emitted)
    if ratio not in RATIOS:
        check_ratio(ratio)
    if store is None or entry_slots is None:
        raise ValueError("sparsekv: arguments `store` and `entry_slots` go together: pass both or neither")
    impl = resolve_impl(impl, kv)
    _compress_decode_store(kv, score, ape, ratio, state, state_rows, positions, out, emitted, store.weight, store.eps,
                           store.cache, entry_slots, store.page_slots, store.rope.cos, store.rope.sin,
                           store.cache_kind, impl)
    return out, emitted


@kernel_op("compress_decode_store", mutates_args=("state", "out", "emitted", "cache"))
def _compress_decode_store(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                           state_rows: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                           emitted: torch.Tensor, weight: torch.Tensor, eps: float, cache: torch.Tensor,
                           slots: torch.Tensor, page_slots: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                           cache_kind: str, impl: str) -> None:
    dsv4_store_instance(cache_kind)
    check_decode_on_cuda(state_rows, positions, state)
    if impl == "triton":
        from sparsekv.jit_kernel.triton import dsv4_compress_store as triton_compress_store

        triton_compress_store.compress_decode_store(kv, score, ape, ratio, state, state_rows, positions, out, emitted,
                                                    weight, eps, cache, slots, page_slots, rope_cos, rope_sin,
                                                    cache_kind)
        return
    module = DSV4_COMPRESS_STORE.module_for(kv, cache_kind)
    module.compress_decode_store(kv, score, ape, ratio, state, state_rows, positions, out, emitted, weight, eps, cache,
                                 slots, page_slots, rope_cos, rope_sin)

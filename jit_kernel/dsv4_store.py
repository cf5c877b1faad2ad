"""Fused RMSNorm + RoPE (+ Walsh-Hadamard) + quantize + paged store of DSV4 entries (kernel in ``csrc/dsv4_store.cuh``).

Main cache: 512-wide rows into the 584-byte ``fp8_ds_mla`` (V4) layout. Indexer cache: 128-wide
rows, rotated by the 128-point Walsh-Hadamard matrix over sqrt(128), into ``INDEXER_FP8`` (132 B, one
fp32 scale ``max(amax, 1e-4) / 448``) or ``INDEXER_FP4`` (68 B, a UE8M0 scale per 32 values).
RoPE comes from the model's float32 cos/sin table (:class:`RopeTable`, built by
:meth:`RopeParams.table` the way the model builds it), so stored keys rotate by exactly the angles
the model applies to its queries; the RoPE/YaRN parameters are explicit (published configs disagree
on the compressed layers' theta).

Every float32 step is rounded as written, identically on the cpu, sim and cuda builds: the norm's
``1 / sqrt(ms + eps)`` is a correctly rounded sqrt then a true division (not an rsqrt), the FP8
scale ``amax / 448`` and the codes ``e4m3(x / scale)`` are true divisions (not multiplies by a
rounded reciprocal). :mod:`sparsekv.testing.reference.dsv4_store` is the byte oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsekv.checks import as_float, as_int
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.dsv4_quant import check_device_slots
from sparsekv.jit_kernel.torch_op import kernel_op
from sparsekv.jit_kernel.triton import resolve_impl
from sparsekv.rope import RopeTable

CACHE_KINDS = {
    "V4": "sparsekv::dsv4_store::V4",
    "INDEXER_FP8": "sparsekv::dsv4_store::IndexerFp8",
    "INDEXER_FP4": "sparsekv::dsv4_store::IndexerFp4",
}


def dsv4_store_instance(cache_kind: str) -> tuple[str]:
    """Template arguments of a cache kind's instance (``complete`` of the ``dsv4_store`` and ``dsv4_compress_store``
    families).

    Raises
    ------
    ValueError
        ``cache_kind`` is not one of ``V4``, ``INDEXER_FP8``, ``INDEXER_FP4``.
    """
    if cache_kind not in CACHE_KINDS:
        raise ValueError(f"sparsekv: argument `cache_kind` must be one of {sorted(CACHE_KINDS)}, got {cache_kind!r}")
    return (CACHE_KINDS[cache_kind],)


DSV4_STORE = register(
    KernelFamily(
        name="dsv4_store",
        header="dsv4_store.cuh",
        exports={
            "norm_rope_store": "sparsekv::dsv4_store::norm_rope_store",
        },
        kernels=("sparsekv::dsv4_store::NormRopeStore",),
        params=("cache_kind",),
        complete=dsv4_store_instance,
        instances=tuple({"cache_kind": kind} for kind in CACHE_KINDS),
    )
)


def _positive_eps(value: object, name: str) -> float:
    """An RMSNorm epsilon: a finite real number above 0 (``inf`` made every output 0, a NaN every
    output NaN, and 0 divides by zero on an all-zero row).

    Raises
    ------
    TypeError
        Not a real number.
    ValueError
        Not finite, or not above 0.
    """
    eps = as_float(value, name, finite=True)
    if not eps > 0:
        raise ValueError(f"sparsekv: argument `{name}` must be a finite number above 0, got {eps}")
    return eps


@renamed_keywords(page_size="page_slots")
def norm_rope_store(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                    cache: torch.Tensor, slots: torch.Tensor, page_slots: int, rope: RopeTable,
                    cache_kind: str = "V4", *, impl: str = "auto") -> None:
    """Normalize, rotate and quantize entries straight into a paged cache, in place.

    Parameters
    ----------
    x : torch.Tensor
        float32 ``[N, D]`` (D = 512 for ``V4``, 128 for the indexer kinds), e.g. the compressor output.
    weight : torch.Tensor
        float32 ``[D]`` RMSNorm weight.
    eps : float
        RMSNorm epsilon: finite, above 0.
    positions : torch.Tensor
        int64 ``[N]`` RoPE positions (a compressed entry's anchor ``m * i``), in
        ``[0, rope.max_position)`` (an entry outside is not stored on the device; host-readable
        positions are checked).
    cache : torch.Tensor
        uint8 ``[pages, layout.page_bytes(page_slots)]`` (a pool's page buffer).
    slots : torch.Tensor
        int64 ``[N]``, unique token slots.
    page_slots : int
        Slots per page, a power of two.
    rope : RopeTable
        The model's float32 cos/sin table (``RopeParams(...).table(max_position, device)``).
    cache_kind : str
        ``"V4"``, ``"INDEXER_FP8"`` or ``"INDEXER_FP4"``.
    impl : {"auto", "header", "triton"}
        ``"header"``: the ``csrc/dsv4_store.cuh`` kernel on the cpu or cuda backend by device;
        ``"triton"``: the twin in :mod:`sparsekv.jit_kernel.triton.dsv4_store` (32-bit packed
        stores), on a GPU or, on CPU tensors, under ``TRITON_INTERPRET=1``; ``"auto"``: the header
        (memory-bound, not yet timed against its twin on a GPU). Same bytes, same refusals, same op.

    Raises
    ------
    TypeError
        A wrong dtype, or a scalar of the wrong type (named).
    ValueError
        A wrong shape, page size or RoPE table, a duplicated slot, or a written ``cache`` that
        shares memory with another argument.
    IndexError
        A slot outside the cache, a position outside the RoPE table. Nothing is written when
        anything is raised.
    """
    if not (type(eps) is float and 0.0 < eps < math.inf):  # noqa: E721 - the decode path's case passes as is
        eps = _positive_eps(eps, "eps")
    page_slots = as_int(page_slots, "page_slots")
    if not isinstance(rope, RopeTable):
        raise TypeError(f"sparsekv: argument `rope` must be a RopeTable (RopeParams(...).table(max_position)), got "
                        f"{type(rope).__name__}")
    _norm_rope_store(x, weight, eps, positions, cache, slots, page_slots, rope.cos, rope.sin, cache_kind,
                     resolve_impl(impl, cache))


@kernel_op("norm_rope_store", mutates_args=("cache",))
def _norm_rope_store(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, cache: torch.Tensor,
                     slots: torch.Tensor, page_slots: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                     cache_kind: str, impl: str) -> None:
    if impl == "triton":
        dsv4_store_instance(cache_kind)  # the kind is named first, as the header path's module lookup does
        check_device_slots(slots, cache, page_slots, unique=True)
        from sparsekv.jit_kernel.triton import dsv4_store as triton_store

        triton_store.norm_rope_store(x, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin,
                                     cache_kind)
        return
    module = DSV4_STORE.module_for(cache, cache_kind)
    check_device_slots(slots, cache, page_slots, unique=True)
    module.norm_rope_store(x, weight, eps, positions, cache, slots, page_slots, rope_cos, rope_sin)


@dataclass(frozen=True)
class StoreTarget:
    """Where and how the fused compress-store (:mod:`~sparsekv.jit_kernel.dsv4_compress_store`, through
    :meth:`~sparsekv.srt.mem_cache.compressor_state.CompressorState.extend` or ``compress_decode_step``)
    stores entries: the arguments of :func:`norm_rope_store` other than the entries themselves.

    Attributes
    ----------
    cache : torch.Tensor
        uint8 page buffer (e.g. ``pool.get_compressed_kv_buffer(layer_id)`` or ``get_indexer_buffer``).
    weight : torch.Tensor
        float32 ``[D]`` RMSNorm weight.
    eps : float
        RMSNorm epsilon: finite, above 0.
    page_slots : int
        Slots per page of ``cache``; formerly ``page_size=``, which still works for one release (with a
        ``DeprecationWarning``).
    rope : RopeTable
        The model's float32 cos/sin table.
    cache_kind : str
        ``"V4"``, ``"INDEXER_FP8"`` or ``"INDEXER_FP4"``.
    """

    cache: torch.Tensor
    weight: torch.Tensor
    eps: float
    page_slots: int
    rope: RopeTable
    cache_kind: str = "V4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", _positive_eps(self.eps, "store.eps"))
        object.__setattr__(self, "page_slots", as_int(self.page_slots, "store.page_slots"))
        if not isinstance(self.rope, RopeTable):
            raise TypeError(f"sparsekv: argument `store.rope` must be a RopeTable (RopeParams(...).table(n)), "
                            f"got {type(self.rope).__name__}")


# ``page_size=`` was the field's name before ``page_slots`` (slots per page, as every kernel calls it):
# the dataclass's generated __init__ takes the old keyword for one release.
StoreTarget.__init__ = renamed_keywords(page_size="page_slots")(StoreTarget.__init__)

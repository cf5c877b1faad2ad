"""DSV4 FP8 token quantizer and dequantizer for the 584-byte ``fp8_ds_mla`` layout (kernel in ``csrc/dsv4_quant.cuh``).

Layout and rounding (also the contract of the torch oracle
:mod:`sparsekv.testing.reference.dsv4_quant`): dims 0-447 in 7 blocks of 64, each with the
power-of-two scale ``2^e``, ``e`` the smallest integer with ``448 * 2^e >= max(amax, 1e-4)``; value
bytes are the e4m3 round-to-nearest-even codes of ``x / 2^e``, scale bytes ``e + 127``; dims 448-511
are bf16. A page of ``page_slots`` slots stores all value records (576 B) first, then all scale
records (8 B), padded to a multiple of 576 B.

:func:`quantize_indexer_keys` writes 128-wide indexer keys as given (no norm, no RoPE, no
Hadamard) into the indexer cache layouts that :func:`~sparsekv.jit_kernel.dsv4_indexer.indexer_scores`
reads: ``"fp8"`` (132 B: 128 e4m3 codes of ``x / s`` and the fp32 scale ``s = max(amax, 1e-4) / 448``)
or ``"fp4"`` (68 B: e2m1 codes, two per byte with the even element in the low nibble, and a UE8M0
scale per 32 values, the smallest power of two that brings the block's amax within 6).
"""

from __future__ import annotations

import torch

from sparsekv.checks import as_int, named_as
from sparsekv.deprecation import renamed_keywords
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.torch_op import first_true, index_checks_on_device, kernel_op, rows_of
from sparsekv.jit_kernel.triton import resolve_impl

DSV4_QUANT = register(
    KernelFamily(
        name="dsv4_quant",
        header="dsv4_quant.cuh",
        exports={
            "quantize_fp8_ds_mla": "sparsekv::dsv4_quant::quantize_fp8_ds_mla",
            "dequantize_fp8_ds_mla": "sparsekv::dsv4_quant::dequantize_fp8_ds_mla",
            "quantize_indexer_fp8": "sparsekv::dsv4_quant::quantize_indexer_fp8",
            "quantize_indexer_fp4": "sparsekv::dsv4_quant::quantize_indexer_fp4",
        },
        kernels=(
            "sparsekv::dsv4_quant::QuantizeFp8DsMla<float>",
            "sparsekv::dsv4_quant::QuantizeFp8DsMla<uint16_t>",
            "sparsekv::dsv4_quant::DequantizeFp8DsMla",
            "sparsekv::dsv4_quant::QuantizeRows<sparsekv::dsv4_quant::IndexerFp8, float>",
            "sparsekv::dsv4_quant::QuantizeRows<sparsekv::dsv4_quant::IndexerFp8, uint16_t>",
            "sparsekv::dsv4_quant::QuantizeRows<sparsekv::dsv4_quant::IndexerFp4, float>",
            "sparsekv::dsv4_quant::QuantizeRows<sparsekv::dsv4_quant::IndexerFp4, uint16_t>",
        ),
    )
)


def check_device_slots(slots: torch.Tensor, cache: torch.Tensor, page_slots: int, unique: bool) -> None:
    """With ``SPARSEKV_CHECK_INDICES=1``: validate CUDA-resident slots of a 2-D paged ``cache`` of
    ``page_slots`` slots a page with torch (synchronizes).

    Host-resident slots are always validated by the kernel's host entry instead (nothing is read
    then: the decode path's case).

    Raises
    ------
    IndexError
        A slot outside ``[0, num_slots)``.
    ValueError
        A repeated slot (when ``unique``).
    """
    if not index_checks_on_device(slots) or slots.dim() != 1 or slots.numel() == 0:
        return
    num_slots = rows_of(cache, 2) * page_slots
    bad = first_true((slots < 0) | (slots >= num_slots))
    if bad is not None:
        (i,) = bad
        raise IndexError(f"sparsekv: argument `slots`[{i}] = {int(slots[i])} is out of range [0, {num_slots})")
    if unique and torch.unique(slots).numel() != slots.numel():
        raise ValueError("sparsekv: argument `slots` names a slot twice; slots must be unique")


@renamed_keywords(page_size="page_slots")
def quantize_fp8_ds_mla(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, page_slots: int, *,
                        impl: str = "auto") -> None:
    """Quantize 512-wide rows into token slots of a paged ``fp8_ds_mla`` (V4, 584 B) cache, in place.

    Parameters
    ----------
    x : torch.Tensor
        float32 or bfloat16 ``[N, 512]``, unit last stride. A float32 row is quantized from its own
        values (not rounded to bf16 first).
    cache : torch.Tensor
        uint8 ``[pages, V4.page_bytes(page_slots)]``, unit last stride, same device as ``x``.
    slots : torch.Tensor
        int64 ``[N]``, contiguous, unique, in ``[0, pages * page_slots)``.
    page_slots : int
        Slots per page, a power of two in ``[1, 2^20]``.
    impl : {"auto", "header", "triton"}
        ``"header"``: the ``csrc/dsv4_quant.cuh`` kernel on the cpu or cuda backend by device;
        ``"triton"``: the twin in :mod:`sparsekv.jit_kernel.triton.dsv4_quant` (32-bit packed stores),
        on a GPU or, on CPU tensors, under ``TRITON_INTERPRET=1``; ``"auto"``: the header (a
        memory-bound kernel that is not yet timed against its twin on a GPU). Same bytes, same
        refusals, same custom op.

    Raises
    ------
    TypeError
        A wrong dtype, or a ``page_slots`` that is not an int (the message names the argument).
    ValueError
        A wrong shape, stride, device or page size, a duplicated slot, or two arguments sharing
        memory (or a ``cache`` whose elements overlap, e.g. an ``expand``); an unknown ``impl``.
    IndexError
        A slot outside the cache.

    Nothing is written when an exception is raised (slots on a CUDA device are not read by the
    host; the kernel skips out-of-range ones). Bytes outside the written slots never change.
    """
    page_slots = as_int(page_slots, "page_slots")
    _quantize(x, cache, slots, page_slots, resolve_impl(impl, cache))


@kernel_op("quantize_fp8_ds_mla", mutates_args=("cache",))
def _quantize(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, page_slots: int, impl: str) -> None:
    check_device_slots(slots, cache, page_slots, unique=True)
    if impl == "triton":
        from sparsekv.jit_kernel.triton import dsv4_quant as triton_quant

        triton_quant.quantize_fp8_ds_mla(x, cache, slots, page_slots)
        return
    DSV4_QUANT.module_for(cache).quantize_fp8_ds_mla(x, cache, slots, page_slots)


@renamed_keywords(page_size="page_slots")
def dequantize_fp8_ds_mla(cache: torch.Tensor, slots: torch.Tensor, page_slots: int, *,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """The values stored in token slots of a paged ``fp8_ds_mla`` cache.

    Parameters
    ----------
    cache : torch.Tensor
        uint8 ``[pages, V4.page_bytes(page_slots)]``.
    slots : torch.Tensor
        int64 ``[N]`` in ``[0, pages * page_slots)`` (repeats allowed).
    page_slots : int
        Slots per page, a power of two.
    out : torch.Tensor, optional
        float32 ``[N, 512]``, contiguous, to write (default: a new tensor).

    Returns
    -------
    torch.Tensor
        ``out``, float32 ``[N, 512]``: ``e4m3 * 2^(scale_byte - 127)`` for dims 0-447, the bf16 values
        for dims 448-511.

    Raises
    ------
    TypeError, ValueError, IndexError
        As :func:`quantize_fp8_ds_mla`.
    """
    if out is None:
        out = torch.empty(rows_of(slots, 1), 512, dtype=torch.float32, device=cache.device)
    _dequantize(cache, slots, as_int(page_slots, "page_slots"), out)
    return out


@kernel_op("dequantize_fp8_ds_mla", mutates_args=("out",))
def _dequantize(cache: torch.Tensor, slots: torch.Tensor, page_slots: int, out: torch.Tensor) -> None:
    check_device_slots(slots, cache, page_slots, unique=False)
    DSV4_QUANT.module_for(cache).dequantize_fp8_ds_mla(cache, slots, page_slots, out)


#: Export of the indexer-key quantizer per indexer cache format (``indexer_scores``'s ``layout``).
INDEXER_QUANTIZERS = {"fp8": "quantize_indexer_fp8", "fp4": "quantize_indexer_fp4"}


@renamed_keywords(page_size="page_slots")
def quantize_indexer_keys(keys: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, *, page_slots: int,
                          fmt: str = "fp8") -> None:
    """Quantize plain 128-wide indexer keys into token slots of a paged indexer cache, in place.

    The keys are stored as given: no RMSNorm, RoPE or Hadamard rotation (apply them first if the
    model does; :func:`~sparsekv.jit_kernel.dsv4_store.norm_rope_store` fuses them). The bytes are
    the ones the fused store writes for the same rows, read back by
    :func:`~sparsekv.jit_kernel.dsv4_indexer.indexer_scores` with ``layout=fmt``.

    Parameters
    ----------
    keys : torch.Tensor
        float32 or bfloat16 ``[N, 128]``, unit last stride. float32 keys are quantized from their
        own values (not rounded to bf16 first).
    cache : torch.Tensor
        uint8 ``[pages, layout.page_bytes(page_slots)]`` (``INDEXER_FP8`` or ``INDEXER_FP4`` of
        :mod:`sparsekv.kv_layout`), unit last stride, same device as ``keys``.
    slots : torch.Tensor
        int64 ``[N]``, contiguous, unique, in ``[0, pages * page_slots)``.
    page_slots : int
        Slots per page, a power of two the kernels serve.
    fmt : {"fp8", "fp4"}
        ``"fp8"``: 132 B per key (128 e4m3 + one fp32 scale ``max(amax, 1e-4) / 448``); ``"fp4"``:
        68 B per key (64 B of e2m1 pairs + 4 UE8M0 scale bytes, one per 32 values).

    Raises
    ------
    TypeError
        A wrong dtype, or a ``page_slots`` / ``fmt`` of the wrong type (the message names the argument).
    ValueError
        A wrong shape, stride, device, page size or ``fmt``, a duplicated slot, or two arguments
        sharing memory.
    IndexError
        A slot outside the cache.

    Nothing is written when an exception is raised (slots on a CUDA device are not read by the
    host; the kernel skips out-of-range ones). Bytes outside the written slots never change.
    """
    if not isinstance(fmt, str):
        raise TypeError(f"sparsekv: argument `fmt` must be a str, one of {sorted(INDEXER_QUANTIZERS)}, got "
                        f"{type(fmt).__name__}")
    if fmt not in INDEXER_QUANTIZERS:
        raise ValueError(f"sparsekv: argument `fmt` must be one of {sorted(INDEXER_QUANTIZERS)}, got {fmt!r}")
    with named_as(x="keys"):  # the entry's name for the keys
        _quantize_indexer(keys, cache, slots, as_int(page_slots, "page_slots"), fmt)


@kernel_op("quantize_indexer_keys", mutates_args=("cache",))
def _quantize_indexer(keys: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, page_slots: int, fmt: str) -> None:
    check_device_slots(slots, cache, page_slots, unique=True)
    module = DSV4_QUANT.module_for(cache)
    getattr(module, INDEXER_QUANTIZERS[fmt])(keys, cache, slots, page_slots)

"""Strided byte-row gather: ``dst[dst_indices[i]] = src[src_indices[i]]`` (kernel in ``csrc/gather_rows.cuh``)."""

from __future__ import annotations

import torch

from sparsekv.checks import one_of
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.torch_op import kernel_op

INDEX_TYPES = {torch.int32: "int32_t", torch.int64: "int64_t"}


def _complete(*, index_dtype: torch.dtype) -> tuple[str]:
    """Template arguments of ``GatherRows<Index>`` for an index dtype (int32 or int64)."""
    return (INDEX_TYPES[one_of(index_dtype, "index_dtype", INDEX_TYPES, owner="gather_rows")],)


GATHER_ROWS = register(
    KernelFamily(
        name="gather_rows",
        header="gather_rows.cuh",
        exports={"gather_rows": "sparsekv::gather_rows::gather_rows"},
        kernels=("sparsekv::gather_rows::GatherRows",),
        params=("index_dtype",),
        complete=_complete,
        instances=({"index_dtype": torch.int32}, {"index_dtype": torch.int64}),
    )
)


def gather_rows(
    dst: torch.Tensor, dst_indices: torch.Tensor, src: torch.Tensor, src_indices: torch.Tensor
) -> None:
    """Copy byte rows: ``dst[dst_indices[i], :] = src[src_indices[i], :]`` for every i, in place.

    Parameters
    ----------
    dst : torch.Tensor
        uint8 ``[dst_rows, row_bytes]``, unit last stride, any row stride. Written in place.
    dst_indices : torch.Tensor
        int32 or int64 ``[N]``, contiguous, same device as ``dst``.
    src : torch.Tensor
        uint8 ``[src_rows, row_bytes]``, unit last stride, any row stride.
    src_indices : torch.Tensor
        Same dtype and length as ``dst_indices``.

    Raises
    ------
    TypeError
        Wrong dtype (the message names the argument).
    ValueError
        Wrong shape, stride, length or device.
    IndexError
        An index outside its table (checked before any byte moves for host tensors).
    """
    _gather_rows(dst, dst_indices, src, src_indices)


@kernel_op("gather_rows", mutates_args=("dst",))
def _gather_rows(dst: torch.Tensor, dst_indices: torch.Tensor, src: torch.Tensor, src_indices: torch.Tensor) -> None:
    index_dtype = dst_indices.dtype
    if index_dtype not in INDEX_TYPES:
        raise TypeError(f"sparsekv: argument `dst_indices` must have dtype int32 or int64, got {index_dtype}")
    GATHER_ROWS.module_for(dst, index_dtype).gather_rows(dst, dst_indices, src, src_indices)

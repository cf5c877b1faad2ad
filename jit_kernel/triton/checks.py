"""The input contract of ``csrc/include/sparsekv/ffi.h``, in Python, for the Triton launchers.

A Triton kernel has no host entry of its own, so its launcher checks the arguments here before it
allocates or writes anything: the same conditions, exception types and messages as the header's
``check(t, name)...`` chain (``TypeError`` for a dtype, ``ValueError`` for a shape, stride or device,
``IndexError`` for an index), so both implementations refuse bad input alike. Scalar arguments
go through :mod:`sparsekv.checks`, the one range convention (closed bounds); ``page_shift``'s
``[1, 2^20]`` is closed as well.
"""

from __future__ import annotations

import torch

from sparsekv.checks import as_int
from sparsekv.kv_layout import C4_RATIO, MAX_PAGE_SLOTS

__all__ = ["Arg", "check", "check_disjoint", "check_no_overlap", "dtype_name", "optional_arg",
           "page_shift", "read", "row_stride", "visible_entries", "written"]

_DTYPE_NAMES = {
    torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16",
    torch.uint8: "uint8", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The DLPack-style name the header's messages use (``float32``, ``uint8``, ...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


class Arg:
    """Fluent checks on one tensor argument (mirrors ``sparsekv::Arg``); each returns ``self``."""

    def __init__(self, tensor: torch.Tensor, name: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"sparsekv: argument `{name}` must be a torch.Tensor, got {type(tensor).__name__}")
        self.t = tensor
        self.name = name

    def dtype(self, *want: torch.dtype) -> Arg:
        if self.t.dtype not in want:
            names = " or ".join(dtype_name(w) for w in want)
            raise TypeError(f"sparsekv: argument `{self.name}` must have dtype {names}, got {dtype_name(self.t.dtype)}")
        return self

    def ndim(self, want: int) -> Arg:
        if self.t.dim() != want:
            raise ValueError(f"sparsekv: argument `{self.name}` must be {want}-D, got shape {_shape(self.t)}")
        return self

    def size(self, dim: int, want: int, what: str | None = None) -> Arg:
        if self.t.shape[dim] != want:
            detail = f" ({what})" if what else ""
            raise ValueError(f"sparsekv: argument `{self.name}` must have size {want} in dim {dim}{detail}, got shape "
                             f"{_shape(self.t)}")
        return self

    def contiguous(self) -> Arg:
        if not self.t.is_contiguous():
            raise ValueError(f"sparsekv: argument `{self.name}` must be contiguous (shape {_shape(self.t)})")
        return self

    def rows_dense(self) -> Arg:
        if self.t.dim() > 0 and self.t.shape[-1] > 1 and self.t.stride(-1) != 1:
            raise ValueError(f"sparsekv: argument `{self.name}` must have a unit stride in its last dim")
        return self

    def word_aligned(self, nbytes: int) -> Arg:
        """The tensor and each of its rows start on an ``nbytes`` boundary: a kernel that reads
        ``nbytes``-byte words of a byte tensor would fault on a GPU otherwise."""
        rows = self.t.stride(0) * self.t.element_size() if self.t.dim() > 1 and self.t.shape[0] > 1 else 0
        if self.t.data_ptr() % nbytes or rows % nbytes:
            raise ValueError(f"sparsekv: argument `{self.name}` and its rows must start on a {nbytes}-byte boundary "
                             f"(the Triton kernel reads it in {nbytes}-byte words)")
        return self

    def same_device(self, other: torch.Tensor, other_name: str) -> Arg:
        if self.t.device != other.device:
            raise ValueError(f"sparsekv: argument `{self.name}` and `{other_name}` must be on the same device")
        return self


def check(tensor: torch.Tensor, name: str) -> Arg:
    """``Arg(tensor, name)``: start a chain of checks on one argument."""
    return Arg(tensor, name)


def page_shift(page_slots: int, name: str) -> int:
    """log2 of a power-of-two slots-per-page count in ``[1, 2^20]`` (``check_page_slots`` of ffi.h):
    ``TypeError`` for what is not an int (:func:`sparsekv.checks.as_int`), else ``ValueError``, naming ``name``."""
    page_slots = as_int(page_slots, name)
    if not 1 <= page_slots <= MAX_PAGE_SLOTS or page_slots & (page_slots - 1):
        raise ValueError(f"sparsekv: argument `{name}` must be a power of two in [1, 2^20], got {page_slots}")
    return page_slots.bit_length() - 1


def visible_entries(positions: torch.Tensor) -> torch.Tensor:
    """Compressed (C4) entries visible from raw positions: ``(t + 1) // 4`` (0 for t < 0), without
    computing ``t + 1`` (which wraps at ``t = 2**63 - 1``)."""
    t = positions.clamp_min(-1)
    return torch.div(t, C4_RATIO, rounding_mode="floor") + (t.remainder(C4_RATIO) == C4_RATIO - 1)


def row_stride(t: torch.Tensor) -> int:
    """Elements between the rows of a 2-D tensor (its row length when it has one row: any stride is legal then)."""
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def optional_arg(t: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """An optional tensor argument: None stays None; a 0-dim tensor is refused (``optional_arg`` of ffi.h)."""
    if t is not None and t.dim() == 0:
        raise ValueError(f"sparsekv: argument `{name}` is a 0-dim tensor; pass None to omit it")
    return t


def read(t: torch.Tensor | None, name: str) -> tuple:
    """An argument the kernel reads, for :func:`check_disjoint` (None: an absent optional one)."""
    return t, name, False


def written(t: torch.Tensor | None, name: str) -> tuple:
    """An argument the kernel writes, for :func:`check_disjoint`."""
    return t, name, True


def _may_self_overlap(t: torch.Tensor) -> bool:
    reach = 0
    for stride, size in sorted((abs(st), n) for st, n in zip(t.stride(), t.shape) if n > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses a tensor's elements cover (``(0, 0)`` when it has none)."""
    if t.numel() == 0:
        return 0, 0
    if t.is_contiguous():  # the common case, without a Python loop over the dims
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    low = sum(min(0, (n - 1) * st) for st, n in zip(t.stride(), t.shape))
    high = sum(max(0, (n - 1) * st) for st, n in zip(t.stride(), t.shape))
    return t.data_ptr() + low * t.element_size(), t.data_ptr() + (high + 1) * t.element_size()


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def _refuse_sharing(a_name: str, b_name: str) -> None:
    raise ValueError(f"sparsekv: arguments `{a_name}` and `{b_name}` must not share memory (the kernel writes one "
                     f"while reading the other)")


def check_no_overlap(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    """``a`` and ``b`` span disjoint bytes, else ``ValueError`` naming both (``check_no_overlap`` of ffi.h)."""
    if _overlap(_byte_span(a), _byte_span(b)):
        _refuse_sharing(a_name, b_name)


def check_disjoint(*operands: tuple) -> None:
    """No written argument shares memory with another argument, nor overlaps itself (``check_disjoint``).

    One span per operand and one sweep over them sorted by start address: O(n log n), not a test of
    every pair. Only when the sweep finds a clash are the pairs walked in argument order, so the
    message names the first clashing pair, as the header's does.
    """
    spans = []
    for order, (t, name, is_written) in enumerate(operands):
        if t is None:
            continue
        if is_written and _may_self_overlap(t):
            raise ValueError(f"sparsekv: argument `{name}` is written but its elements overlap each other (e.g. an "
                             f"expand()ed view, stride 0); pass a tensor with distinct elements")
        start, end = _byte_span(t)
        if start < end:
            spans.append((start, end, is_written, order, name))
    spans.sort()
    reach_any = reach_written = 0  # the furthest end of the spans before this one (any; written ones)
    for start, end, is_written, _, _ in spans:
        if start < (reach_any if is_written else reach_written):
            _refuse_first_clash(spans)
        reach_any = max(reach_any, end)
        if is_written:
            reach_written = max(reach_written, end)


def _refuse_first_clash(spans: list) -> None:
    """Raise for the first pair, in argument order, of ``spans`` that overlap with one of them written."""
    spans = sorted(spans, key=lambda span: span[3])
    for i, (a0, a1, a_written, _, a_name) in enumerate(spans):
        for b0, b1, b_written, _, b_name in spans[i + 1:]:
            if (a_written or b_written) and _overlap((a0, a1), (b0, b1)):
                _refuse_sharing(a_name, b_name)

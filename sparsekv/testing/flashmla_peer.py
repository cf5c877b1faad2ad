"""FlashMLA as a peer: its sparse decode kernels, built from a FlashMLA checkout by
``tools/peers/build_flashmla.sh`` into ``libsparsekv_flashmla.so``, called through ctypes on our tensors.

The library's entry (``tools/peers/flashmla_shim.cu``) takes FlashMLA's own parameter struct,
``SparseAttnDecodeParams`` of the checkout's ``csrc/params.h``, mirrored here as a ctypes structure
(:class:`DecodeParams`); :func:`decode_params` fills it from our arguments exactly as FlashMLA's
``sparse_attn_decode_interface`` fills it from the tensors its Python API takes:

* ``q`` ``[B, H, 512]`` bf16 is FlashMLA's ``[b, s_q = 1, h_q, d_qk = 512]``;
* our cache, uint8 ``[pages, V4.page_bytes(page_slots)]``, is its MODEL1 ``[num_blocks, page_block_size,
  h_kv = 1, 584]``: block stride = our page stride, row stride 584 (FlashMLA finds a token's 576-byte
  value record at ``block * stride_kv_block + row * 576`` and its 8 scale bytes at
  ``block * stride_kv_block + page_block_size * 576 + row * 8``: our ``V4`` page);
* ``indices`` ``[B, K]`` is ``[b, s_q, topk]``; ``topk_length`` ``[B]`` int32; ``attn_sink`` ``[H]`` float32;
  the extra cache and its indices the same way, ``extra_topk_length`` none;
* ``out`` ``[B, H, 512]`` bf16 and ``lse`` ``[B, H]`` float32 are ``[b, s_q, h_q, d_v]`` and ``[b, s_q, h_q]``;
* the split-KV scratch (:class:`Scratch`): ``lse_accum [b + parts, s_q, h_q]``, ``o_accum [b + parts,
  s_q, h_q, 512]`` float32, ``tile_scheduler_metadata [parts, 8]`` and ``num_splits [b + 1]`` int32, with
  ``parts`` from :func:`scheduler_parts` (FlashMLA's ``get_meta``).

The loader reads the struct's layout back from the library (``sparsekv_flashmla_params_layout``) and
refuses a library whose layout differs from :class:`DecodeParams`. Nothing is checked on the device
side: the caller passes arguments that :func:`sparsekv.jit_kernel.dsv4_attention.sparse_decode_attention`
accepts with bf16 ``q`` and ``out``, 64 or 128 heads and top-k widths in blocks of 64.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsekv.kv_layout import V4

__all__ = ["LIBRARY", "DecodeParams", "FlashMLAPeer", "Scratch", "decode_params", "scheduler_parts"]

#: The library ``tools/peers/build_flashmla.sh`` writes.
LIBRARY = "libsparsekv_flashmla.so"
#: FlashMLA's ``ModelType::MODEL1`` (enum ``{V32, MODEL1}``): the DeepSeek-V4 cache, d_qk = 512.
MODEL1 = 1
HEAD_DIM = 512
#: int32 words of one scheduler record (FlashMLA's 32-byte ``DecodingSchedMeta``).
SCHED_META_INTS = 8
LOG2E = 1.4426950408889634

_INT, _FLOAT, _PTR = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class DecodeParams(ctypes.Structure):
    """FlashMLA's ``SparseAttnDecodeParams``, field for field, in declaration order."""

    _fields_ = [
        ("b", _INT), ("s_q", _INT), ("h_q", _INT), ("h_kv", _INT), ("d_qk", _INT), ("d_v", _INT),
        ("sm_scale", _FLOAT), ("sm_scale_div_log2", _FLOAT),
        ("num_blocks", _INT), ("page_block_size", _INT), ("topk", _INT), ("model_type", _INT),
        ("q", _PTR), ("kv", _PTR), ("indices", _PTR), ("topk_length", _PTR), ("attn_sink", _PTR), ("lse", _PTR),
        ("out", _PTR),
        ("extra_num_blocks", _INT), ("extra_page_block_size", _INT), ("extra_topk", _INT),
        ("extra_kv", _PTR), ("extra_indices", _PTR), ("extra_topk_length", _PTR),
        ("stride_q_b", _INT), ("stride_q_s_q", _INT), ("stride_q_h_q", _INT),
        ("stride_kv_block", _INT), ("stride_kv_row", _INT),
        ("stride_indices_b", _INT), ("stride_indices_s_q", _INT),
        ("stride_lse_b", _INT), ("stride_lse_s_q", _INT),
        ("stride_o_b", _INT), ("stride_o_s_q", _INT), ("stride_o_h_q", _INT),
        ("stride_extra_kv_block", _INT), ("stride_extra_kv_row", _INT),
        ("stride_extra_indices_b", _INT), ("stride_extra_indices_s_q", _INT),
        ("stream", _PTR),
        ("lse_accum", _PTR), ("o_accum", _PTR),
        ("stride_lse_accum_split", _INT), ("stride_lse_accum_s_q", _INT),
        ("stride_o_accum_split", _INT), ("stride_o_accum_s_q", _INT), ("stride_o_accum_h_q", _INT),
        ("tile_scheduler_metadata_ptr", _PTR), ("num_splits_ptr", _PTR), ("num_sm_parts", _INT),
    ]

    @classmethod
    def layout(cls) -> list[int]:
        """``[sizeof, offset of each field...]``, as ``sparsekv_flashmla_params_layout`` writes it."""
        return [ctypes.sizeof(cls)] + [getattr(cls, name).offset for name, _ in cls._fields_]


def scheduler_parts(arch_major: int, num_sms: int, heads: int) -> tuple[int, int]:
    """FlashMLA's ``get_meta`` for one query token: ``(num_sm_parts, fixed_overhead_num_blocks)``.

    sm_90: ``num_sms / (h_q / 64)`` parts, overhead 5; sm_100 64 heads: ``num_sms``, 5; sm_100 128
    heads (the ``fwd_for_small_topk`` kernel): ``num_sms / 2``, 3.
    """
    if arch_major == 9:
        return max(num_sms // (heads // 64), 1), 5
    if heads == 64:
        return max(num_sms, 1), 5
    return max(num_sms // 2, 1), 3


@dataclass
class Scratch:
    """FlashMLA's split-KV scratch for ``batch`` rows of ``heads`` heads over ``parts`` scheduler parts."""

    tile_scheduler_metadata: torch.Tensor
    num_splits: torch.Tensor
    lse_accum: torch.Tensor
    o_accum: torch.Tensor
    parts: int

    @classmethod
    def allocate(cls, batch: int, heads: int, parts: int, device: torch.device) -> Scratch:
        ints = dict(dtype=torch.int32, device=device)
        floats = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(parts, SCHED_META_INTS, **ints), torch.empty(batch + 1, **ints),
                   torch.empty(batch + parts, 1, heads, **floats),
                   torch.empty(batch + parts, 1, heads, HEAD_DIM, **floats), parts)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _paged(cache: torch.Tensor, page_slots: int) -> torch.Tensor:
    return cache.as_strided((cache.shape[0], page_slots, 1, V4.bytes_per_token),
                            (cache.stride(0), V4.bytes_per_token, V4.bytes_per_token, 1))


def decode_params(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, page_slots: int,
                  softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, scratch: Scratch, *,
                  extra_kv_cache: torch.Tensor | None = None, extra_indices: torch.Tensor | None = None,
                  extra_page_slots: int | None = None, topk_length: torch.Tensor | None = None,
                  stream: int = 0) -> DecodeParams:
    """FlashMLA's parameter struct for our arguments (see the module docstring for the mapping)."""
    q4, kv4, idx3 = q[:, None], _paged(kv_cache, page_slots), indices[:, None]
    out4, lse3 = out[:, None], lse[:, None]
    p = DecodeParams(
        b=q4.shape[0], s_q=1, h_q=q4.shape[2], h_kv=1, d_qk=q4.shape[3], d_v=HEAD_DIM,
        sm_scale=softmax_scale, sm_scale_div_log2=softmax_scale * LOG2E,
        num_blocks=kv4.shape[0], page_block_size=kv4.shape[1], topk=idx3.shape[2], model_type=MODEL1,
        q=_ptr(q4), kv=_ptr(kv4), indices=_ptr(idx3), topk_length=_ptr(topk_length), attn_sink=_ptr(sink),
        lse=_ptr(lse3), out=_ptr(out4),
        stride_q_b=q4.stride(0), stride_q_s_q=q4.stride(1), stride_q_h_q=q4.stride(2),
        stride_kv_block=kv4.stride(0), stride_kv_row=kv4.stride(1),
        stride_indices_b=idx3.stride(0), stride_indices_s_q=idx3.stride(1),
        stride_lse_b=lse3.stride(0), stride_lse_s_q=lse3.stride(1),
        stride_o_b=out4.stride(0), stride_o_s_q=out4.stride(1), stride_o_h_q=out4.stride(2),
        stream=stream or None,
        lse_accum=_ptr(scratch.lse_accum), o_accum=_ptr(scratch.o_accum),
        stride_lse_accum_split=scratch.lse_accum.stride(0), stride_lse_accum_s_q=scratch.lse_accum.stride(1),
        stride_o_accum_split=scratch.o_accum.stride(0), stride_o_accum_s_q=scratch.o_accum.stride(1),
        stride_o_accum_h_q=scratch.o_accum.stride(2),
        tile_scheduler_metadata_ptr=_ptr(scratch.tile_scheduler_metadata), num_splits_ptr=_ptr(scratch.num_splits),
        num_sm_parts=scratch.parts)
    if extra_kv_cache is not None:
        xkv4, xidx3 = _paged(extra_kv_cache, extra_page_slots), extra_indices[:, None]
        p.extra_num_blocks, p.extra_page_block_size, p.extra_topk = xkv4.shape[0], xkv4.shape[1], xidx3.shape[2]
        p.extra_kv, p.extra_indices = _ptr(xkv4), _ptr(xidx3)
        p.stride_extra_kv_block, p.stride_extra_kv_row = xkv4.stride(0), xkv4.stride(1)
        p.stride_extra_indices_b, p.stride_extra_indices_s_q = xidx3.stride(0), xidx3.stride(1)
    return p


class FlashMLAPeer:
    """The built peer library, loaded once; :meth:`__call__` runs FlashMLA's sparse decode on the
    current CUDA stream (no synchronization, scratch kept per shape).

    Raises
    ------
    OSError
        The library does not load.
    RuntimeError
        Its ``SparseAttnDecodeParams`` layout differs from :class:`DecodeParams` (another FlashMLA commit).
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path).resolve()  # dlopen searches the library path for a bare file name
        self.path = path / LIBRARY if path.is_dir() else path
        self._lib = ctypes.CDLL(str(self.path))
        layout = (ctypes.c_int64 * 128)()
        count = self._lib.sparsekv_flashmla_params_layout(layout, 128)
        theirs, ours = list(layout[:count]), DecodeParams.layout()
        if theirs != ours:
            raise RuntimeError(f"{self.path}: FlashMLA's SparseAttnDecodeParams layout {theirs} is not the one "
                               f"sparsekv mirrors {ours}: rebuild from the pinned commit "
                               f"(tools/peers/build_flashmla.sh)")
        if self._lib.sparsekv_flashmla_sched_meta_bytes() != SCHED_META_INTS * 4:
            raise RuntimeError(f"{self.path}: FlashMLA's scheduler record is not {SCHED_META_INTS * 4} bytes")
        self._entry = self._lib.sparsekv_flashmla_sparse_decode
        self._entry.argtypes = [ctypes.POINTER(DecodeParams), ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self._scratch: dict[tuple, Scratch] = {}

    def __call__(self, q, kv_cache, indices, sink, page_slots, out, lse, *, softmax_scale: float = 512**-0.5,
                 extra_kv_cache=None, extra_indices=None, extra_page_slots=None, topk_length=None) -> None:
        """Write FlashMLA's ``out`` (bf16 ``[B, H, 512]``) and ``lse`` (``[B, H]``) for our arguments."""
        if q.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or q.shape[1] not in (64, 128):
            raise ValueError("FlashMLA takes bf16 q and out with 64 or 128 heads")
        if not math.isfinite(softmax_scale):
            raise ValueError("softmax_scale must be finite")
        device = q.device
        major = torch.cuda.get_device_capability(device)[0]
        key = (device, q.shape[0], q.shape[1])
        if key not in self._scratch:
            parts, _ = scheduler_parts(major, torch.cuda.get_device_properties(device).multi_processor_count,
                                       q.shape[1])
            self._scratch[key] = Scratch.allocate(q.shape[0], q.shape[1], parts, device)
        _, overhead = scheduler_parts(major, 1, q.shape[1])
        params = decode_params(q, kv_cache, indices, sink, page_slots, softmax_scale, out, lse, self._scratch[key],
                               extra_kv_cache=extra_kv_cache, extra_indices=extra_indices,
                               extra_page_slots=extra_page_slots, topk_length=topk_length,
                               stream=torch.cuda.current_stream(device).cuda_stream)
        error = ctypes.create_string_buffer(512)
        if self._entry(ctypes.byref(params), major, overhead, error, len(error)) != 0:
            raise RuntimeError(f"FlashMLA peer: {error.value.decode(errors='replace')}")

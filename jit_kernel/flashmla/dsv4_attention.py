"""``impl="flashmla"`` of :func:`sparsekv.jit_kernel.dsv4_attention.sparse_decode_attention`: FlashMLA's sparse
decode kernel (the ``flash_mla`` package) run on our caches as they are.

Why it fits without a copy: FlashMLA's DeepSeek-V4 cache ("MODEL1", ``d_qk = 512``) stores a page of
``page_slots`` tokens as their 576-byte value records (448 e4m3 bytes, 64 bf16 rope values), then their
8-byte UE8M0 scale records (7 scales, one pad byte), the page padded to a multiple of 576 bytes: byte
for byte our ``V4`` page (:mod:`sparsekv.kv_layout`). FlashMLA takes it as a
``[pages, page_slots, 1, 584]`` tensor whose page stride is the padded page and whose row stride is 584;
only the page stride and ``page_slots`` are read, so the view below is exact. Its slots are ours
(``page * page_slots + offset``, -1 = none), its ``attn_sink`` scales the output by
``sigmoid(lse - sink)`` and is left out of ``lse``, its ``topk_length`` bounds the entries of ``indices``
(not the extra ones), and a row without a valid entry gives ``out = 0``, ``lse = +inf``: our contract.

What differs, and what this adapter does about it:

* FlashMLA takes only bfloat16 ``q`` with 64 or 128 heads, and reads top-k lists in blocks of 64
  entries (a list whose width is not a multiple of 64 would be read past its end): other shapes are
  refused here, naming the argument, and ``impl="auto"`` does not pick FlashMLA for them.
* Its kernel skips only ``-1``; another out-of-range slot would be read. Our contract skips every
  out-of-range entry, so the slots are mapped to -1 on the device first (one elementwise pass over
  the int32 lists), and ``topk_length`` is clamped to ``[0, K]`` the same way.
* It writes bfloat16 ``out`` and allocates its outputs and split-KV scratch on every call (the
  caching allocator's, so a CUDA graph captures it); they are copied into ``out`` (a float32 ``out``
  then holds bf16-rounded values) and ``lse``. ``num_splits`` and ``workspace`` are checked and not
  used: FlashMLA plans its own splits on the device.

Tolerance (FlashMLA's own test against its fp32 reference): ``|out - ref| <= 1e-3 + 2.01/128 |ref|``,
``|lse - ref| <= 1e-6 + 8.01/65536 |ref|``. NaN handling is FlashMLA's.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from sparsekv.kv_layout import V4

__all__ = ["PACKAGE", "misfit_reason", "sparse_decode_attention", "unavailable_reason"]

#: The Python package FlashMLA installs.
PACKAGE = "flash_mla"
#: Compute capabilities (major) FlashMLA's sparse decode runs on: sm_90a and the sm_100 family.
ARCH_MAJORS = (9, 10)
HEADS = (64, 128)
#: FlashMLA reads each top-k list in blocks of this many entries.
TOPK_BLOCK = 64
HEAD_DIM = 512


@functools.cache
def _importable() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


@functools.cache
def _arch_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


#: The reason of each device that is not a CUDA one (it depends on the device alone).
_OFF_CUDA: dict[torch.device, str] = {}


def unavailable_reason(device: torch.device) -> str | None:
    """Why FlashMLA cannot run on ``device`` in this process (one line), or None when it can."""
    reason = _OFF_CUDA.get(device)  # impl="auto" asks at every call: ~0.9 us to word the answer anew
    if reason is not None:
        return reason
    if device.type != "cuda":
        reason = _OFF_CUDA[device] = f"FlashMLA runs on CUDA tensors of sm_90 or sm_100 GPUs, got tensors on {device}"
        return reason
    if not _importable():
        return f"the `{PACKAGE}` package is not importable (pip install FlashMLA: github.com/deepseek-ai/FlashMLA)"
    major = _arch_major(device.index if device.index is not None else torch.cuda.current_device())
    if major not in ARCH_MAJORS:
        return f"FlashMLA's sparse decode runs on sm_90 and sm_100 GPUs, this one is sm_{major}x"
    return None


def misfit_reason(q: torch.Tensor, indices: torch.Tensor, extra_indices: torch.Tensor | None) -> str | None:
    """Why a call's shapes are outside FlashMLA's sparse decode (a message naming the argument), or None."""
    if q.dtype != torch.bfloat16:
        return f"argument `q` must have dtype bfloat16 for impl='flashmla' (FlashMLA's queries), got {q.dtype}"
    if q.dim() != 3 or q.shape[1] not in HEADS:
        return f"argument `q` must have 64 or 128 heads for impl='flashmla', got shape {list(q.shape)}"
    for table, name in ((indices, "indices"), (extra_indices, "extra_indices")):
        if table is None or table.dim() != 2:
            continue
        width = table.shape[1]
        if width % TOPK_BLOCK or (name == "indices" and width == 0):
            return (f"argument `{name}` must have a positive multiple of {TOPK_BLOCK} entries per row for "
                    f"impl='flashmla' (FlashMLA reads the lists in blocks of {TOPK_BLOCK}), got {width}")
    return None


def paged_view(cache: torch.Tensor, page_slots: int) -> torch.Tensor:
    """Our uint8 ``[pages, V4.page_bytes(page_slots)]`` cache as FlashMLA's ``[pages, page_slots, 1, 584]``."""
    return cache.as_strided((cache.shape[0], page_slots, 1, V4.bytes_per_token),
                            (cache.stride(0), V4.bytes_per_token, V4.bytes_per_token, 1))


def _valid_slots(indices: torch.Tensor, cache: torch.Tensor, page_slots: int) -> torch.Tensor:
    # FlashMLA skips only -1: every other out-of-range entry becomes -1, as our kernels skip it.
    slots = cache.shape[0] * page_slots
    return indices.masked_fill((indices < -1) | (indices >= slots), -1)


def sparse_decode_attention(q, kv_cache, indices, sink, page_slots, softmax_scale, extra_kv_cache, extra_indices,
                            extra_page_slots, out, lse, topk_length) -> None:
    """Run FlashMLA on arguments :func:`sparsekv.jit_kernel.dsv4_attention.sparse_decode_attention` has
    checked; write ``out`` (bfloat16 or float32) and ``lse``.

    Raises
    ------
    TypeError, ValueError
        The shapes are outside FlashMLA's (:func:`misfit_reason`), before anything is written.
    """
    reason = misfit_reason(q, indices, extra_indices)
    if reason is not None:
        raise (TypeError if "dtype" in reason else ValueError)(f"sparsekv: {reason}")
    import flash_mla

    batch, heads = q.shape[0], q.shape[1]
    if batch == 0:
        return
    width = indices.shape[1]
    kwargs = {}
    if extra_kv_cache is not None:
        kwargs = {"extra_k_cache": paged_view(extra_kv_cache, extra_page_slots),
                  "extra_indices_in_kvcache": _valid_slots(extra_indices, extra_kv_cache, extra_page_slots)[:, None]}
    if topk_length is not None:
        kwargs["topk_length"] = topk_length.clamp(0, width)
    schedule, _ = flash_mla.get_mla_metadata()
    result, result_lse = flash_mla.flash_mla_with_kvcache(
        q[:, None], paged_view(kv_cache, page_slots), None, None, HEAD_DIM, schedule, softmax_scale=softmax_scale,
        is_fp8_kvcache=True, indices=_valid_slots(indices, kv_cache, page_slots)[:, None], attn_sink=sink, **kwargs)
    out.copy_(result.view(batch, heads, HEAD_DIM))
    lse.copy_(result_lse.view(batch, heads))

"""FlashMLA beside our attention: ``impl="flashmla"`` (the ``flash_mla`` package through our op) and the
peer library (``tools/peers/``, loaded by :mod:`sparsekv.testing.flashmla_peer`).

On CPU: the refusal without the package or a GPU, what ``"auto"`` picks, the shapes FlashMLA is not
given, and the peer's parameter mapping against FlashMLA's documented structure (sizes, strides, the
extra cache, ``topk_length``, the sink), read back through FlashMLA's own addressing of a MODEL1 page.
On a GPU with the package or the built library: FlashMLA against our fp64 reference and against our
kernels, within FlashMLA's own tolerances (its test: out ``1e-3 + 2.01/128 |ref|``, lse ``1e-6 +
8.01/65536 |ref|``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from sparsekv.jit_kernel.dsv4_attention import attention_impl, sparse_decode_attention
from sparsekv.jit_kernel.flashmla import dsv4_attention as flashmla
from sparsekv.kv_layout import V4
from sparsekv.testing import flashmla_peer
from sparsekv.testing.backends import device_of
from sparsekv.testing.components import skip_for_gpu
from sparsekv.testing.reference.dsv4_attention import sparse_decode_attention_reference
from sparsekv.testing.reference.dsv4_quant import dequantize_fp8_ds_mla
from sparsekv.testing.strategies.dsv4_attention import random_rows, v4_cache

#: FlashMLA's tolerances (tests/test_flash_mla_sparse_decoding.py at the pinned commit), as assert_close's.
FLASHMLA_OUT_TOL = {"atol": 1e-3, "rtol": 2.01 / 128}
FLASHMLA_LSE_TOL = {"atol": 1e-6, "rtol": 8.01 / 65536}
#: Where ``tools/peers/build_flashmla.sh`` puts the peer library by default, and ``make gpu-check`` looks for it.
PEER_DIR = Path(__file__).resolve().parents[2] / "peers" / "flashmla"


def case(heads: int, k: int, *, batch: int = 3, page_slots: int = 64, k2: int = 0, seed: int = 0, device="cpu"):
    """Arguments with -1 holes, an extra cache when ``k2``, a sink and ``topk_length``."""
    g = torch.Generator().manual_seed(seed)
    slots = 3 * page_slots
    args = {"q": torch.randn(batch, heads, 512, generator=g).bfloat16(),
            "kv_cache": v4_cache(random_rows(slots, g), page_slots),
            "indices": torch.randint(0, slots, (batch, k), generator=g, dtype=torch.int32),
            "sink": torch.randn(heads, generator=g), "page_slots": page_slots,
            "topk_length": torch.randint(0, k + 1, (batch,), generator=g, dtype=torch.int32)}
    args["indices"][torch.rand(batch, k, generator=g) < 0.25] = -1
    if k2:
        args.update(extra_kv_cache=v4_cache(random_rows(2 * page_slots, g), page_slots), extra_page_slots=page_slots,
                    extra_indices=torch.randint(-1, 2 * page_slots, (batch, k2), generator=g, dtype=torch.int32))
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in args.items()}


def reference(args):
    return sparse_decode_attention_reference(
        args["q"].cpu(), args["kv_cache"].cpu(), args["indices"].cpu(), args["sink"].cpu(), args["page_slots"],
        extra_kv_cache=args.get("extra_kv_cache"), extra_indices=args.get("extra_indices"),
        extra_page_slots=args.get("extra_page_slots"), topk_length=args["topk_length"].cpu())


# impl="flashmla": refusals and the choice of "auto" --------------------------------------------------------

def test_flashmla_without_the_package_is_refused_in_one_line_before_anything_is_written(backend, monkeypatch):
    monkeypatch.setattr(flashmla, "_importable", lambda: False)
    args = case(64, 64, device=device_of(backend))
    out = torch.full((3, 64, 512), 7.0, device=device_of(backend))
    with pytest.raises(ValueError, match="`impl` is 'flashmla'") as refused:
        sparse_decode_attention(**args, out=out, impl="flashmla")
    assert "\n" not in str(refused.value)
    reason = "flash_mla" if backend == "cuda" else "CUDA tensors"
    assert reason in str(refused.value)
    assert bool((out == 7.0).all())
    # Without the package, a CUDA device is refused for the package, not for its architecture.
    assert "`flash_mla` package" in flashmla.unavailable_reason(torch.device("cuda", 0))


def test_auto_picks_flashmla_exactly_where_it_runs_and_fits(backend, monkeypatch):
    args = case(64, 64, device=device_of(backend))
    q, indices = args["q"], args["indices"]
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device: "absent")
    assert attention_impl("auto", q, indices, None) == "header"
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device: None)
    assert attention_impl("auto", q, indices, None) == "flashmla"
    assert attention_impl("auto", q.float(), indices, None) == "header"  # FlashMLA takes bf16 q only
    assert attention_impl("auto", q[:, :32], indices, None) == "header"  # 64 or 128 heads
    assert attention_impl("auto", q, indices[:, :40], None) == "header"  # lists in blocks of 64
    assert attention_impl("auto", q, indices, indices[:, :40]) == "header"
    assert attention_impl("header", q, indices, None) == "header"
    with pytest.raises(ValueError, match="`impl` must be one of"):
        attention_impl("flash", q, indices, None)


@pytest.mark.no_backend("the shape rules are computed in Python")
def test_misfits_name_the_argument():
    q = torch.zeros(2, 64, 512, dtype=torch.bfloat16)
    indices = torch.zeros(2, 128, dtype=torch.int32)
    assert flashmla.misfit_reason(q, indices, None) is None
    assert flashmla.misfit_reason(q, indices, indices[:, :64]) is None
    assert "`q`" in flashmla.misfit_reason(q.float(), indices, None)
    assert "`q`" in flashmla.misfit_reason(torch.zeros(2, 96, 512, dtype=torch.bfloat16), indices, None)
    assert "`indices`" in flashmla.misfit_reason(q, indices[:, :0], None)
    assert "`indices`" in flashmla.misfit_reason(q, indices[:, :65], None)
    assert "`extra_indices`" in flashmla.misfit_reason(q, indices, indices[:, :1])


# The peer's parameter mapping, on CPU tensors --------------------------------------------------------------

def _flashmla_token(raw: torch.Tensor, base: int, kv_ptr: int, block_stride: int, page_block_size: int,
                    token: int) -> torch.Tensor:
    """Token ``token`` read the way FlashMLA's MODEL1 kernel addresses it, from nothing but the params:
    the 576-byte value record at ``block * stride_kv_block + row * 576``, the 8 scale bytes at
    ``block * stride_kv_block + page_block_size * 576 + row * 8`` (7 UE8M0 scales), values
    e4m3 * 2^(scale - 127) in 64-wide tiles, then 64 bf16 rope values."""
    block, row = divmod(token, page_block_size)
    start = kv_ptr - base + block * block_stride
    record = raw[start + row * 576:start + row * 576 + 576]
    scales = raw[start + page_block_size * 576 + row * 8:][:7].to(torch.float64)
    nope = record[:448].view(torch.float8_e4m3fn).to(torch.float64).view(7, 64) * torch.exp2(scales - 127)[:, None]
    return torch.cat([nope.reshape(448), record[448:].view(torch.bfloat16).to(torch.float64)])


@pytest.mark.no_backend("the mapping is computed on the host; the kernels it feeds need a GPU")
@pytest.mark.parametrize("heads", [64, 128])
def test_peer_mapping_follows_flashmla_parameter_structure(heads):
    batch, k, k2, page_slots = 3, 128, 64, 4
    args = case(heads, k, batch=batch, page_slots=page_slots, k2=k2)
    # The cache is a slice of a larger buffer: FlashMLA's base pointer and block stride must follow it.
    buffer = torch.zeros(5, V4.page_bytes(page_slots) + 40, dtype=torch.uint8)
    cache = buffer[1:4, :V4.page_bytes(page_slots)]
    cache.copy_(args["kv_cache"][:3])
    out = torch.empty(batch, heads, 512, dtype=torch.bfloat16)
    lse = torch.empty(batch, heads)
    scratch = flashmla_peer.Scratch.allocate(batch, heads, 7, torch.device("cpu"))
    p = flashmla_peer.decode_params(args["q"], cache, args["indices"], args["sink"], page_slots, 0.125, out, lse,
                                    scratch, extra_kv_cache=args["extra_kv_cache"],
                                    extra_indices=args["extra_indices"], extra_page_slots=page_slots,
                                    topk_length=args["topk_length"], stream=1234)
    # FlashMLA's interface on q [b, 1, h, 512], kv [blocks, page, 1, 584], indices [b, 1, topk], out
    # [b, 1, h, 512], lse [b, 1, h] and accumulators [b + parts, 1, h(, 512)], all contiguous here.
    expected = {
        "b": batch, "s_q": 1, "h_q": heads, "h_kv": 1, "d_qk": 512, "d_v": 512, "num_blocks": 3,
        "page_block_size": page_slots, "topk": k, "model_type": 1, "extra_num_blocks": 2,
        "extra_page_block_size": page_slots, "extra_topk": k2,
        "q": args["q"].data_ptr(), "kv": cache.data_ptr(), "indices": args["indices"].data_ptr(),
        "topk_length": args["topk_length"].data_ptr(), "attn_sink": args["sink"].data_ptr(),
        "lse": lse.data_ptr(), "out": out.data_ptr(), "extra_kv": args["extra_kv_cache"].data_ptr(),
        "extra_indices": args["extra_indices"].data_ptr(), "extra_topk_length": None,
        "stride_q_b": heads * 512, "stride_q_s_q": heads * 512, "stride_q_h_q": 512,
        "stride_kv_block": V4.page_bytes(page_slots) + 40, "stride_kv_row": 584,
        "stride_indices_b": k, "stride_indices_s_q": k, "stride_lse_b": heads, "stride_lse_s_q": heads,
        "stride_o_b": heads * 512, "stride_o_s_q": heads * 512, "stride_o_h_q": 512,
        "stride_extra_kv_block": V4.page_bytes(page_slots), "stride_extra_kv_row": 584,
        "stride_extra_indices_b": k2, "stride_extra_indices_s_q": k2, "stream": 1234,
        "lse_accum": scratch.lse_accum.data_ptr(), "o_accum": scratch.o_accum.data_ptr(),
        "stride_lse_accum_split": heads, "stride_lse_accum_s_q": heads, "stride_o_accum_split": heads * 512,
        "stride_o_accum_s_q": heads * 512, "stride_o_accum_h_q": 512,
        "tile_scheduler_metadata_ptr": scratch.tile_scheduler_metadata.data_ptr(),
        "num_splits_ptr": scratch.num_splits.data_ptr(), "num_sm_parts": 7,
    }
    assert {name: getattr(p, name) for name in expected} == expected
    assert p.sm_scale == 0.125 and math.isclose(p.sm_scale_div_log2, 0.125 * math.log2(math.e), rel_tol=1e-7)
    assert tuple(scratch.lse_accum.shape) == (batch + 7, 1, heads)
    assert tuple(scratch.tile_scheduler_metadata.shape) == (7, 8) and tuple(scratch.num_splits.shape) == (batch + 1,)
    # Read every slot through FlashMLA's addressing from the params alone: our dequantized rows.
    raw = buffer.view(-1)
    slots = torch.arange(3 * page_slots)
    ours = dequantize_fp8_ds_mla(cache, slots, page_slots)
    theirs = torch.stack([_flashmla_token(raw, buffer.data_ptr(), p.kv, p.stride_kv_block, p.page_block_size,
                                          int(s)) for s in slots])
    assert torch.equal(theirs, ours)
    # The check can fail: a block stride of page_slots * 584 (no page padding) reads other bytes.
    unpadded = torch.stack([_flashmla_token(raw, buffer.data_ptr(), p.kv, page_slots * 584, p.page_block_size,
                                            int(s)) for s in slots])
    assert not torch.equal(unpadded.nan_to_num(), ours)


@pytest.mark.no_backend("the struct layout is computed on the host")
def test_peer_struct_mirrors_flashmla_params_h():
    # SparseAttnDecodeParams (csrc/params.h at the pinned commit) on x86-64: 4-byte int / float,
    # 8-byte pointers and stream, natural alignment. The loader compares the library's own
    # offsetof() list with this one and refuses a mismatch.
    ints = lambda start, n: [start + 4 * i for i in range(n)]  # noqa: E731
    ptrs = lambda start, n: [start + 8 * i for i in range(n)]  # noqa: E731
    expected = [280] + ints(0, 12) + ptrs(48, 7) + ints(104, 3) + ptrs(120, 3) + ints(144, 16) + ptrs(208, 3) \
        + ints(232, 5) + ptrs(256, 2) + [272]
    assert flashmla_peer.DecodeParams.layout() == expected


@pytest.mark.no_backend("FlashMLA's get_meta, computed on the host")
def test_scheduler_parts_follow_flashmla_get_meta():
    assert flashmla_peer.scheduler_parts(9, 132, 64) == (132, 5)
    assert flashmla_peer.scheduler_parts(9, 132, 128) == (66, 5)
    assert flashmla_peer.scheduler_parts(10, 148, 64) == (148, 5)
    assert flashmla_peer.scheduler_parts(10, 148, 128) == (74, 3)


# On a GPU -------------------------------------------------------------------------------------------------

GPU_CASES = [(64, 128, 0), (64, 64, 64), (128, 128, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads, k, k2", GPU_CASES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_flashmla_impl_matches_the_reference_within_flashmla_tolerance(backend, heads, k, k2, out_dtype):
    if backend != "cuda":
        skip_for_gpu("impl='flashmla' runs on CUDA tensors")
    reason = flashmla.unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    args = case(heads, k, k2=k2, device=device_of(backend))
    out, lse = sparse_decode_attention(**args, impl="flashmla", out_dtype=out_dtype)
    ref_out, ref_lse = reference(args)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.cpu().double(), ref_out, **FLASHMLA_OUT_TOL)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, **FLASHMLA_LSE_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, k, k2", GPU_CASES)
def test_the_flashmla_peer_and_our_kernels_agree_within_flashmla_tolerance(backend, heads, k, k2):
    if backend != "cuda":
        skip_for_gpu("the peer runs on CUDA tensors")
    if not (PEER_DIR / flashmla_peer.LIBRARY).is_file():
        pytest.skip(f"no built peer library at {PEER_DIR} (tools/peers/build_flashmla.sh)")
    peer = flashmla_peer.FlashMLAPeer(PEER_DIR)
    args = case(heads, k, k2=k2, device=device_of(backend))
    out = torch.empty(args["q"].shape, dtype=torch.bfloat16, device=args["q"].device)
    lse = torch.empty(args["q"].shape[:2], device=args["q"].device)
    peer(args["q"], args["kv_cache"], args["indices"], args["sink"], args["page_slots"], out, lse,
         extra_kv_cache=args.get("extra_kv_cache"), extra_indices=args.get("extra_indices"),
         extra_page_slots=args.get("extra_page_slots"), topk_length=args["topk_length"])
    ref_out, ref_lse = reference(args)
    torch.testing.assert_close(out.cpu().double(), ref_out, **FLASHMLA_OUT_TOL)
    torch.testing.assert_close(lse.cpu().double(), ref_lse, **FLASHMLA_LSE_TOL)
    for impl in ("header", "triton"):
        ours, our_lse = sparse_decode_attention(**args, impl=impl, out_dtype=torch.bfloat16)
        torch.testing.assert_close(ours.float(), out.float(), **FLASHMLA_OUT_TOL)
        torch.testing.assert_close(our_lse, lse, **FLASHMLA_LSE_TOL)


@pytest.mark.gpu
def test_flashmla_impl_captured_in_a_cuda_graph_and_compiled_writes_what_eager_writes(backend):
    """impl="flashmla" is the same custom op as the others: a CUDA-graph replay (FlashMLA's scratch comes
    from the caching allocator, so capture keeps it) and a ``torch.compile``'d call write the bytes an
    eager call writes on the same inputs."""
    if backend != "cuda":
        skip_for_gpu("CUDA-graph capture needs CUDA tensors")
    reason = flashmla.unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    args, replayed_args = case(64, 128, k2=64, device="cuda"), case(64, 128, k2=64, seed=1, device="cuda")
    eager_out, eager_lse = sparse_decode_attention(**replayed_args, impl="flashmla", out_dtype=torch.bfloat16)

    static = {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in args.items()}
    out, lse = torch.empty_like(eager_out), torch.empty_like(eager_lse)
    sparse_decode_attention(**static, out=out, lse=lse, impl="flashmla")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_decode_attention(**static, out=out, lse=lse, impl="flashmla")
    for name, value in replayed_args.items():
        if isinstance(value, torch.Tensor):
            static[name].copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), eager_lse.view(torch.int32))

    compiled = torch.compile(lambda **kw: sparse_decode_attention(**kw, impl="flashmla", out_dtype=torch.bfloat16),
                             fullgraph=True)
    compiled_out, compiled_lse = compiled(**replayed_args)
    assert torch.equal(compiled_out.view(torch.int16), eager_out.view(torch.int16))
    assert torch.equal(compiled_lse.view(torch.int32), eager_lse.view(torch.int32))

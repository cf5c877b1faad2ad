"""dsv4_quant: the FP8 ``fp8_ds_mla`` quantizer and dequantizer, and the plain indexer-key quantizer
(FP8 132 B / FP4 68 B), against the torch byte oracle; indexer keys round-trip through the indexer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4 import dequantize_fp8_ds_mla, indexer_scores, quantize_fp8_ds_mla, quantize_indexer_keys
from sparsekv.kv_layout import INDEXER_LAYOUTS, V4
from sparsekv.testing.backends import core_backends, device_of, kernel_backends, skip_unless_triton_runs, to_backend
from sparsekv.testing.profiles import scaled_examples
from sparsekv.testing.reference import dsv4_quant as ref
from sparsekv.testing.reference.dsv4_indexer import decode_indexer_keys, entry_slots
from sparsekv.testing.strategies.dsv4_quant import quant_rows, slot_case

BACKENDS = kernel_backends()


def _noise_cache(pages: int, page_slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, V4.page_bytes(page_slots)), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("backend", core_backends())  # sim too in make test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@settings(max_examples=scaled_examples(15), deadline=None)
@given(data=st.data())
def test_quantize_bytes_equal_the_reference(backend, dtype, data):
    x = data.draw(quant_rows()).to(dtype)
    page_slots, pages, slots = data.draw(slot_case(x.shape[0]))
    cache = _noise_cache(pages, page_slots, data.draw(st.integers(0, 1000)))
    expected = cache.clone()
    ref.quantize_fp8_ds_mla(x, expected, slots, page_slots)
    device = device_of(backend)
    got = cache.to(device)
    quantize_fp8_ds_mla(x.to(device), got, slots.to(device), page_slots)
    # Bytes outside the written slots (other slots, page padding) keep their noise.
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=scaled_examples(15), deadline=None)
@given(data=st.data())
def test_dequantize_is_within_half_an_ulp_and_scales_are_powers_of_two(backend, data):
    x = data.draw(quant_rows())
    page_slots, pages, slots = data.draw(slot_case(x.shape[0]))
    device = device_of(backend)
    cache = torch.zeros(pages, V4.page_bytes(page_slots), dtype=torch.uint8, device=device)
    quantize_fp8_ds_mla(x.to(device), cache, slots.to(device), page_slots)
    got = dequantize_fp8_ds_mla(cache, slots.to(device), page_slots).cpu().double()
    assert torch.equal(got, ref.dequantize_fp8_ds_mla(cache.cpu(), slots, page_slots))

    scale_bytes = V4.scale_view(cache.cpu(), page_slots)[slots // page_slots, slots % page_slots]
    e = scale_bytes[:, :7].to(torch.int64) - 127
    blocks = x[:, :448].double().reshape(-1, 7, 64)
    amax = blocks.abs().amax(2).clamp_min(1e-4)
    scale = torch.ldexp(torch.ones_like(amax), e)
    # The scale is the smallest power of two that brings amax within 448.
    assert bool((amax <= 448 * scale).all()) and bool((amax > 224 * scale).all())
    assert bool((scale_bytes[:, 7] == 0).all())
    # Half an e4m3 ulp at the scaled value's binade (subnormal spacing 2^-9 below 2^-6).
    y = (blocks / scale[:, :, None]).abs()
    binade = torch.floor(torch.log2(y.clamp_min(2.0**-6)))
    half_ulp = torch.ldexp(torch.ones_like(y), (binade - 4).to(torch.int64)) * scale[:, :, None]
    err = (got[:, :448].reshape(-1, 7, 64) - blocks).abs()
    assert bool((err <= half_ulp).all())
    rope = x[:, 448:].double()
    assert torch.equal(got[:, 448:], rope.to(torch.bfloat16).double())


@pytest.mark.sanitizer_case
def test_edge_blocks_hit_exact_scales(backend):
    x = torch.zeros(3, 512)
    x[1, :64] = 448.0 * 2.0**-3  # amax exactly at the boundary: e = -3, code 448
    x[2, :64] = 448.0 * 2.0**-3 * (1 + 2.0**-23)  # one ulp above: next power of two
    x, cache, slots = to_backend(backend, [x, torch.zeros(1, V4.page_bytes(4), dtype=torch.uint8), torch.arange(3)])
    quantize_fp8_ds_mla(x, cache, slots, 4)
    cache = cache.cpu()
    scales = V4.scale_view(cache, 4)[0]
    values = V4.value_view(cache, 4)[0]
    # All-zero blocks: amax floor 1e-4 -> e = ceil(log2(1e-4 / 448)) = -22, codes 0.
    assert scales[0, 0].item() == 127 - 22 and bool((values[0, :448] == 0).all())
    assert scales[1, 0].item() == 127 - 3 and values[1, 0].item() == 0x7E
    assert scales[2, 0].item() == 127 - 2 and values[2, 0].item() == 0x76  # 224 * (1 + 2^-23) -> 224


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input_writes_nothing(backend):
    device = device_of(backend)
    cache = torch.full((2, V4.page_bytes(2)), 9, dtype=torch.uint8, device=device)
    quantize_fp8_ds_mla(torch.zeros(0, 512, device=device), cache, torch.zeros(0, dtype=torch.int64, device=device), 2)
    assert bool((cache == 9).all())
    assert dequantize_fp8_ds_mla(cache, torch.zeros(0, dtype=torch.int64, device=device), 2).shape == (0, 512)


def _args():
    return torch.randn(3, 512), torch.full((2, V4.page_bytes(2)), 5, dtype=torch.uint8), torch.tensor([0, 3, 1]), 2


BAD = [
    (lambda x, c, s, p: (x.double(), c, s, p), TypeError, "x"),
    (lambda x, c, s, p: (x.half(), c, s, p), TypeError, "x"),
    (lambda x, c, s, p: (x[:, :448], c, s, p), ValueError, "x"),
    (lambda x, c, s, p: (x, c, s[:2], p), ValueError, "slots"),
    (lambda x, c, s, p: (x, c, s.to(torch.int32), p), TypeError, "slots"),
    (lambda x, c, s, p: (x, c, torch.tensor([0, 4, 1]), p), IndexError, "slots"),
    (lambda x, c, s, p: (x, c, torch.tensor([0, -1, 1]), p), IndexError, "slots"),
    (lambda x, c, s, p: (x, c, torch.tensor([0, 1, 1]), p), ValueError, "slots"),
    (lambda x, c, s, p: (x, c, s, 3), ValueError, "page_slots"),
    (lambda x, c, s, p: (x, c, s, 4), ValueError, "cache"),
    (lambda x, c, s, p: (x, c.to(torch.int8), s, p), TypeError, "cache"),
    (lambda x, c, s, p: (x, c[:, :-1], s, p), ValueError, "cache"),
]


@pytest.mark.parametrize("impl", ["header", "triton"])
@pytest.mark.parametrize("mutate, exc, name", BAD)
def test_bad_input_raises_naming_the_argument_and_leaves_the_cache(backend, index_checks, mutate, exc, name, impl):
    # Both implementations refuse the same inputs with the same exception and message.
    if impl == "triton":
        skip_unless_triton_runs(backend)
    x, cache, slots, page_slots = to_backend(backend, _args())
    before = cache.clone()
    args = to_backend(backend, mutate(x, cache, slots, page_slots))
    with pytest.raises(exc, match=f"`{name}`") as error:
        quantize_fp8_ds_mla(*args, impl=impl)
    assert torch.equal(cache, before)
    with pytest.raises(exc) as header_error:
        quantize_fp8_ds_mla(*args, impl="header")
    assert str(error.value) == str(header_error.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_header_refuses_a_cache_off_a_16_byte_boundary(backend):
    # The header writes each V4 record in whole 16-byte words (row_store.h, write_v4): a cache 8
    # bytes off a boundary raises naming `cache`, before any byte is written.
    x, cache, slots, page_slots = to_backend(backend, _args())
    buffer = torch.full((cache.numel() + 8,), 5, dtype=torch.uint8, device=cache.device)
    shifted = buffer[8:].view(cache.shape)
    with pytest.raises(ValueError, match="`cache` must start on a 16-byte boundary"):
        quantize_fp8_ds_mla(x, shifted, slots, page_slots, impl="header")
    assert bool((buffer == 5).all())


@pytest.mark.parametrize("impl", ["header", "triton"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_infinities_saturate_to_448(backend, impl):
    # A block holding +-inf: amax = inf gives e = 120 (scale byte 247), inf * 2^-120 saturates to
    # +-448 (0x7E / 0xFE) and the finite values underflow to signed zeros (0x00 / 0x80): the software
    # encoder and the hardware convert (cvt.rn.satfinite, sm_89+) agree here. The other blocks and
    # the RoPE dims are the reference's bytes.
    if impl == "triton":
        skip_unless_triton_runs(backend)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(7))
    x[:, 64:128] = torch.tensor([1.0, -1.0]).repeat(32)
    x[0, 64], x[0, 65], x[1, 127] = float("inf"), float("-inf"), float("-inf")
    cache, slots, page_slots = torch.full((2, V4.page_bytes(2)), 5, dtype=torch.uint8), torch.tensor([3, 0]), 2
    expected = cache.clone()
    ref.quantize_fp8_ds_mla(x.masked_fill(x.isinf(), 0.0), expected, slots, page_slots)
    pages, in_page = slots // page_slots, slots % page_slots
    codes = torch.tensor([0x00, 0x80], dtype=torch.uint8).repeat(32).repeat(2, 1)
    codes[0, 0], codes[0, 1], codes[1, 63] = 0x7E, 0xFE, 0xFE
    V4.value_view(expected, page_slots)[pages, in_page, 64:128] = codes
    V4.scale_view(expected, page_slots)[pages, in_page, 1] = 247
    x, got, slots = to_backend(backend, [x, cache, slots])
    quantize_fp8_ds_mla(x, got, slots, page_slots, impl=impl)
    assert torch.equal(got.cpu(), expected)


def test_dequantize_rejects_out_of_range_slots(backend, index_checks):
    _, cache, _, page_slots = to_backend(backend, _args())
    with pytest.raises(IndexError, match="`slots`"):
        dequantize_fp8_ds_mla(cache, torch.tensor([4], device=cache.device), page_slots)


# ---- plain indexer keys (no norm, no RoPE) ----

FORMATS = sorted(INDEXER_LAYOUTS)


def _indexer_noise_cache(fmt: str, pages: int, page_slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, INDEXER_LAYOUTS[fmt].page_bytes(page_slots)), dtype=torch.uint8,
                         generator=gen)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@settings(max_examples=scaled_examples(10), deadline=None)
@given(data=st.data())
def test_indexer_keys_bytes_equal_the_reference(backend, fmt, dtype, data):
    # Blocks of 32 (the FP4 scale block) drawn at the rounding edges: zeros, amax below the floor, ties.
    keys = data.draw(quant_rows(width=128, block=32)).to(dtype)
    page_slots, pages, slots = data.draw(slot_case(keys.shape[0]))
    cache = _indexer_noise_cache(fmt, pages, page_slots, data.draw(st.integers(0, 1000)))
    expected = cache.clone()
    ref.quantize_indexer_keys(keys, expected, slots, page_slots, fmt)
    device = device_of(backend)
    got = cache.to(device)
    quantize_indexer_keys(keys.to(device), got, slots.to(device), page_slots=page_slots, fmt=fmt)
    # Bytes outside the written slots keep their noise.
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_indexer_header_refuses_a_cache_off_a_4_byte_boundary(backend, fmt):
    # The header writes each indexer record in 16- or 4-byte words (row_store.h, write_indexer): a
    # cache 2 bytes off a 4-byte boundary raises naming `cache`, before any byte is written.
    device = device_of(backend)
    page_bytes = INDEXER_LAYOUTS[fmt].page_bytes(2)
    buffer = torch.full((2 * page_bytes + 2,), 5, dtype=torch.uint8, device=device)
    shifted = buffer[2:].view(2, page_bytes)
    keys, slots = torch.randn(3, 128, device=device), torch.tensor([0, 3, 1], device=device)
    with pytest.raises(ValueError, match="`cache` must start on a 4-byte boundary"):
        quantize_indexer_keys(keys, shifted, slots, page_slots=2, fmt=fmt)
    assert bool((buffer == 5).all())


@st.composite
def _keys_with_amax_near_powers_of_two(draw) -> torch.Tensor:
    """float32 ``[N, 128]`` keys whose amax is a few ulps from ``2^k`` (small and tiny k) or from the 1e-4 floor."""
    n = draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(n, 128, generator=gen)
    keys = keys / keys.abs().amax(dim=1, keepdim=True) * 0.99
    for row in range(n):
        ulps = draw(st.integers(-4, 4))
        base = np.float32(ref.FP8_AMAX_FLOOR) if draw(st.booleans()) else np.float32(2.0 ** draw(st.integers(-24, 12)))
        amax = float((np.array(base).view(np.int32) + np.int32(ulps)).view(np.float32))
        keys[row] *= amax
        keys[row, draw(st.integers(0, 127))] = amax * draw(st.sampled_from([1.0, -1.0]))
    return keys


@settings(max_examples=scaled_examples(15), deadline=None)
@given(keys=_keys_with_amax_near_powers_of_two())
def test_fp8_indexer_scale_and_codes_are_ieee_divisions(backend, keys):
    # The spec, independently of the torch reference: s = max(amax, 1e-4f) / 448.0f and code = e4m3(x / s),
    # IEEE float32 divisions (numpy's), never multiplies by a rounded reciprocal.
    n = keys.shape[0]
    device = device_of(backend)
    cache = torch.zeros(n, INDEXER_LAYOUTS["fp8"].page_bytes(1), dtype=torch.uint8, device=device)
    quantize_indexer_keys(keys.to(device), cache, torch.arange(n, device=device), page_slots=1, fmt="fp8")
    records = cache.cpu()
    x = keys.numpy()
    scale = np.maximum(np.abs(x).max(axis=1), np.float32(ref.FP8_AMAX_FLOOR)) / np.float32(ref.E4M3_MAX)
    assert np.array_equal(records[:, 128:].contiguous().view(torch.float32).flatten().numpy().view(np.uint32),
                          scale.view(np.uint32))
    codes = torch.from_numpy(x / scale[:, None]).clamp(-ref.E4M3_MAX, ref.E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(records[:, :128], codes.view(torch.uint8))


def _quantization_bound(keys: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half a code step at each key's magnitude: e4m3 (3 mantissa bits, subnormal step 2^-9 of the scale)
    or e2m1 (grid 0, .5, 1, 1.5, 2, 3, 4, 6 of the block's power-of-two scale)."""
    x = keys.double()
    if fmt == "fp8":
        scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-4) / 448
        return x.abs() * 2.0**-4 + scale * 2.0**-10
    amax = x.reshape(-1, 4, 32).abs().amax(dim=2).clamp_min(6 * 2.0**-126)
    scale = torch.ldexp(torch.ones_like(amax), ref.ceil_scale_exponent(amax.float(), 6.0).to(torch.int64))
    return x.abs() / 4 + scale.repeat_interleave(32, dim=1) / 4


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=scaled_examples(8), deadline=None)
@given(data=st.data())
def test_indexer_keys_round_trip_through_the_indexer_scores(backend, fmt, data):
    page_slots = data.draw(st.sampled_from([1, 4, 16]))
    n = data.draw(st.integers(1, 40))
    pages = -(-n // page_slots) + data.draw(st.integers(0, 2))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(n, 128, generator=gen) * 2.0 ** data.draw(st.integers(-8, 8))
    heads = data.draw(st.integers(1, 4))
    q, weights = torch.randn(2, heads, 128, generator=gen), torch.rand(2, heads, generator=gen)
    page_table = torch.randperm(pages, generator=gen).to(torch.int32)[None].repeat(2, 1)
    slots = entry_slots(page_table[0], n, page_slots)
    # Row 0 sees every key, row 1 a drawn prefix (a raw position t sees (t + 1) // 4 entries).
    positions = torch.tensor([4 * n - 1, data.draw(st.integers(0, 4 * n - 1))])

    device = device_of(backend)
    cache = torch.zeros(pages, INDEXER_LAYOUTS[fmt].page_bytes(page_slots), dtype=torch.uint8, device=device)
    quantize_indexer_keys(keys.to(device), cache, slots.to(device), page_slots=page_slots, fmt=fmt)
    got = indexer_scores(*(t.to(device) for t in (q, weights, cache, page_table, positions)), page_slots=page_slots,
                         layout=fmt).cpu().double()

    # The reference's dequantized keys, within half a code step of the keys given.
    reference_cache = torch.zeros(pages, INDEXER_LAYOUTS[fmt].page_bytes(page_slots), dtype=torch.uint8)
    ref.quantize_indexer_keys(keys, reference_cache, slots, page_slots, fmt)
    dequantized = decode_indexer_keys(reference_cache, slots, page_slots, fmt)
    assert bool(((dequantized - keys.double()).abs() <= _quantization_bound(keys, fmt)).all())
    # The scores of those keys in fp64, within the indexer's documented 1e-5 of sum_h |w_h| |q_h| |k|.
    for b in range(2):
        visible = (int(positions[b]) + 1) // 4
        logits = q[b].double() @ dequantized[:visible].T
        expected = weights[b].double() @ logits.clamp_min(0)
        bound = (weights[b].double().abs() * q[b].double().norm(dim=1)).sum() * dequantized.norm(dim=1).max()
        assert bool(((got[b, :visible] - expected).abs() <= 1e-5 * bound + 1e-30).all())
        assert bool((got[b, visible:] == float("-inf")).all())


def _indexer_args(fmt: str = "fp8"):
    cache = torch.full((2, INDEXER_LAYOUTS[fmt].page_bytes(2)), 5, dtype=torch.uint8)
    return torch.randn(3, 128), cache, torch.tensor([0, 3, 1]), 2, fmt


# The keys are named `keys`, as the caller passes them (the entry once named them `x`).
INDEXER_BAD = [
    (lambda x, c, s, p, f: (x.double(), c, s, p, f), TypeError, "keys"),
    (lambda x, c, s, p, f: (x.half(), c, s, p, f), TypeError, "keys"),
    (lambda x, c, s, p, f: (x[:, :64], c, s, p, f), ValueError, "keys"),
    (lambda x, c, s, p, f: (torch.randn(3, 512), c, s, p, f), ValueError, "keys"),
    (lambda x, c, s, p, f: (x.t().contiguous().t(), c, s, p, f), ValueError, "keys"),
    (lambda x, c, s, p, f: (x, c, s[:2], p, f), ValueError, "slots"),
    (lambda x, c, s, p, f: (x, c, s.to(torch.int32), p, f), TypeError, "slots"),
    (lambda x, c, s, p, f: (x, c, torch.tensor([0, 4, 1]), p, f), IndexError, "slots"),
    (lambda x, c, s, p, f: (x, c, torch.tensor([0, -1, 1]), p, f), IndexError, "slots"),
    (lambda x, c, s, p, f: (x, c, torch.tensor([0, 1, 1]), p, f), ValueError, "slots"),
    (lambda x, c, s, p, f: (x, c, s, 3, f), ValueError, "page_slots"),
    (lambda x, c, s, p, f: (x, c, s, 2**21, f), ValueError, "page_slots"),
    (lambda x, c, s, p, f: (x, c, s, 2.0, f), TypeError, "page_slots"),
    (lambda x, c, s, p, f: (x, c, s, 4, f), ValueError, "cache"),
    (lambda x, c, s, p, f: (x, c, s, p, "fp4" if f == "fp8" else "fp8"), ValueError, "cache"),
    (lambda x, c, s, p, f: (x, c.to(torch.int8), s, p, f), TypeError, "cache"),
    (lambda x, c, s, p, f: (x, c[:, :-1], s, p, f), ValueError, "cache"),
    (lambda x, c, s, p, f: (x, c, s, p, "e4m3"), ValueError, "fmt"),
    (lambda x, c, s, p, f: (x, c, s, p, None), TypeError, "fmt"),
    # The keys read from the bytes the call writes.
    (lambda x, c, s, p, f: (c.view(torch.float32)[:, :128], c, s[:2], p, f), ValueError, "cache"),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mutate, exc, name", INDEXER_BAD)
def test_indexer_keys_bad_input_raises_naming_the_argument_and_leaves_the_cache(backend, index_checks, fmt, mutate,
                                                                                exc, name):
    x, cache, slots, page_slots, fmt = to_backend(backend, _indexer_args(fmt))
    before = cache.clone()
    keys, target, slots, page_slots, fmt = to_backend(backend, mutate(x, cache, slots, page_slots, fmt))
    with pytest.raises(exc, match=f"`{name}`"):
        quantize_indexer_keys(keys, target, slots, page_slots=page_slots, fmt=fmt)
    assert torch.equal(cache, before)

"""The Triton twin of the ``fp8_ds_mla`` quantizer (``impl="triton"``): bytes equal to the torch byte
oracle and to the header on identical inputs (bit-exact, both input dtypes, packed word stores and the
byte stores of an unaligned cache), bytes outside the written slots untouched. On CPU tensors it runs
under the Triton interpreter (``tests/conftest.py``). The refusals of bad input are compared in
``test_dsv4_quant.py`` (parametrized by ``impl``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsekv.jit_kernel.dsv4_quant import quantize_fp8_ds_mla
from sparsekv.kv_layout import V4
from sparsekv.testing.backends import to_backend, triton_examples
from sparsekv.testing.reference import dsv4_quant as ref
from sparsekv.testing.strategies.dsv4_quant import quant_rows, slot_case

pytestmark = pytest.mark.usefixtures("triton_runs_here")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from sparsekv.jit_kernel.triton.dsv4_quant import encode_e4m3  # noqa: E402  (imports triton)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, FP8_HW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, encode_e4m3(x, FP8_HW).to(tl.uint8), mask=i < n)


def _encode(x: torch.Tensor, hardware: bool) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _encode_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), FP8_HW=hardware, BLOCK=256)
    return out


def _noise_cache(pages: int, page_slots: int, seed: int, offset: int) -> torch.Tensor:
    """A ``[pages, page_bytes]`` cache of random bytes, starting ``offset`` bytes into its buffer."""
    gen = torch.Generator().manual_seed(seed)
    page_bytes = V4.page_bytes(page_slots)
    buffer = torch.randint(0, 256, (pages * page_bytes + offset,), dtype=torch.uint8, generator=gen)
    return buffer[offset:].view(pages, page_bytes)


@settings(max_examples=triton_examples())
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), offset=st.sampled_from([0, 0, 1, 2]))
def test_triton_bytes_equal_the_reference_and_the_header(backend, data, dtype, offset):
    # offset 0: the packed 32-bit stores; 1 and 2: a cache whose base is not word-aligned (byte stores).
    x = data.draw(quant_rows(max_rows=6)).to(dtype)
    page_slots, pages, slots = data.draw(slot_case(x.shape[0]))
    cache = _noise_cache(pages, page_slots, data.draw(st.integers(0, 1000)), offset)
    expected = cache.clone()
    ref.quantize_fp8_ds_mla(x, expected, slots, page_slots)
    x, slots, got, header = to_backend(backend, [x, slots, cache, cache.clone()])
    quantize_fp8_ds_mla(x, got, slots, page_slots, impl="triton")
    quantize_fp8_ds_mla(x, header, slots, page_slots, impl="header")
    # Bytes outside the written slots (other slots, page padding) keep their noise.
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got.cpu(), header.cpu())


def test_triton_edge_codes_equal_the_header(backend):
    # Every e4m3 code and every midpoint between neighbours (ties to even both ways), at scale 1 (each
    # block's first value is 448, so e = 0) and, in the second row, below the amax floor (subnormal
    # results); signed zeros; bf16 ties in the RoPE dims.
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    values = torch.cat([codes, (codes[:-1] + codes[1:]) / 2, -codes[1:], torch.tensor([-0.0])])
    values = torch.cat([values, torch.zeros(7 * 63 - values.numel(), dtype=torch.float64)]).view(7, 63)
    x = torch.zeros(2, 512, dtype=torch.float64)
    x[0, :448] = torch.cat([torch.full((7, 1), 448.0, dtype=torch.float64), values], 1).flatten()
    x[1, :448] = values.flatten().repeat(2)[:448] * 2.0**-40
    x[:, 448:] = 1 + torch.arange(64) * 2.0**-7 + 2.0**-8  # halfway between bf16 neighbours
    x = x.float()
    slots = torch.tensor([1, 0])
    x, slots, got, header = to_backend(backend, [x, slots, torch.zeros(1, V4.page_bytes(2), dtype=torch.uint8),
                                                 torch.zeros(1, V4.page_bytes(2), dtype=torch.uint8)])
    quantize_fp8_ds_mla(x, got, slots, 2, impl="triton")
    quantize_fp8_ds_mla(x, header, slots, 2, impl="header")
    expected = torch.zeros(1, V4.page_bytes(2), dtype=torch.uint8)
    ref.quantize_fp8_ds_mla(x.cpu(), expected, slots.cpu(), 2)
    assert torch.equal(got.cpu(), expected) and torch.equal(header.cpu(), expected)


def test_the_e4m3_encoder_on_special_values(backend):
    # The twins' e4m3 encoder (the header's fp8::float_to_e4m3 writes the same): ties to even on the
    # normal and the subnormal grid, +-448 for finite values past it and for infinities, signed
    # zeros, and every NaN as 0x7F, the hardware convert's canonical NaN (its sign dropped: torch's
    # cast keeps it). On a GPU of capability 8.9 or later the convert instruction (FP8_HW) gives the
    # same code for each of them and for random float32 bit patterns (NaN payloads and subnormals).
    bits = [(0x7FC00000, 0x7F), (0xFFC00000, 0x7F), (0x7F800001, 0x7F), (0xFF800001, 0x7F), (0x7F800000, 0x7E),
            (0xFF800000, 0xFE), (0x80000000, 0x80), (0x00000001, 0x00), (0x80000001, 0x80)]
    values = [(0.0, 0x00), (448.0, 0x7E), (-448.0, 0xFE), (464.0, 0x7E), (464.5, 0x7E), (-1e30, 0xFE),
              (2.0**-10, 0x00), (-(2.0**-10), 0x80), (3 * 2.0**-10, 0x02), (2.0**-9, 0x01), (15 * 2.0**-10, 0x08),
              (2.0**-6, 0x08), (1.0, 0x38), (1.0625, 0x38), (1.1875, 0x3A), (-1.125, 0xB9)]
    x = torch.cat([torch.tensor([b for b, _ in bits], dtype=torch.int64).to(torch.int32).view(torch.float32),
                   torch.tensor([v for v, _ in values], dtype=torch.float32)])
    expected = torch.tensor([c for _, c in bits + values], dtype=torch.uint8)
    (x,) = to_backend(backend, [x])
    assert torch.equal(_encode(x, hardware=False).cpu(), expected)
    if x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9):
        assert torch.equal(_encode(x, hardware=True).cpu(), expected)
        noise = torch.randint(-(2**31), 2**31, (1 << 16,), dtype=torch.int64,
                              generator=torch.Generator().manual_seed(0))
        noise = noise.to(torch.int32).view(torch.float32).to(x.device)
        assert torch.equal(_encode(noise, hardware=True), _encode(noise, hardware=False))

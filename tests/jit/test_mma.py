"""The warp MMA and the fp8 convert of ``csrc/include/sparsekv/mma.h``, through the probes of
``tests/jit/data/mma_probe.cuh``: on sim (and cuda on a GPU), one m16n8k16 product on registers this
test lays out from its own statement of the PTX ISA's fragment layout equals the float64 matmul;
the e4m3 pair convert equals torch's float8_e4m3fn decode times the scale, rounded to bf16; and
nvcc compiles them to tensor-core HMMA and the hardware F2FP converts for sm_90a and sm_100a."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsekv.jit_kernel.build import cache, loader
from sparsekv.testing.backends import device_of, kernel_backends
from sparsekv.testing.components import needs
from sparsekv.testing.sass import disassemble, missing_sass_tools

HERE = Path(__file__).resolve().parent
PROBE = "mma_probe.cuh"
EXPORTS = {"product": "sparsekv::mma_probe::product", "convert": "sparsekv::mma_probe::convert",
           "ldmatrix": "sparsekv::mma_probe::ldmatrix"}
KERNELS = ("sparsekv::mma_probe::Product", "sparsekv::mma_probe::Convert", "sparsekv::mma_probe::Ldmatrix")
# The probes have no cpu path: sim always (marked core, as core_backends marks it, so CI's sim stage
# does not run it twice), cuda on a GPU.
BACKENDS = [pytest.param("sim", marks=pytest.mark.core)] + (["cuda"] if "cuda" in kernel_backends() else [])


def _plan(root: Path, backend: str, arch):
    csrc = root / "csrc"
    if not csrc.exists():
        shutil.copytree(loader.csrc_root(), csrc)
        shutil.copy(HERE / "data" / PROBE, csrc / PROBE)
    return loader.make_plan("mma_probe", (), header=PROBE, exports=EXPORTS, kernels=KERNELS, backend=backend,
                            arch=arch, probe_dir=None, csrc=csrc)


@pytest.fixture(scope="module")
def probe_root(tmp_path_factory):
    return tmp_path_factory.mktemp("mma-probe")


@pytest.fixture(scope="module")
def modules(probe_root):
    built = {}

    def get(backend):
        if backend not in built:
            built[backend] = loader.find_or_build(_plan(probe_root, backend, None), cache.open_roots())
        return built[backend]

    return get


# The PTX ISA's m16n8k16 .bf16 layout, stated here independently of the header: lane = 4 g + t;
# the low 16 bits of a register hold the element of the lower column (row, for B).
def _a_position(lane: int, reg: int, half: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return g + 8 * (reg % 2), 2 * t + half + 8 * (reg // 2)


def _b_position(lane: int, reg: int, half: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return 2 * t + half + 8 * reg, g


def _c_position(lane: int, i: int) -> tuple[int, int]:
    g, t = divmod(lane, 4)
    return g + 8 * (i // 2), 2 * t + i % 2


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def _registers(matrix: torch.Tensor, regs: int, position) -> torch.Tensor:
    bits = _bf16_bits(matrix)
    out = torch.zeros(32, regs, dtype=torch.int64)
    for lane in range(32):
        for reg in range(regs):
            low, high = (bits[position(lane, reg, half)] for half in (0, 1))
            out[lane, reg] = low | (high << 16)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _matrix(draw, rows: int, cols: int, scale: float) -> torch.Tensor:
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * scale).to(torch.bfloat16).to(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data(), a_scale=st.sampled_from([1.0, 1e-3, 300.0]), b_scale=st.sampled_from([1.0, 2.0**-20]))
def test_one_warp_product_in_the_ptx_fragment_layout_equals_the_matmul(modules, backend, data, a_scale, b_scale):
    a, b = _matrix(data.draw, 16, 16, a_scale), _matrix(data.draw, 16, 8, b_scale)
    c = _matrix(data.draw, 16, 8, a_scale * b_scale)
    d = torch.tensor([[c[_c_position(lane, i)] for i in range(4)] for lane in range(32)], dtype=torch.float32)
    device = device_of(backend)
    a_regs, b_regs, d = (t.to(device) for t in (_registers(a, 4, _a_position), _registers(b, 2, _b_position), d))
    modules(backend).product(a_regs, b_regs, d)
    got = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        for i in range(4):
            got[_c_position(lane, i)] = float(d[lane, i])
    expected = a.double() @ b.double() + c.double()
    # bf16 products are exact; the sum is rounded to float (once on sim, a few times on the GPU).
    bound = 4 * 2.0**-24 * ((a.double().abs() @ b.double().abs()) + c.double().abs())
    assert bool(((got - expected).abs() <= bound).all()), (got - expected).abs().max()


@pytest.mark.core
def test_a_swapped_fragment_register_gives_a_different_product(modules):
    # The layout is observable: A's registers 1 and 2 exchanged (rows g+8 and columns 2t+8 swapped)
    # is another product, so the sim implementation reads the layout rather than any fixed order.
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 16, generator=g).bfloat16().float(), torch.randn(16, 8, generator=g).bfloat16().float()
    a_regs = _registers(a, 4, _a_position)
    swapped = a_regs[:, [0, 2, 1, 3]].contiguous()
    results = []
    for regs in (a_regs, swapped):
        d = torch.zeros(32, 4)
        modules("sim").product(regs, _registers(b, 2, _b_position), d)
        results.append(d)
    expected = a.double() @ b.double()
    assert torch.allclose(torch.tensor([[expected[_c_position(lane, i)] for i in range(4)] for lane in range(32)]),
                          results[0].double(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(results[0], results[1], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**31 - 1))
def test_ldmatrix_gives_the_a_fragment_and_its_transpose_the_b_fragments(modules, backend, seed):
    # Lanes name the rows of an A fragment (matrix i = rows 8 (i % 2), columns 8 (i // 2)): the plain
    # load is the A fragment of the tile; the transposed one gives lane 4 g + t elements (2t, g) and
    # (2t + 1, g) of each 8 x 8 matrix, i.e. the B fragments of the tile's blocks read as K x N.
    g = torch.Generator().manual_seed(seed)
    tile = torch.randn(16, 16, generator=g).bfloat16().float()
    device = device_of(backend)
    loaded = torch.zeros(2, 32, 4, dtype=torch.int32, device=device)
    modules(backend).ldmatrix(_bf16_bits(tile).to(torch.int16).to(device), loaded)
    loaded = loaded.cpu()
    assert torch.equal(loaded[0], _registers(tile, 4, _a_position))
    for i in range(4):
        block = tile[8 * (i % 2):8 * (i % 2) + 8, 8 * (i // 2):8 * (i // 2) + 8]
        # As the low register of a B fragment of a 16 x 8 matrix whose rows 0-7 are this block.
        expected = _registers(torch.cat([block, torch.zeros(8, 8)]), 2, _b_position)[:, 0]
        assert torch.equal(loaded[1, :, i], expected), i


@pytest.mark.parametrize("backend", BACKENDS)
@given(exponent=st.integers(-40, 40), seed=st.integers(0, 2**31 - 1))
def test_the_e4m3_pair_convert_is_the_exact_scaled_value_in_bf16(modules, backend, exponent, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (512,), generator=g, dtype=torch.int64)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN codes: checked below
    codes = codes[: codes.numel() // 2 * 2].reshape(-1, 2)
    pairs = (codes[:, 0] | (codes[:, 1] << 8)).to(torch.int64)
    pairs = torch.where(pairs >= 2**15, pairs - 2**16, pairs).to(torch.int16)
    scales = torch.full((pairs.numel(),), 2.0**exponent)
    device = device_of(backend)
    out = torch.zeros(pairs.numel(), dtype=torch.int32, device=device)
    modules(backend).convert(pairs.to(device), scales.to(device), out)
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * 2.0**exponent
    expected = _bf16_bits(values)  # exact: e4m3 times 2^e is a bf16 at these exponents
    got = out.cpu().to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(got & 0xFFFF, expected[:, 0]) and torch.equal(got >> 16, expected[:, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_e4m3_nan_converts_to_a_bf16_nan(modules, backend):
    device = device_of(backend)
    pairs = torch.tensor([0x7F | (0xFF << 8) - 2**16, 0x387F], dtype=torch.int16)  # (NaN, -NaN), (NaN, 1.0)
    out = torch.zeros(2, dtype=torch.int32, device=device)
    modules(backend).convert(pairs.to(device), torch.ones(2, device=device), out)
    halves = torch.stack([out.cpu() & 0xFFFF, (out.cpu() >> 16) & 0xFFFF], 1).to(torch.int16).view(torch.bfloat16)
    assert bool(halves[0].float().isnan().all()) and bool(halves[1, 0].float().isnan())
    assert float(halves[1, 1]) == 1.0


@needs("nvcc and cuobjdump", missing_sass_tools())
def test_nvcc_compiles_the_product_to_hmma_the_loads_to_ldsm_and_the_convert_to_f2fp(probe_root):
    plan = _plan(probe_root, "cuda", ("9.0a", "10.0a"))
    roots = cache.open_roots()
    so = cache.build_and_publish(roots, plan.entry_name(), plan.key_doc(),
                                 lambda staging: loader.build_module(plan, staging), lambda path: path)
    kernels = disassemble(so)
    for sm in ("sm_90a", "sm_100a"):
        product = [k for (arch, name), k in kernels.items() if arch == sm and "product_kernel" in name]
        convert = [k for (arch, name), k in kernels.items() if arch == sm and "Convert" in name]
        loads = [k for (arch, name), k in kernels.items() if arch == sm and "ldmatrix_kernel" in name]
        assert len(product) == 1 and len(convert) == 1 and len(loads) == 1, sorted(kernels)
        assert sorted(op for op in loads[0].opcodes if op.startswith("LDSM")) == ["LDSM.16.M88.4", "LDSM.16.MT88.4"]
        assert [op for op in product[0].opcodes if op.startswith("HMMA")] == ["HMMA.16816.F32.BF16"], sm
        converts = [op for op in convert[0].opcodes if op.startswith("F2FP")]
        assert any("E4M3" in op for op in converts) and any("BF16" in op for op in converts), (sm, converts)
        assert product[0].stack == 0 and convert[0].stack == 0

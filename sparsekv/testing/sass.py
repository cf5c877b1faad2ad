"""What a compiled kernel's SASS says, without a GPU: read with ``cuobjdump`` (triton's wheel ships it).

:func:`disassemble` reads a cubin (the Triton AOT build's) or a shared library with embedded fat
binaries (the nvcc build of a header) into one :class:`KernelSass` per (arch, kernel): registers,
stack, shared and local memory, and the instructions. :data:`PROPERTIES` are the checks of issue
36's SASS table, each a function of a :class:`KernelSass` (and the launch's threads and intended
CTAs per SM) returning ``(holds, detail)``; ``tests/jit/test_sass.py`` holds every hot kernel to
them, and ``tools/sass_budget.py`` prints each kernel's instruction budget.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PROPERTIES", "KernelSass", "Launch", "ctas_per_sm", "cuda_artifact", "disassemble", "find_tool",
           "inner_loop", "missing_sass_tools"]


def find_tool(name: str) -> str | None:
    """``cuobjdump`` / ``nvdisasm``: triton's wheel's copy, else ``$CUDA_HOME/bin``, else PATH (None: none)."""
    spec = importlib.util.find_spec("triton")
    places = []
    if spec is not None and spec.origin:
        places.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name)
    if os.environ.get("CUDA_HOME"):
        places.append(Path(os.environ["CUDA_HOME"]) / "bin" / name)
    for place in places:
        if place.is_file() and os.access(place, os.X_OK):
            return str(place)
    return shutil.which(name)


@dataclass
class KernelSass:
    """One kernel's SASS for one arch: resources (from ``cuobjdump -res-usage``) and instructions."""

    arch: str
    name: str
    registers: int = 0
    stack: int = 0
    shared: int = 0
    local: int = 0
    #: Opcodes with their modifiers, in program order (predicates dropped): ``"LDG.E.128"``, ...
    opcodes: list[str] = field(default_factory=list)
    #: Each instruction's address, in bytes, parallel to :attr:`opcodes`.
    addresses: list[int] = field(default_factory=list)
    #: Branch targets, ``(address of the branch, address it jumps to)``.
    branches: list[tuple[int, int]] = field(default_factory=list)


_ARCH = re.compile(r"^arch = (sm_\w+)")
_FUNCTION_SASS = re.compile(r"^\s*Function : (\S+)")
_FUNCTION_RES = re.compile(r"^\s*Function (\S+):")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def missing_sass_tools() -> str | None:
    """Why SASS cannot be produced and read here (nvcc or ``cuobjdump`` missing), or None."""
    from sparsekv.jit_kernel.build import toolchain

    if find_tool("cuobjdump") is None:
        return "cuobjdump is not installed (it comes with triton's wheel)"
    try:
        toolchain.nvcc(None)
    except toolchain.ToolchainError as exc:
        return f"nvcc: {exc}"
    return None


def disassemble(binary: Path | str) -> dict[tuple[str, str], KernelSass]:
    """Every kernel of ``binary`` (a cubin, or a library with fat binaries), keyed by ``(arch, name)``.

    Raises
    ------
    RuntimeError
        ``cuobjdump`` is missing or cannot read ``binary``.
    """
    tool = find_tool("cuobjdump")
    if tool is None:
        raise RuntimeError("sparsekv: cuobjdump not found (install triton, or set CUDA_HOME)")
    kernels: dict[tuple[str, str], KernelSass] = {}

    def run(flag: str) -> list[str]:
        done = subprocess.run([tool, flag, str(binary)], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"sparsekv: cuobjdump {flag} {binary} failed: {done.stderr.strip()[:400]}")
        return done.stdout.splitlines()

    arch = _arch_of_cubin(binary)
    current = None
    for line in run("-res-usage"):
        if m := _ARCH.match(line.strip()):
            arch = m.group(1)
        elif m := _FUNCTION_RES.match(line):
            current = kernels.setdefault((arch, m.group(1)), KernelSass(arch, m.group(1)))
        elif current is not None and (m := _RESOURCES.search(line)):
            current.registers, current.stack, current.shared, current.local = (int(g) for g in m.groups())
    arch = _arch_of_cubin(binary)
    current = None
    for line in run("-sass"):
        if m := _ARCH.match(line.strip()):
            arch = m.group(1)
        elif m := _FUNCTION_SASS.match(line):
            current = kernels.setdefault((arch, m.group(1)), KernelSass(arch, m.group(1)))
        elif current is not None and (m := _INSTRUCTION.match(line)):
            address, opcode, operands = int(m.group(1), 16), m.group(2), m.group(3)
            current.opcodes.append(opcode)
            current.addresses.append(address)
            if opcode.startswith(("BRA", "BRX")) and (t := _TARGET.search(operands.strip())):
                current.branches.append((address, int(t.group(1), 16)))
    return kernels


def _arch_of_cubin(binary: Path | str) -> str:
    """A bare cubin's arch, from the ELF header's flags (cuobjdump prints no ``arch =`` line for it)."""
    data = Path(binary).read_bytes()[:0x40]
    if data[:4] != b"\x7fELF" or len(data) < 0x34:
        return "unknown"
    flags = int.from_bytes(data[0x30:0x34], "little")
    for sm in (100, 90, 120, 89, 80):  # EF_CUDA_SM<n> sits in the low 16 bits, or bits 8-15 in newer ABIs
        if flags & 0xFFFF == sm or (flags >> 8) & 0xFF == sm:
            return f"sm_{sm}a" if sm in (90, 100) else f"sm_{sm}"
    return "unknown"


@dataclass(frozen=True)
class Launch:
    """How a kernel is launched: threads per CTA and the CTAs per SM its design intends."""

    threads: int
    ctas_per_sm: int = 1
    #: Byte stores of one-byte flags the kernel's contract writes besides its records (``wide_store``).
    flag_stores: int = 0


#: Per-SM limits of sm_90 and sm_100: 64K 32-bit registers, 228 KiB shared memory (1 KiB of it per
#: CTA reserved by the driver), 2048 threads, 32 CTAs.
SM_REGISTERS, SM_SHARED, SM_THREADS, SM_CTAS = 65536, 228 * 1024, 2048, 32


def ctas_per_sm(kernel: KernelSass, threads: int) -> int:
    """CTAs of ``threads`` threads one SM holds at once, by registers (allocated per warp in units of
    256), shared memory and threads."""
    warps = -(-threads // 32)
    per_warp = -(-max(kernel.registers, 1) * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * warps)
    by_shared = SM_SHARED // (kernel.shared + 1024)
    return min(by_registers, by_shared, SM_THREADS // threads, SM_CTAS)


# Global loads and stores (LDG / STG), and generic ones (LD / ST: what nvcc emits for a pointer it
# cannot prove global, such as the copies' per-layer base addresses read from a table).
_WIDE_LOADS = re.compile(r"^((LDG|LD)\.\S*(64|128)|LDGSTS|UTMALDG|UBLKCP|LDGDEPBAR)")
_BYTE_LOADS = re.compile(r"^(LDG|LD)\.(\S*\.)?[US]8(\.|$)")
_WIDE_STORES = re.compile(r"^(STG|ST)\.\S*(64|128)")
_NARROW_STORES = re.compile(r"^(STG|ST)\.(\S*\.)?[US](8|16)(\.|$)")
_TENSOR_CORES = re.compile(r"^(HGMMA|QGMMA|IGMMA|UTC\w*MMA|HMMA|QMMA|IMMA)")
_GMMA_SHAPE = re.compile(r"GMMA\.(\d+)x(\d+)x(\d+)")


def _no_local(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    spills = sum(op.startswith(("LDL", "STL")) for op in kernel.opcodes)
    return (kernel.stack == 0 and kernel.local == 0 and spills == 0,
            f"stack {kernel.stack} B, local {kernel.local} B, {spills} LDL/STL")


def _wide_gather(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    wide = sum(bool(_WIDE_LOADS.match(op)) for op in kernel.opcodes)
    byte = sum(bool(_BYTE_LOADS.search(op)) for op in kernel.opcodes)
    return wide > 0 and byte == 0, f"{wide} 8/16-byte or async loads, {byte} byte loads"


def _wide_store(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    # 4-byte stores (STG.E) pass: only byte and 2-byte stores, beyond the launch's flags, fail.
    wide = sum(bool(_WIDE_STORES.match(op)) for op in kernel.opcodes)
    narrow = sum(bool(_NARROW_STORES.match(op)) for op in kernel.opcodes)
    return wide > 0 and narrow <= launch.flag_stores, (f"{wide} 8/16-byte stores, {narrow} byte or 2-byte stores "
                                                        f"({launch.flag_stores} flag stores allowed)")


def _fp8_convert(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    converts = sum(op.startswith("F2FP") and "E4M3" in op for op in kernel.opcodes)
    return converts > 0, f"{converts} F2FP...E4M3"


def _fp8_encode(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    # The hardware encode from float32 (F2FP.SATFINITE.E4M3.F32.PACK_AB...), not the decode
    # (F2FP.F16.E4M3.UNPACK_B) that fp8_convert counts.
    encodes = sum(op.startswith("F2FP") and ".E4M3.F32" in op for op in kernel.opcodes)
    return encodes > 0, f"{encodes} F2FP...E4M3.F32 (float32 -> e4m3 pairs)"


def _tensor_cores(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    products = [op for op in kernel.opcodes if _TENSOR_CORES.match(op)]
    narrow = [op for op in products if (m := _GMMA_SHAPE.search(op)) and int(m.group(2)) < 16]
    shapes = sorted({m.group(0) for op in products if (m := _GMMA_SHAPE.search(op))})
    return bool(products) and not narrow, f"{len(products)} tensor-core ops {shapes or ''}, {len(narrow)} with N < 16"


def _occupancy(kernel: KernelSass, launch: Launch) -> tuple[bool, str]:
    fits = ctas_per_sm(kernel, launch.threads)
    return fits >= launch.ctas_per_sm, (f"{fits} CTAs/SM of {launch.threads} threads ({kernel.registers} registers, "
                                        f"{kernel.shared} B shared), {launch.ctas_per_sm} intended")


#: The properties of the SASS table, by name: ``check(kernel, launch) -> (holds, detail)``.
PROPERTIES: dict[str, Callable[[KernelSass, Launch], tuple[bool, str]]] = {
    "no_local": _no_local,
    "wide_gather": _wide_gather,
    "wide_store": _wide_store,
    "fp8_convert": _fp8_convert,
    "fp8_encode": _fp8_encode,
    "tensor_cores": _tensor_cores,
    "occupancy": _occupancy,
}


def inner_loop(kernel: KernelSass) -> list[str]:
    """The opcodes of the kernel's main inner loop: of the loops (backward branches, not a branch to
    itself) that hold no other loop, the longest; the whole kernel when it has no loop.

    A backward branch from a block nvcc placed after a loop (a rare path, out of line) into the
    middle of that loop is not a loop: its span starts inside another loop's and ends past it, and
    it would hold the code between the two (the kernel's epilogue), so such spans are left out.
    """
    backward = [(target, source) for source, target in kernel.branches if target < source]
    loops = [(a, b) for a, b in backward if not any(c < a <= d < b for c, d in backward)]
    innermost = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    if not innermost:
        return list(kernel.opcodes)
    start, end = max(innermost, key=lambda span: span[1] - span[0])
    return [op for op, at in zip(kernel.opcodes, kernel.addresses) if start <= at <= end]


def cuda_artifact(family_name: str, values: dict, archs: tuple[str, ...]) -> Path:
    """The nvcc-built library of one instance of a header family for ``archs``, built (or found in
    the JIT cache, whose key this is) first."""
    from sparsekv.jit_kernel.build import cache
    from sparsekv.jit_kernel.build.loader import make_plan
    from sparsekv.jit_kernel.build.registry import discover

    family = discover()[family_name]
    family.module(backend="cuda", arch=archs, **values)
    roots = cache.open_roots()
    plan = make_plan(family.name, family.template_args(values), header=family.header, exports=family.exports,
                     kernels=family.kernels, backend="cuda", arch=archs, probe_dir=roots.probe_dir())
    for root in roots.read:
        found = cache.valid_artifact(root / plan.entry_name())
        if found is not None:
            return found
    raise RuntimeError(f"sparsekv: {plan.describe()} was built but is not in the cache")

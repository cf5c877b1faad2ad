"""Ahead-of-time compile of every Triton kernel for CUDA archs, without a GPU (``sparsekv jit build --triton``).

Each Triton twin (:func:`triton_modules`: ``jit_kernel/triton/<stem>.py`` of a registered family)
lists its kernels' launch shapes in ``AOT_KERNELS`` (:class:`AotKernel`: one typed value per argument,
:class:`Pointer`, :class:`Int` at the benchmark's serving shape, :class:`Float` or :class:`Constexpr`,
and the warps of the configurations the launcher uses). Each is compiled as the JIT
compiles a launch with those arguments (:func:`specialization`): an integer argument equal to 1
becomes a constant, one divisible by 16 carries ``tt.divisibility = 16``, one past int32 is i64,
16-byte aligned pointers carry the divisibility too, and the stages and warps are the JIT's
(its default ``num_stages``, the launcher's ``num_warps``); ``tests/jit/test_triton_aot_jit.py``
holds the two to the same record. For each kernel and arch this compiles
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` down to a cubin and publishes
it, with its metadata, under ``<cache root>/.triton/<key>/``; the key is
the sha256 of the kernel's source (triton's ``cache_key``, which covers the functions it calls),
the signature, the constexprs, the warps, the arch and the triton version, so a change of any of
them compiles anew and nothing else does. Registers come from the cubin (``EIATTR_REGCOUNT`` of
its ``.nv.info`` sections), shared memory from triton's metadata.

Public triton API only (``triton.compile``, ``triton.compiler.ASTSource``,
``triton.backends.compiler.GPUTarget``): the same code runs on triton 3.6 and 3.9.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AotKernel", "Constexpr", "Float", "Int", "Pointer", "aot_kernels", "build", "compile_inputs",
           "cubin_registers", "specialization", "triton_modules"]

_SUBDIR = ".triton"


@dataclass(frozen=True)
class Pointer:
    """A tensor argument: its element type (triton's name: ``"fp32"``, ``"bf16"``, ``"u8"``, ``"i64"``,
    ``"u1"`` for bool) and whether the launcher's tensor is 16-byte aligned, which the JIT specializes on
    (a fresh torch allocation is; a table the launcher may get as a view at an offset is not assumed to be)."""

    dtype: str
    aligned: bool = True


@dataclass(frozen=True)
class Int:
    """An integer argument and its value at the benchmark's serving shape, which the JIT specializes on
    (:func:`specialization`)."""

    value: int


@dataclass(frozen=True)
class Float:
    """A float32 scalar argument (not specialized)."""


@dataclass(frozen=True)
class Constexpr:
    """A ``tl.constexpr`` argument and its value."""

    value: object


_ARGUMENT_TYPES = (Pointer, Int, Float, Constexpr)


def _int_type(value: int) -> str:
    """The type the JIT gives an integer argument: i32 when it fits, else i64 (u64 past that)."""
    return "i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63 else "u64"


@dataclass(frozen=True)
class AotKernel:
    """One launch configuration of a ``@triton.jit`` kernel, described by one typed value per argument.

    Attributes
    ----------
    name : str
        ``<stem>.<kernel>[config]``, unique.
    fn : object
        The ``triton.runtime.JITFunction``.
    arguments : Mapping[str, Pointer | Int | Float | Constexpr]
        Every argument of ``fn``, by name (no other): what the launcher passes at the benchmark's
        serving shape. The triton signature, the constexprs, the aligned pointers and the integer
        values are derived from it.
    num_warps : int
    options : dict
        Further compile options the launcher passes (e.g. ``enable_fp_fusion=False``).

    Raises
    ------
    ValueError
        ``arguments`` misses an argument of ``fn`` or names one it does not have.
    TypeError
        An argument is not described by one of the four types.
    """

    name: str
    fn: object
    arguments: Mapping[str, Pointer | Int | Float | Constexpr]
    num_warps: int = 4
    options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = list(self.fn.arg_names)
        missing = [n for n in names if n not in self.arguments]
        unknown = [n for n in self.arguments if n not in names]
        if missing or unknown:
            raise ValueError(f"sparsekv: AOT kernel {self.name}: `arguments` must describe exactly the kernel's "
                             f"arguments {names}; missing {missing}, unknown {unknown}")
        untyped = [n for n, a in self.arguments.items() if not isinstance(a, _ARGUMENT_TYPES)]
        if untyped:
            raise TypeError(f"sparsekv: AOT kernel {self.name}: arguments {untyped} must be a Pointer, Int, Float or "
                            f"Constexpr")

    @property
    def signature(self) -> dict[str, str]:
        """Argument name -> triton type (``"*u8"``, ``"i32"``, ``"fp32"``, ``"constexpr"``), in argument order."""
        kinds = {Pointer: lambda a: f"*{a.dtype}", Int: lambda a: _int_type(a.value), Float: lambda a: "fp32",
                 Constexpr: lambda a: "constexpr"}
        return {n: kinds[type(self.arguments[n])](self.arguments[n]) for n in self.fn.arg_names}

    @property
    def constexprs(self) -> dict[str, object]:
        """Values of the constexpr arguments."""
        return {n: a.value for n, a in self.arguments.items() if isinstance(a, Constexpr)}

    @property
    def aligned(self) -> tuple[str, ...]:
        """Pointer arguments assumed 16-byte aligned."""
        return tuple(n for n, a in self.arguments.items() if isinstance(a, Pointer) and a.aligned)

    @property
    def args(self) -> dict[str, int]:
        """Value of every integer argument at the serving shape: what the JIT specializes on."""
        return {n: a.value for n, a in self.arguments.items() if isinstance(a, Int)}


def triton_modules() -> list[str]:
    """The Triton twins of the registered kernel families: ``jit_kernel/triton/<stem>.py`` of every
    family stem that has one (each defines ``AOT_KERNELS``)."""
    from sparsekv.jit_kernel.build.registry import discover

    here = Path(__file__).resolve().parent
    return sorted({family.stem for family in discover().values() if (here / f"{family.stem}.py").is_file()})


def aot_kernels() -> list[AotKernel]:
    """Every kernel configuration of :func:`triton_modules`."""
    found = []
    for stem in triton_modules():
        found += importlib.import_module(f"sparsekv.jit_kernel.triton.{stem}").AOT_KERNELS
    return found


def _capability(arch: str) -> int:
    """``"9.0a"`` -> 90, ``"10.0a"`` -> 100 (triton targets the ``a`` variant of 9.0 and 10.0 itself)."""
    major, minor = arch.rstrip("af").split(".")
    return int(major) * 10 + int(minor)


def cache_key(kernel: AotKernel, arch: str) -> str:
    """sha256 over everything that changes the binary: source, signature, constexprs, warps, options, arch, triton."""
    import triton

    doc = {"kernel": kernel.name, "source": kernel.fn.cache_key, "signature": kernel.signature,
           "constexprs": {k: repr(v) for k, v in sorted(kernel.constexprs.items())}, "num_warps": kernel.num_warps,
           "aligned": list(kernel.aligned), "args": dict(sorted(kernel.args.items())), "arch": arch,
           "specialized": "jit", "triton": triton.__version__}
    if kernel.options:  # absent when empty: the keys of kernels without options stay what they were
        doc["options"] = {k: repr(v) for k, v in sorted(kernel.options.items())}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def cubin_registers(cubin: bytes) -> int:
    """Registers per thread of the kernel in a cubin (the largest ``EIATTR_REGCOUNT`` of its ``.nv.info``)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("sparsekv: not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]

    def name(sec) -> str:
        start = names_at + sec[0]
        return cubin[start:cubin.index(b"\0", start)].decode()

    registers = 0
    for sec in sections:
        if not name(sec).startswith(".nv.info"):
            continue
        at, end = sec[4], sec[4] + sec[5]
        while at + 2 <= end:
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 size, then the payload
                size, = struct.unpack_from("<H", cubin, at + 2)
                if attr == 0x2F and size >= 8:  # EIATTR_REGCOUNT: (function, registers)
                    registers = max(registers, struct.unpack_from("<II", cubin, at + 4)[1])
                at += 4 + size
            elif fmt in (0x01, 0x02, 0x03):  # no value, a byte, a half-word: 4 bytes in all
                at += 4
            else:
                break
    return registers


_DIVISIBLE = [["tt.divisibility", 16]]


def specialization(kernel: AotKernel) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of ``kernel`` as the JIT specializes a launch with its
    arguments: an integer of 1 is a constant, an integer's type is i32 when it fits, else i64 (u64
    past that), an integer divisible by 16 and an aligned pointer carry ``tt.divisibility = 16``;
    floats are not specialized. ``attrs`` hold, in argument order and keyed by argument path, what
    the JIT records: the divisibility, or no attribute (``[]``) for every other pointer, integer and
    constant argument; before triton 3.7 the JIT recorded nothing for a constant (a constexpr, or an
    integer of 1), so neither does this there."""
    import triton

    constants_have_attrs = tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 7)
    signature, constexprs, attrs = kernel.signature, kernel.constexprs, {}
    for position, name in enumerate(kernel.fn.arg_names):
        argument = kernel.arguments[name]
        if isinstance(argument, Float):
            continue  # not specialized, no attribute
        constant, divisible = isinstance(argument, Constexpr), False
        if isinstance(argument, Pointer):
            divisible = argument.aligned
        elif isinstance(argument, Int):
            if argument.value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                constant = True
            else:
                divisible = argument.value % 16 == 0
        if constant and not constants_have_attrs:
            continue
        attrs[(position,)] = _DIVISIBLE if divisible else []
    return signature, constexprs, attrs


def compile_inputs(kernel: AotKernel, arch: str) -> tuple:
    """``(source, target, options)``: what :func:`build` hands ``triton.compile`` for ``kernel`` on ``arch``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialization(kernel)
    source = ASTSource(kernel.fn, signature, constexprs=constexprs, attrs=attrs)
    # No num_stages: the launchers pass none, so the JIT takes the backend's default, and so does this.
    return source, GPUTarget("cuda", _capability(arch), 32), {"num_warps": kernel.num_warps, **kernel.options}


def _compile(kernel: AotKernel, arch: str):
    import triton

    source, target, options = compile_inputs(kernel, arch)
    return triton.compile(source, target=target, options=options)


def build(kernel: AotKernel, arch: str, root: Path) -> dict:
    """Compile ``kernel`` for ``arch`` unless ``root`` holds it; its report (registers, shared bytes, ...).

    Published atomically: a finished entry directory is renamed into place, so a racing or killed
    build never leaves a half-written entry behind.
    """
    key = cache_key(kernel, arch)
    final = root / _SUBDIR / key
    report = final / "report.json"
    if report.is_file():
        return dict(json.loads(report.read_text()), cached=True)
    compiled = _compile(kernel, arch)
    cubin = compiled.asm["cubin"]
    doc = {"kernel": kernel.name, "arch": arch, "key": key, "registers": cubin_registers(cubin),
           "shared_bytes": int(compiled.metadata.shared), "num_warps": kernel.num_warps,
           "num_stages": int(compiled.metadata.num_stages), "cubin_bytes": len(cubin)}
    staging = root / _SUBDIR / f".staging-{os.getpid()}-{key}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, mode=0o700)
    (staging / "kernel.cubin").write_bytes(cubin)
    (staging / "kernel.ptx").write_text(compiled.asm["ptx"])
    (staging / "report.json").write_text(json.dumps(doc, indent=2, sort_keys=True))
    try:
        os.rename(staging, final)
    except OSError:  # another build published the same key first: same inputs, same entry
        shutil.rmtree(staging, ignore_errors=True)
    return dict(doc, cached=False)

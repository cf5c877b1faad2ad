"""Ahead-of-time compile of every Triton kernel for CUDA archs, without a GPU (``sparsekv jit build --triton``).

Each Triton module lists its kernels' launch shapes in ``AOT_KERNELS`` (:class:`AotKernel`: the
argument types, the values of the integer arguments at the benchmark's serving shape, the
constexprs and the warps of the configurations the launcher uses). Each is compiled as the JIT
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
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AotKernel", "TRITON_MODULES", "aot_kernels", "build", "compile_inputs", "cubin_registers",
           "specialization"]

#: Modules (under ``sparsekv.jit_kernel.triton``) whose ``AOT_KERNELS`` are compiled.
TRITON_MODULES = ("dsv4_attention", "dsv4_compress", "dsv4_compress_store", "dsv4_indexer", "dsv4_quant",
                  "dsv4_store")
_SUBDIR = ".triton"


@dataclass(frozen=True)
class AotKernel:
    """One launch configuration of a ``@triton.jit`` kernel.

    Attributes
    ----------
    name : str
        ``<stem>.<kernel>[config]``, unique.
    fn : object
        The ``triton.runtime.JITFunction``.
    signature : dict
        Argument name -> triton type (``"*u8"``, ``"i64"``, ``"fp32"``, ``"constexpr"``).
    constexprs : dict
        Values of the constexpr arguments.
    num_warps : int
    aligned : tuple
        Pointer arguments assumed 16-byte aligned (what the JIT specializes on for torch allocations).
    options : dict
        Further compile options the launcher passes (e.g. ``enable_fp_fusion=False``).
    args : dict
        Value of every integer argument at the benchmark's serving shape (strides, counts, shifts):
        what the JIT specializes on.
    """

    name: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int = 4
    aligned: tuple = field(default=())
    options: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)


def aot_kernels() -> list[AotKernel]:
    """Every kernel configuration of :data:`TRITON_MODULES`."""
    found = []
    for stem in TRITON_MODULES:
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


_INT_TYPES = ("i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64")
_DIVISIBLE = [["tt.divisibility", 16]]


def specialization(kernel: AotKernel) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of ``kernel`` as the JIT specializes a launch with its
    :attr:`AotKernel.args`: an integer of 1 is a constant, an integer's type is i32 when it fits,
    else i64 (u64 past that), an integer divisible by 16 and a pointer in ``aligned`` carry
    ``tt.divisibility = 16``; floats and bools are not specialized. ``attrs`` hold, in argument
    order and keyed by argument path, what the JIT records: the divisibility, or no attribute
    (``[]``) for every other pointer, integer and constant argument.

    Raises
    ------
    ValueError
        An integer argument of the signature has no value in ``args``.
    """
    signature, constexprs, attrs = {}, dict(kernel.constexprs), {}
    for position, name in enumerate(kernel.fn.arg_names):
        kind = kernel.signature[name]
        signature[name] = kind
        divisible = False
        if kind.startswith("*"):
            divisible = name in kernel.aligned
        elif kind in _INT_TYPES:
            if name not in kernel.args:
                raise ValueError(f"sparsekv: AOT kernel {kernel.name}: integer argument `{name}` has no value in "
                                 f"`args` (the benchmark's value, which the JIT specializes on)")
            value = kernel.args[name]
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64" if -2**63 <= value < 2**63 else "u64"
                divisible = value % 16 == 0
        elif kind != "constexpr":
            continue  # floats and bools: not specialized, no attribute
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

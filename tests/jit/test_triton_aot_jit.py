"""AOT = JIT: for every Triton kernel and arch (sm_90a, sm_100a), the ahead-of-time build
(``jit_kernel/triton/aot.py``) specializes exactly as the JIT does when a launcher calls the kernel
with the same argument values (the benchmark's serving shape, :attr:`AotKernel.args`).

What the JIT specializes on is what triton itself records for the launch: the JIT is run, with no
GPU, under a driver that only names the target, and its ``jit_cache_hook`` (a public knob, called
with the launch's signature, constants, attributes and options just before it would compile)
records the launch and stops it. The AOT build's ``compile_inputs`` must give the same signature,
constants (integers of 1 included), ``tt.divisibility`` attributes, the same ``ASTSource`` hash
(what names the compiled kernel in triton's cache) and the same compile options, ``num_warps`` and
``num_stages`` included.

The JIT runs in a subprocess: CPU test sessions set ``TRITON_INTERPRET=1``, under which the kernels
are interpreted functions, not JIT ones.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

from sparsekv.testing.components import needs

pytestmark = needs("triton", None if importlib.util.find_spec("triton") else "triton is not installed")

ARCHS = ("9.0a", "10.0a")


def test_every_aot_kernel_specializes_as_the_jit_launch_with_the_same_arguments():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    from sparsekv.jit_kernel.triton.aot import aot_kernels

    assert {(r["kernel"], r["arch"]) for r in report} == {(k.name, a) for k in aot_kernels() for a in ARCHS}
    different = {f"{r['kernel']} {r['arch']}": r["different"] for r in report if r["different"]}
    assert not different, json.dumps(different, indent=1)[:6000]
    # The records are real: every kernel has pointer attributes, and the JIT's default stages stand.
    assert all(r["attrs"] > 0 and r["num_stages"] == 3 for r in report), report


def _pointer_type(kind: str):
    import torch

    return {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32, "*u8": torch.uint8,
            "*i8": torch.int8, "*i16": torch.int16, "*i32": torch.int32, "*i64": torch.int64, "*i1": torch.bool,
            "*u1": torch.bool}[kind]


class _Pointer:
    """A tensor as the JIT's specializer sees it: a dtype and an address (16-byte aligned or not)."""

    def __init__(self, kind: str, aligned: bool) -> None:
        self.dtype = _pointer_type(kind)
        self._address = 1 << 20 if aligned else (1 << 20) + 4

    def data_ptr(self) -> int:
        return self._address


class _TargetOnlyDriver:
    """What the JIT asks of a driver before it compiles: a device, a stream and the target."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_device(self):
        return f"sparsekv-aot-{self.target.arch}"

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target


def jit_record(kernel, target) -> dict:
    """What triton records when the JIT launches ``kernel`` with its :attr:`args` on ``target``."""
    from triton import knobs
    from triton.runtime.driver import driver

    records = []

    def record(*, compile, **_):
        records.append(compile)
        return True  # recorded: do not compile

    positional = []
    for name in kernel.fn.arg_names:
        kind = kernel.signature[name]
        if kind == "constexpr":
            continue
        if kind.startswith("*"):
            positional.append(_Pointer(kind, name in kernel.aligned))
        elif kind.startswith(("i", "u")) and kind != "u1":
            positional.append(kernel.args.get(name, 0))
        else:
            positional.append(0.5)
    driver.set_active(_TargetOnlyDriver(target))
    knobs.runtime.jit_cache_hook = record
    try:
        kernel.fn.warmup(*positional, grid=(1,), num_warps=kernel.num_warps, **kernel.constexprs, **kernel.options)
    finally:
        knobs.runtime.jit_cache_hook = None
        driver.set_active(None)
    (compiled,) = records
    return compiled


def compare(kernel, arch: str) -> dict:
    from triton.compiler import ASTSource, make_backend

    from sparsekv.jit_kernel.triton.aot import compile_inputs

    source, target, options = compile_inputs(kernel, arch)
    jit = jit_record(kernel, target)
    jit_attrs = jit["configs"][0]
    jit_options = json.loads(jit["specialization_data"])["options"]
    aot_options = json.loads(json.dumps(make_backend(target).parse_options(options).__dict__))
    different = {}
    for what, aot, jit_value in (("signature", source.signature, jit["signature"]),
                                 ("constants", source.constants, jit["constants"]),
                                 ("attrs", source.attrs, jit_attrs),
                                 ("hash", source.hash(), ASTSource(kernel.fn, jit["signature"], jit["constants"],
                                                                   jit_attrs).hash()),
                                 ("options", aot_options, jit_options)):
        if aot != jit_value:
            if isinstance(aot, dict):
                keys = sorted(set(aot) | set(jit_value), key=str)
                different[what] = {str(k): [str(aot.get(k)), str(jit_value.get(k))] for k in keys
                                   if aot.get(k) != jit_value.get(k)}
            else:
                different[what] = [aot, jit_value]
    return {"kernel": kernel.name, "arch": arch, "different": different, "attrs": len(jit_attrs),
            "num_stages": jit_options["num_stages"]}


if __name__ == "__main__":
    from sparsekv.jit_kernel.triton.aot import aot_kernels

    print(json.dumps([compare(kernel, arch) for kernel in aot_kernels() for arch in ARCHS]))

"""JIT kernels: the loader, the kernel-family registry and one thin wrapper module per kernel family.

Import the wrapper modules directly, e.g. ``from sparsekv.jit_kernel.gather_rows import gather_rows``.
The names below resolve lazily, so importing a torch-free submodule (e.g. ``kv_layout``) does not
pull in tvm-ffi or torch.
"""

import importlib

_LAZY = {
    "JitCompileError": "sparsekv.jit_kernel.loader",
    "JitCacheMissError": "sparsekv.jit_kernel.loader",
    "load_jit": "sparsekv.jit_kernel.loader",
    "KernelFamily": "sparsekv.jit_kernel.registry",
    "discover": "sparsekv.jit_kernel.registry",
    "register": "sparsekv.jit_kernel.registry",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sparsekv.jit_kernel' has no attribute {name!r}")

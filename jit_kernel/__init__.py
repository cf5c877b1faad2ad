"""JIT kernels: the loader, the kernel-family registry and one thin wrapper module per kernel family.

Import the wrapper modules directly, e.g. ``from sparsekv.jit_kernel.gather_rows import gather_rows``.
The names below resolve lazily, so importing a torch-free submodule (e.g. ``kv_layout``) does not
pull in tvm-ffi or torch.
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "JitCompileError": "loader",
    "JitCacheMissError": "loader",
    "load_jit": "loader",
    "KernelFamily": "registry",
    "discover": "registry",
    "register": "registry",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

"""JIT kernels: the loader, the kernel-family registry and one thin wrapper module per family.

Import the wrapper modules directly, e.g. ``from sparsekv.jit_kernel.gather_rows import gather_rows``.
"""

from sparsekv.jit_kernel.loader import JitCompileError, load_jit
from sparsekv.jit_kernel.registry import KernelFamily, discover, register

__all__ = ["JitCompileError", "KernelFamily", "discover", "load_jit", "register"]

"""JIT kernels: one thin wrapper module per kernel family, on the build machinery of :mod:`.build`.

Here: the family wrappers (``<stem>.py``, one per header ``csrc/<stem>.cuh``; ``dsv4`` re-exports
the DSV4 ones), their Triton twins (``triton/``), and what several wrappers share: the custom-op
registration (``torch_op``), bound calls for decode loops (``bound_call``) and the HiSparse swap-ins'
template values (``hisparse_params``). In
``build/``: the registry, the loader, the cache, the toolchain and what ``sparsekv jit`` drives
(bundles, doctor).

Import the wrapper modules directly, e.g. ``from sparsekv.jit_kernel.gather_rows import gather_rows``.
The names below resolve lazily, so importing this package does not pull in tvm-ffi or torch.
"""

from sparsekv._lazy import lazy_getattr

_LAZY = {
    "JitCompileError": "build.loader",
    "JitCacheMissError": "build.loader",
    "JitCompileTimeoutError": "build.loader",
    "load_jit": "build.loader",
    "KernelFamily": "build.registry",
    "discover": "build.registry",
    "register": "build.registry",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

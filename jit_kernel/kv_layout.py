"""The DSV4 KV byte layouts under their kernel-package name.

The module is :mod:`sparsekv.kv_layout` (torch-free, importable by memory planning without the
kernel package); this name keeps ``sparsekv.jit_kernel.kv_layout`` working for engines that import
the layouts next to the kernels.
"""

from sparsekv.kv_layout import *  # noqa: F403
from sparsekv.kv_layout import __all__  # noqa: F401

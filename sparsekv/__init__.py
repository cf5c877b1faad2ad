"""sparsekv: JIT kernels and runtime classes for DeepSeek-V4-class compressed attention.

Importing this package does nothing but define names: no directories are created, no environment
variable is read, nothing compiles and no device is queried.
"""

__version__ = "0.1.0"

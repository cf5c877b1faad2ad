"""Kernel families: what each wrapper module compiles, and the table of instances it supports.

A wrapper module declares one :class:`KernelFamily` per header and registers it at import. The CLI
(``sparsekv jit list/build``) discovers families by importing every module of this package, so
there is no hand-kept list; property tests draw template arguments from the same tables, so a test
run compiles a bounded, known set of modules.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass, field

import tvm_ffi

from sparsekv.jit_kernel.loader import load_jit


@dataclass(frozen=True)
class KernelFamily:
    """One kernel header, its exports, and the template instances it is built for.

    Attributes
    ----------
    name : str
        Module stem; also the cache entry prefix.
    header : str
        Kernel header relative to ``csrc/``.
    exports : Mapping[str, str]
        Python name -> C++ function template.
    kernels : tuple[str, ...]
        Kernel structs whose CUDA launchers the cuda backend instantiates.
    params : tuple[str, ...]
        Names of the template parameters, e.g. ``("index_type",)``.
    instances : tuple[tuple, ...]
        Supported template-argument tuples (the instantiation table).
    """

    name: str
    header: str
    exports: Mapping[str, str]
    kernels: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    instances: tuple[tuple, ...] = field(default=((),))
    # Modules loaded in this process, by (template args, backend, arch): the hot path of every
    # wrapper call is one dict lookup. Environment inputs of the key (SPARSEKV_CUDA_ARCH,
    # SPARSEKV_EXTRA_CFLAGS) are therefore read at a module's first load in a process.
    _loaded: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def module(self, *template_args: object, backend: str = "cpu", arch: str | None = None) -> tvm_ffi.Module:
        """Load (building at first use) one instance from the table.

        Raises
        ------
        ValueError
            ``template_args`` is not in the instantiation table.
        """
        loaded = self._loaded.get((template_args, backend, arch))
        if loaded is not None:
            return loaded
        if template_args not in self.instances:
            raise ValueError(
                f"sparsekv: {self.name} has no instance {dict(zip(self.params, template_args))}; "
                f"supported: {[dict(zip(self.params, i)) for i in self.instances]}"
            )
        module = load_jit(self.name, *template_args, header=self.header, exports=self.exports, kernels=self.kernels,
                          backend=backend, arch=arch)
        self._loaded[(template_args, backend, arch)] = module
        return module

    def describe(self, instance: tuple) -> str:
        """``name<arg=value, ...>`` for logs and the CLI."""
        return f"{self.name}<{', '.join(f'{k}={v}' for k, v in zip(self.params, instance))}>"


def backend_of(tensor) -> str:
    """The backend that runs on a torch tensor's device: ``"cuda"`` for CUDA tensors, else ``"cpu"``."""
    return "cuda" if tensor.device.type == "cuda" else "cpu"


REGISTRY: dict[str, KernelFamily] = {}


def register(family: KernelFamily) -> KernelFamily:
    """Add ``family`` to the registry (idempotent for the same declaration)."""
    existing = REGISTRY.get(family.name)
    if existing is not None and existing != family:
        raise ValueError(f"sparsekv: two different kernel families are named {family.name!r}")
    REGISTRY[family.name] = family
    return family


def discover() -> dict[str, KernelFamily]:
    """Import every module of ``sparsekv.jit_kernel`` so each registers its families; return the registry."""
    import sparsekv.jit_kernel as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    return dict(sorted(REGISTRY.items()))

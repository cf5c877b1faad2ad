"""Kernel families: what each wrapper module compiles, from plain Python values, at first use.

A wrapper module declares one :class:`KernelFamily` per header and registers it at import. The CLI
(``sparsekv jit list/build``) discovers families by importing every module of this package, so
there is no hand-kept list.

Open instantiation
------------------
Callers never name C++ types. A family declares

* ``params``: the names of the plain values a caller passes (ints, bools, short strings such as
  ``"dsv4"``, torch dtypes), e.g. ``("num_top_k", "hot_buffer_size", "layout")``;
* ``complete(**values) -> tuple``: validates those values and returns the full C++ template-argument
  tuple of the header's templates (ints, bools and C++ type strings the *family* writes), deriving
  whatever the caller does not choose (a block size, a page-slot count's layout struct). It raises
  ``ValueError`` naming the argument and the limit (:mod:`sparsekv.checks` does the common cases:
  ``int_in`` and ``one_of`` with ``owner=`` the family's name);
* ``instances``: a table of value dicts with two jobs only: what ``sparsekv jit build --all``
  prebuilds and what property tests draw from. It is *not* a whitelist: any values that
  ``complete`` accepts compile at first use and are cached like the table's.

The pattern, for a new family (``jit_kernel/gather_rows.py`` is the smallest complete example)::

    def _complete(*, index_dtype) -> tuple:
        if index_dtype not in INDEX_TYPES:
            raise ValueError(f"sparsekv: gather_rows argument `index_dtype` must be one of ..., got {index_dtype!r}")
        return (INDEX_TYPES[index_dtype],)                      # C++ template arguments, in header order

    GATHER_ROWS = register(KernelFamily(
        name="gather_rows", header="gather_rows.cuh",
        exports={"gather_rows": "sparsekv::gather_rows::gather_rows"},
        kernels=("sparsekv::gather_rows::GatherRows",),
        params=("index_dtype",), complete=_complete,
        instances=({"index_dtype": torch.int32}, {"index_dtype": torch.int64}),
    ))

    module = GATHER_ROWS.module(index_dtype=idx.dtype, backend=backend_of(dst))   # the hot path

``module`` memoizes on the caller's values, so a repeated call is one dict lookup and ``complete``
runs once per distinct instance per process. ``template_args(values)`` runs ``complete`` alone
(nothing compiles), which is how a caller or a test checks an instance before any build.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tvm_ffi

from sparsekv import env
from sparsekv.jit_kernel.build.loader import JitCacheMissError, load_jit

if TYPE_CHECKING:
    import torch


def _no_params() -> tuple:
    return ()


@dataclass(frozen=True)
class KernelFamily:
    """One kernel header, its exports, and how plain values become its template arguments.

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
        Names of the plain values a caller passes to :meth:`module`.
    complete : callable
        ``complete(**values) -> tuple`` of C++ template arguments (bool, int or C++ string) shared by
        every export and kernel; raises ``ValueError`` for invalid values. Default: no parameters.
    instances : tuple[dict, ...]
        Value dicts prebuilt by ``sparsekv jit build --all`` and drawn from by property tests.
    """

    name: str
    header: str
    exports: Mapping[str, str]
    kernels: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    complete: Callable[..., tuple] = _no_params
    instances: tuple[Mapping[str, object], ...] = field(default=({},))
    # The one in-process memo of loaded modules (load_jit keeps none), by (values, backend, arch) for
    # module() and (backend, *values) for module_for(): the hot path of every wrapper call is one dict
    # lookup. Environment inputs of the cache key (SPARSEKV_CUDA_ARCH, SPARSEKV_EXTRA_CFLAGS,
    # SPARSEKV_SANITIZE) are therefore read at a module's first load in a process.
    _loaded: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    @property
    def stem(self) -> str:
        """The stem of the family's header (``dsv4_indexer`` for ``dsv4_indexer.cuh``): the name its wrapper,
        reference, strategies, tests, benchmarks and Triton twin share (several families may share one)."""
        return self.header.removesuffix(".cuh")

    def template_args(self, values: Mapping[str, object]) -> tuple:
        """Validate ``values`` and return the C++ template arguments (compiles nothing).

        Raises
        ------
        ValueError
            An unknown or missing parameter, or a value ``complete`` rejects (the message names it),
            a value of the wrong type included: to a caller an instance is one set of values.
        """
        unknown = sorted(set(values) - set(self.params))
        if unknown:
            raise ValueError(f"sparsekv: {self.name} has no parameter {unknown[0]!r}; parameters: {list(self.params)}")
        missing = [name for name, p in inspect.signature(self.complete).parameters.items()
                   if p.kind is p.KEYWORD_ONLY and p.default is p.empty and name not in values]
        if missing:
            example = f"; e.g. {self.instance_spec(self.instances[0])!r}" if self.instances else ""
            raise ValueError(f"sparsekv: {self.name} needs the parameters {list(self.params)}: "
                             f"{', '.join(missing)} not given{example}")
        try:
            return tuple(self.complete(**values))
        except TypeError as e:  # the checks' TypeError for a bool or float where an int is meant
            raise ValueError(str(e)) from None

    def module(self, *, backend: str = "cpu", arch: str | None = None, **values: object) -> tvm_ffi.Module:
        """Load (building at first use) the instance for ``values``.

        Raises
        ------
        ValueError
            ``values`` fail the family's validation; nothing is compiled.
        """
        memo = (tuple(values.items()), backend, arch)
        loaded = self._loaded.get(memo)
        if loaded is None:
            loaded = self._loaded[memo] = self._load(values, backend, arch)
        return _recorded(loaded) if RECORDERS else loaded

    def module_for(self, tensor: torch.Tensor, *values: object) -> tvm_ffi.Module:
        """``module(backend=backend_of(tensor), **dict(zip(params, values)))``: the decode path's lookup.

        The values come in the order of ``params``; a loaded instance costs one tuple and one dict
        lookup (the keyword call of :meth:`module` builds a dict and a tuple of its items first: a
        third of a raw module call, issue 36 item 2).

        Raises
        ------
        TypeError
            Not one value per parameter.
        ValueError
            As :meth:`module`.
        """
        memo = ("cuda" if tensor.is_cuda else env.cpu_backend(), *values)  # a str first: never a module() memo
        loaded = self._loaded.get(memo)
        if loaded is None:
            if len(values) != len(self.params):
                raise TypeError(f"sparsekv: {self.name}.module_for takes one value per parameter {list(self.params)}, "
                                f"got {len(values)}")
            loaded = self._loaded[memo] = self._load(dict(zip(self.params, values)), memo[0], None)
        return _recorded(loaded) if RECORDERS else loaded

    def _load(self, values: Mapping[str, object], backend: str, arch: str | None) -> tvm_ffi.Module:
        args = self.template_args(values)
        try:
            return load_jit(self.name, *args, header=self.header, exports=self.exports, kernels=self.kernels,
                            backend=backend, arch=arch)
        except JitCacheMissError as e:  # name this very instance in the form `jit build --instance` takes
            raise JitCacheMissError(f"{e}; this instance alone: sparsekv jit build --backend {backend} "
                                    f"--instance '{self.instance_spec(values)}'") from None

    def instance_spec(self, values: Mapping[str, object]) -> str:
        """``name:k=v,...`` of plain values, as ``sparsekv jit build --instance`` reads it (dtypes by name)."""
        plain = [f"{k}={str(v).removeprefix('torch.')}" for k, v in values.items()]
        return f"{self.name}:{','.join(plain)}" if plain else self.name

    def describe(self, values: Mapping[str, object]) -> str:
        """``name<arg=value, ...>`` of plain values, for logs and the CLI."""
        return f"{self.name}<{', '.join(f'{k}={v}' for k, v in values.items())}>"


def backend_of(tensor) -> str:
    """The backend that runs on a torch tensor's device: ``"cuda"`` for CUDA tensors, else the CPU
    backend ``SPARSEKV_CPU_BACKEND`` names (``"cpu"`` by default, or ``"sim"``)."""
    return "cuda" if tensor.is_cuda else env.cpu_backend()


REGISTRY: dict[str, KernelFamily] = {}

#: Thread id -> what :meth:`KernelFamily.module` hands that thread instead of a loaded module, while
#: :func:`sparsekv.jit_kernel.bound_call.bind` records its calls (empty otherwise: one truth test a call).
RECORDERS: dict[int, Callable[[tvm_ffi.Module], object]] = {}


def _recorded(module: tvm_ffi.Module) -> object:
    recorder = RECORDERS.get(threading.get_ident())
    return module if recorder is None else recorder(module)


def register(family: KernelFamily) -> KernelFamily:
    """Add ``family`` to the registry (idempotent for the same declaration).

    Every table instance must pass the family's own validation (checked here, at import).
    """
    existing = REGISTRY.get(family.name)
    if existing is not None and existing != family:
        raise ValueError(f"sparsekv: two different kernel families are named {family.name!r}")
    for values in family.instances:
        family.template_args(values)
    REGISTRY[family.name] = family
    return family


def discover() -> dict[str, KernelFamily]:
    """Import every module of ``sparsekv.jit_kernel`` so each registers its families; return the registry."""
    import sparsekv.jit_kernel as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    return dict(sorted(REGISTRY.items()))

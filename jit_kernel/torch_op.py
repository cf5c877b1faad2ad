"""Kernel entries as ``torch.library`` custom ops (``sparsekv::<name>``): the one registration helper.

Every public kernel function calls its compiled export through a custom op, so
``torch.compile(fullgraph=True)`` traces a decode step as a graph of opaque ops (no graph break) and
FakeTensor / meta tensors give every output's shape without running a kernel.

The ops are out-variants: each output is an argument listed in ``mutates_args`` and the op returns
nothing. The public wrapper allocates what the caller did not pass (with torch, which traces and
runs on meta tensors) and returns it, so the fake implementation has no shape of its own to compute:
it only runs :func:`_check_arguments`, as the body does first (an ``impl`` that is not one, a meta
tensor in a call that writes a real one: refused naming the argument, never a silent no-op). Given its outputs,
a call allocates nothing, which is what CUDA-graph capture needs. A plain eager call skips the
dispatcher and runs the op's body directly (:func:`_through_dispatcher`); anything that traces sees
the op.

Where the checks run: the op body runs only on real tensors (eager, or when a compiled graph runs),
and holds every check, the C++ entry's shape / dtype / device checks and the value-reading ones
behind ``SPARSEKV_CHECK_INDICES``. Wrappers compute output shapes without refusing anything (an
argument of the wrong rank gives an empty output, which the body then rejects), so tracing never
turns a refusal into a compile error: a compiled call raises exactly the exception an eager call does,
before anything is written.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import torch

from sparsekv import env
from sparsekv.checks import as_bool, as_float, as_int

NAMESPACE = "sparsekv"


#: The check of each scalar kind an op's signature annotates (``X | None`` too: None passes).
_SCALAR_CHECKS = {"int": as_int, "float": as_float, "bool": as_bool}

#: The type whose values each scalar check passes unchanged (the decode loop's case: nothing to call).
_PLAIN_TYPES = {as_int: int, as_float: float, as_bool: bool}

#: What an op's ``impl`` argument may be (the wrappers resolve ``"auto"``; a direct op call may pass it).
#: ``"flashmla"``: the attention's third implementation; the other families' wrappers never pass it.
_OP_IMPLS = ("auto", "header", "triton", "flashmla")


def _refuse_impl(name: str, value: object) -> None:
    raise ValueError(f"sparsekv: {name}: argument `impl` must be one of {list(_OP_IMPLS)}, got {value!r}")


def _check_arguments(name: str, params: Sequence[str], args: tuple, written: Sequence[str],
                     kinds: dict[str, Callable]) -> bool:
    """What every op refuses before its body (or its fake) runs, naming the argument: an ``impl`` that
    is not one of ``_OP_IMPLS``; a scalar not of its annotated kind (a float or a bool for an int, which
    the entry would refuse as "Mismatched type on argument #N"); and a meta tensor in a call that writes
    a real one (the fake would run for the whole call and write nothing). A call whose written tensors
    are all on meta is a shape call: it goes to the fake (whatever else is real). Returns whether a
    meta tensor is present."""
    meta = real_written = None
    for param, value in zip(params, args):
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                meta = meta or param
            elif param in written:
                real_written = real_written or param
        elif param == "impl" and value not in _OP_IMPLS:
            _refuse_impl(name, value)
        elif value is not None and param in kinds:
            kinds[param](value, param)
    if meta is not None and real_written is not None:
        raise ValueError(f"sparsekv: {name}: argument `{meta}` is a meta tensor but `{real_written}`, which the "
                         "call writes, is not; a call runs with every tensor real, or gives shapes with the "
                         "tensors it writes on meta")
    return meta is not None


def _plain_eager(name: str, args: tuple, scalar_slots: tuple, other_slots: tuple) -> bool:
    """Whether a call runs the op's body directly, with what :func:`_check_arguments` refuses checked: nothing
    traces, and every tensor is a plain one off the meta device (the decode loop's case). False sends the
    call to the general path, which decides again; a refusal raised here is the one that path raises
    first (the ``impl`` and scalar checks, in argument order). Precomputed slots keep it one pass, the
    cheap tests first (issue 36 item 2: the general path cost ~6 us of a ~1 us module call)."""
    if _is_compiling() or _dispatch_modes() > 0:
        return False
    for i in other_slots:
        value = args[i]
        if type(value) is _Tensor:
            if value.is_meta:
                return False
        elif value is not None and isinstance(value, _Tensor):  # a subclass: FakeTensor, a Parameter
            return False
    for i, param, kind, plain in scalar_slots:
        value = args[i]
        if type(value) is plain:  # an int where an int is meant (...): what the kind's check passes as is
            continue
        if kind is None:  # the `impl` slot
            if type(value) is str:
                if value not in _OP_IMPLS:
                    _refuse_impl(name, value)
                continue
        elif value is None:  # an optional scalar not given
            continue
        if isinstance(value, _Tensor):
            if type(value) is not _Tensor or value.is_meta:
                return False
        elif kind is None:
            _refuse_impl(name, value)
        else:
            kind(value, param)
    return True


#: What :func:`_plain_eager` calls on every op call, bound once (dynamo knows ``is_compiling`` by identity).
_is_compiling, _dispatch_modes, _Tensor = torch.compiler.is_compiling, torch._C._len_torch_dispatch_stack, torch.Tensor


def _through_dispatcher(args: tuple) -> bool:
    """Whether a call must go through the op: while tracing (dynamo, a dispatch mode such as FakeTensorMode)
    or on meta tensors. A plain eager call runs the body directly: the Python custom-op layer costs tens
    to hundreds of microseconds per call (schema defaults, autograd and in-place-view kernels), which the
    op's only purpose, being seen by tracers, does not need."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return True
    tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return tensor is not None and (tensor.is_meta or type(tensor) is not torch.Tensor)


def kernel_op(name: str, mutates_args: Sequence[str]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: register ``body`` as the custom op ``sparsekv::<name>``; return the function wrappers call.

    Parameters
    ----------
    name : str
        The op's name in the ``sparsekv`` namespace (the kernel entry's export name).
    mutates_args : sequence of str
        The arguments the body writes (outputs, state, caches, the destination pointer table of a
        copy through raw addresses). Declared so the compiler orders the op against other readers
        and writers and never drops it as unused.

    The body's type annotations give the schema (``torch.Tensor``, ``torch.Tensor | None``, int,
    float, bool, str); it returns None and is called with positional arguments. The returned function
    calls the op when anything traces (see :func:`_through_dispatcher`), the body directly otherwise;
    its ``op`` attribute is the registered op, its ``body`` the body (for a wrapper of several ops that
    makes the plain-eager test once for all of them).
    """

    def register(body: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(body)
        params = tuple(signature.parameters)
        written = tuple(mutates_args)
        kinds = {p: _SCALAR_CHECKS[kind] for p, a in signature.parameters.items()
                 if (kind := str(a.annotation).removesuffix(" | None")) in _SCALAR_CHECKS}

        @functools.wraps(body)
        def checked(*args) -> None:  # what a direct call of the op runs too (torch.ops.sparsekv.<name>)
            _check_arguments(name, params, args, written, kinds)
            body(*args)

        def fake(*args, **kwargs) -> None:  # outputs are arguments: nothing to make, only the checks
            bound = inspect.signature(body).bind(*args, **kwargs)
            _check_arguments(name, tuple(bound.arguments), tuple(bound.arguments.values()), written, kinds)

        op = torch.library.custom_op(f"{NAMESPACE}::{name}", checked, mutates_args=tuple(mutates_args))
        op.register_fake(fake)

        scalar_slots = tuple((i, p, kinds.get(p), _PLAIN_TYPES.get(kinds.get(p))) for i, p in enumerate(params)
                             if p == "impl" or p in kinds)
        other_slots = tuple(i for i, p in enumerate(params) if not (p == "impl" or p in kinds))

        def call(*args) -> None:
            if _plain_eager(name, args, scalar_slots, other_slots):
                body(*args)
            # A meta tensor anywhere sends the call to the fake (checked first): never to the entry.
            elif _check_arguments(name, params, args, written, kinds) or _through_dispatcher(args):
                op(*args)
            else:
                body(*args)

        call.op, call.body = op, body
        return call

    return register


def runs_bodies(name: str, tensors: tuple, slots: tuple[int, ...]) -> bool:
    """Whether a wrapper calls its ops' bodies (``kernel_op(...).body``) directly: what each op's own call
    decides (:func:`_plain_eager`), made once for a wrapper that has made its scalar arguments plain
    itself (ints, floats, a resolved ``impl``), over its tensor arguments (``slots`` of ``tensors``).
    False: the wrapper calls the ops, which decide again."""
    return _plain_eager(name, tensors, (), slots)


#: The plain values a :func:`metadata_key` keys by value (with their type: ``True``, ``1`` and ``1.0`` differ).
_KEYED_VALUES = (int, float, bool, str, torch.dtype)


def metadata_key(*args: object) -> tuple | None:
    """What a call's O(1) argument checks read, as a hashable key; None when a call is not to be memoized.

    A plain tensor contributes its address, shape, strides, dtype and device (the address for the
    memory-sharing checks); None itself; an int, float, bool, str or dtype itself with its type. Any
    other argument (a tensor subclass, a list, an object) gives None: such a call is checked in full.
    Two calls with equal keys pass or fail the same O(1) checks, so a wrapper that stores the keys of
    the calls that passed (:class:`CheckMemo`) checks a repeated decode call with one dict lookup.
    """
    parts = []
    for a in args:
        if type(a) is torch.Tensor:
            parts.append((a.data_ptr(), a.shape, a.stride(), a.dtype, a.device))
        elif a is None:
            parts.append(None)
        elif type(a) in _KEYED_VALUES:
            parts.append((type(a), a))
        else:
            return None
    return tuple(parts)


class CheckMemo:
    """The calls whose O(1) argument checks passed, by :func:`metadata_key`, with what the checks derived.

    Only passing calls are stored, so a refusal is always raised by the full checks, with their
    exception and message. What is stored must not hold a tensor (a memo would keep caches alive):
    the derived sizes, strides and shifts. At ``capacity`` keys the memo starts over (a decode loop
    reuses a handful of buffers; a workload that keeps making new ones pays the full checks).
    Value checks (index tables, behind ``SPARSEKV_CHECK_INDICES`` on the GPU) are never memoized.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._passed: dict[tuple, object] = {}

    def get(self, key: tuple | None) -> object | None:
        """What the checks derived for ``key`` (None when not stored or ``key`` is None)."""
        return None if key is None else self._passed.get(key)

    def put(self, key: tuple | None, derived: object) -> None:
        """Store ``derived`` (not None) for a ``key`` whose checks passed."""
        if key is None:
            return
        if len(self._passed) >= self.capacity:
            self._passed.clear()
        self._passed[key] = derived


def index_checks_on_device(tensor: torch.Tensor) -> bool:
    """Whether an op body validates the index tables on ``tensor``'s device with torch before the launch:
    ``tensor`` is on a CUDA device and ``SPARSEKV_CHECK_INDICES=1``.

    The one switch of every family's device index check: reading device values costs a host sync, so
    it is opt-in there (otherwise the kernels skip or clamp what is out of range); host-readable tables
    are the C++ entries' to check.
    """
    return tensor.is_cuda and env.check_indices()


def first_true(mask: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first ``True`` of ``mask`` in row-major order, or None when there is none: how an
    index check finds the entry its message names. One host read (one sync on a GPU), found or not."""
    flat = mask.reshape(-1)
    if flat.numel() == 0:
        return None
    # argmax returns the first of equal maxima; -1 when nothing is set, so one int comes back either way.
    k = int(torch.where(flat.any(), flat.to(torch.uint8).argmax(), -1))
    if k < 0:
        return None
    index = []
    for size in reversed(mask.shape):
        index.append(k % size)
        k //= size
    return tuple(reversed(index))


def check_no_conflicting_destinations(dst_ids: torch.Tensor, src_ids: torch.Tensor, dst_name: str,
                                      src_name: str) -> None:
    """A destination id named twice must come with the same source (rule 3 of ``ffi.h``, whose
    ``check_no_conflicting_destinations`` words the same ``ValueError``), for 1-D id tables on any
    device (one host sync when there are repeats to locate)."""
    if dst_ids.numel() < 2:
        return
    # Sorting by destination puts repeats side by side; a run is consistent iff adjacent sources agree.
    order = torch.sort(dst_ids, stable=True).indices
    d, s = dst_ids[order], src_ids[order]
    conflict = first_true((d[1:] == d[:-1]) & (s[1:] != s[:-1]))
    if conflict is not None:
        (k,) = conflict
        a, b = int(order[k]), int(order[k + 1])
        raise ValueError(f"sparsekv: argument `{dst_name}` names destination {int(d[k])} twice (positions {a} and "
                         f"{b}) with different sources `{src_name}`[{a}] = {int(s[k])} and `{src_name}`[{b}] = "
                         f"{int(s[k + 1])}")


def rows_of(tensor: torch.Tensor, ndim: int, dim: int = 0) -> int:
    """``tensor.shape[dim]`` when ``tensor`` has ``ndim`` dimensions, else 0: an output size that never
    raises, so a wrong-rank argument reaches the op body and its named error (see the module docstring)."""
    return tensor.shape[dim] if tensor.dim() == ndim else 0

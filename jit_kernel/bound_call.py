"""Bound calls: a decode-path call checked once for the buffers an engine reuses every step, then its
module calls alone at each step (issue 36 item 2; FlashInfer's plan/run split, for any public call).

A public kernel call pays its wrapper's Python on the host every time: keywords, output sizing, the
op layer, the O(1) checks (memoized by argument metadata, which alone costs ~0.5 us a tensor). A
decode loop that passes the same tensors every step (what CUDA-graph capture assumes too) can pay
it once::

    step = bind(sparse_decode_attention, q, cache, indices, sink, 64, out=out, lse=lse)
    for _ in range(steps):
        ...                    # write this step's values into q, indices, ...
        out, lse = step()      # the module call the first call made, on the tensors' current values

:func:`bind` makes the call once with every compiled module's export recorded instead of run (no
kernel runs, nothing is written): the wrapper and its checks run in full, so a refusal is the call's
own exception. The bound call then makes the recorded module calls with the same tensors: their
values are read at every call, and each C++ entry checks its arguments (dtypes, shapes, devices,
aliasing, host-readable indices) at every call, as for any caller. Fixed at bind is what the wrapper
derived from the arguments: the implementation and backend, output and workspace views, sizes.

A call that does more than call modules is not recorded: one that runs torch operators of its own (the
attention's one-split bfloat16 output, copied from its float32 staging; index checks on the device under
``SPARSEKV_CHECK_INDICES=1``) or calls no module; views it cuts (the attention's split partials in its
workspace) are arguments like any other. Its bound call makes the whole call every time (``planned``
is False).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable

import torch

from sparsekv.jit_kernel.build import registry

__all__ = ["BoundCall", "bind"]


class _Recorder:
    """What a loaded module's exports become while :func:`bind` runs a call: each call is recorded, not run."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable, tuple]] = []

    def __call__(self, module: object) -> _RecordingModule:
        return _RecordingModule(module, self.calls)


class _RecordingModule:
    def __init__(self, module: object, calls: list) -> None:
        self._module, self._calls = module, calls

    def __getattr__(self, name: str) -> Callable[..., None]:
        export = getattr(self._module, name)
        return lambda *args: self._calls.append((export, args))


class BoundCall:
    """A public call bound to its arguments by :func:`bind`; calling it makes the call again.

    Attributes
    ----------
    planned : bool
        True when a call is the recorded module calls alone; False when it is the whole public call
        (see :func:`bind`).
    module_calls : int
        The module calls a planned call makes (0 when not planned).
    """

    def __init__(self, call: Callable[[], object], result: object, module_calls: list[tuple[Callable, tuple]],
                 planned: bool) -> None:
        self.planned = planned
        self.module_calls = len(module_calls) if planned else 0
        if not planned:
            self._run = call
        elif len(module_calls) == 1:  # the decode case: the call is one FFI crossing
            export, args = module_calls[0]
            self._run = functools.partial(_returning, result, functools.partial(export, *args))
        else:
            self._run = functools.partial(_returning, result, functools.partial(_each, tuple(module_calls)))

    def __call__(self) -> object:
        """Make the call: what the public call returns (its outputs, the ones given or made at bind)."""
        return self._run()


def _returning(result: object, run: Callable[[], object]) -> object:
    run()
    return result


def _each(module_calls: tuple[tuple[Callable, tuple], ...]) -> None:
    for export, args in module_calls:
        export(*args)


#: The torch operators that make a view of a tensor (no data read or written): a call that runs only these
#: besides its module calls is still its module calls alone.
_VIEW_OPS = frozenset({"aten::slice", "aten::view", "aten::as_strided"})


def bind(fn: Callable[..., object], /, *args: object, **kwargs: object) -> BoundCall:
    """Bind a public kernel call to its arguments: check it once, return what makes it again.

    Parameters
    ----------
    fn : callable
        A public kernel function (``sparse_decode_attention``, ``gather_rows``, ...).
    *args, **kwargs
        Its arguments, as the call takes them: the tensors the loop reuses (outputs included; an
        output not given is allocated here, once, and returned by every call).

    Returns
    -------
    BoundCall
        Calling it makes the call; it returns what ``fn`` returns. A call whose ``impl`` is ``"auto"``
        (or not given) binds the header implementation.

    Raises
    ------
    ValueError
        ``impl`` is ``"triton"`` or ``"flashmla"``: their launches are not module calls to record, and
        bind runs no kernel.
    TypeError, ValueError, IndexError
        What ``fn`` raises for these arguments, before anything is written.
    """
    if "impl" in inspect.signature(fn).parameters:
        impl = kwargs.get("impl", "auto")
        if impl not in ("auto", "header"):
            raise ValueError(f"sparsekv: bind: argument `impl` must be 'auto' or 'header' (the module calls bind "
                             f"records), got {impl!r}")
        kwargs["impl"] = "header"
    recorder, thread = _Recorder(), threading.get_ident()
    own_ops = torch.autograd._profiler_enabled()  # a profile running already: its events are not ours to read
    registry.RECORDERS[thread] = recorder
    try:
        if own_ops:
            result = fn(*args, **kwargs)
        else:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                result = fn(*args, **kwargs)
            # aten:: (or sparsekv:: when traced); a view of a tensor (the attention's split partials in its
            # workspace) is what the call derived, fixed at bind as the module call's argument.
            own_ops = any("::" in event.name and event.name not in _VIEW_OPS for event in profile.events())
    finally:
        del registry.RECORDERS[thread]
    call = functools.partial(fn, *args, **kwargs)
    return BoundCall(call, result, recorder.calls, planned=bool(recorder.calls) and not own_ops)

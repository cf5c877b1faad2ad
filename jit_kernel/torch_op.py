"""Kernel entries as ``torch.library`` custom ops (``sparsekv::<name>``): the one registration helper.

Every public kernel function calls its compiled export through a custom op, so
``torch.compile(fullgraph=True)`` traces a decode step as a graph of opaque ops (no graph break) and
FakeTensor / meta tensors give every output's shape without running a kernel.

The ops are out-variants: each output is an argument listed in ``mutates_args`` and the op returns
nothing. The public wrapper allocates what the caller did not pass (with torch, which traces and
runs on meta tensors) and returns it, so the fake implementation has no shape of its own to compute
and every op shares :func:`_writes_only`. Given its outputs, a call allocates nothing, which is what
CUDA-graph capture needs.

Where the checks run: the op body runs only on real tensors (eager, or when a compiled graph runs),
and holds every check, the C++ entry's shape / dtype / device checks and the value-reading ones
behind ``SPARSEKV_CHECK_INDICES``. Wrappers compute output shapes without refusing anything (an
argument of the wrong rank gives an empty output, which the body then rejects), so tracing never
turns a refusal into a compile error: a compiled call raises exactly the exception an eager call does,
before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

NAMESPACE = "sparsekv"


def _writes_only(*args, **kwargs) -> None:
    """The fake implementation of every out-variant op: outputs are arguments, so there is nothing to make."""
    return None


def kernel_op(name: str, mutates_args: Sequence[str]) -> Callable[[Callable[..., None]], torch.library.CustomOpDef]:
    """Decorator: register ``body`` as the custom op ``sparsekv::<name>`` and return the op.

    Parameters
    ----------
    name : str
        The op's name in the ``sparsekv`` namespace (the kernel entry's export name).
    mutates_args : sequence of str
        The arguments the body writes (outputs, state, caches, the destination pointer table of a
        copy through raw addresses). Declared so the compiler orders the op against other readers
        and writers and never drops it as unused.

    The body's type annotations give the schema (``torch.Tensor``, ``torch.Tensor | None``, int,
    float, bool, str); it returns None.
    """

    def register(body: Callable[..., None]) -> torch.library.CustomOpDef:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", body, mutates_args=tuple(mutates_args))
        op.register_fake(_writes_only)
        return op

    return register


def rows_of(tensor: torch.Tensor, ndim: int, dim: int = 0) -> int:
    """``tensor.shape[dim]`` when ``tensor`` has ``ndim`` dimensions, else 0: an output size that never
    raises, so a wrong-rank argument reaches the op body and its named error (see the module docstring)."""
    return tensor.shape[dim] if tensor.dim() == ndim else 0

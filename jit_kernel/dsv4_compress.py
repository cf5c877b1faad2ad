"""DSV4 compressors (kernels in ``csrc/dsv4_compress.cuh``): one-shot :func:`compress_pool` and the
steps of the streaming state ring.

Entry ``i`` of ratio ``m`` pools, per channel, a softmax over its window's slots of
``score + ape`` weighting ``kv`` (C4: slots 0-3 = tokens ``4(i-1)..4i-1`` with the first ``d``
channels, masked for ``i = 0``; slots 4-7 = tokens ``4i..4i+3`` with the last ``d``; C128: slot ``j``
= token ``128i + j``). Entry ``i`` exists once token ``m*i + m - 1`` has arrived; its RoPE anchor
is position ``m*i``.

The streaming steps take tables planned elsewhere: :func:`compress_extend` and
:func:`compress_online_c128` the event / ring-write / segment tables of
:class:`~sparsekv.srt.mem_cache.compressor_state.CompressorState` (the per-request progress and
rollback state; :func:`plan_raw_step` plans its raw ring's tables on the device from a few numbers
per request), :func:`compress_decode` the state rows and positions of a decode step on the device.
The same steps fused with the store are :mod:`~sparsekv.jit_kernel.dsv4_compress_store`.

On the cpu backend the prefill kernels (``compress_pool``, ``compress_extend``, the fused store
included) split their entries over up to ``torch.get_num_threads()`` threads when a call reads more
than a few MiB; each entry is computed by one thread, so results do not depend on the thread count.
"""

from __future__ import annotations

import torch

from sparsekv.checks import as_int
from sparsekv.jit_kernel.build.registry import KernelFamily, register
from sparsekv.jit_kernel.torch_op import first_true, index_checks_on_device, kernel_op, rows_of
from sparsekv.jit_kernel.triton import resolve_impl

RATIOS = (4, 128)

DSV4_COMPRESS = register(
    KernelFamily(
        name="dsv4_compress",
        header="dsv4_compress.cuh",
        exports={
            "compress_pool": "sparsekv::dsv4_compress::compress_pool",
            "compress_extend": "sparsekv::dsv4_compress::compress_extend",
            "compress_online_c128": "sparsekv::dsv4_compress::compress_online_c128",
            "compress_decode": "sparsekv::dsv4_compress::compress_decode",
            "plan_raw_step": "sparsekv::dsv4_compress::plan_raw_step",
        },
        kernels=(
            "sparsekv::dsv4_compress::CompressEvents<4>",
            "sparsekv::dsv4_compress::CompressEvents<128>",
            "sparsekv::dsv4_compress::RingWrite",
            "sparsekv::dsv4_compress::OnlineC128",
            "sparsekv::dsv4_compress::PlanRawStep",
        ),
    )
)


def check_ratio(ratio: int) -> int:
    """``ratio`` if it is 4 or 128, else TypeError (not an int) or ValueError naming ``ratio``."""
    ratio = as_int(ratio, "ratio")
    if ratio not in RATIOS:
        raise ValueError(f"sparsekv: argument `ratio` must be 4 or 128, got {ratio!r}")
    return ratio


def window(ratio: int) -> int:
    """Raw tokens an entry pools: 8 for C4 (two halves of 4), 128 for C128."""
    return 8 if ratio == 4 else ratio


def compress_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, *,
                  out: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """Every complete compressed entry of one sequence, before any norm.

    Parameters
    ----------
    kv, score : torch.Tensor
        float32 ``[T, coff * d]`` (coff = 2 for ratio 4, 1 for ratio 128), unit last stride. Not modified.
    ape : torch.Tensor
        float32 ``[ratio, coff * d]``, contiguous.
    ratio : int
        4 or 128.
    out : torch.Tensor, optional
        float32 ``[T // ratio, d]``, contiguous, to write (default: a new tensor).
    impl : {"auto", "header", "triton"}
        ``"header"``: ``csrc/dsv4_compress.cuh`` on the cpu or cuda backend; ``"triton"``: the Triton
        twin (:mod:`sparsekv.jit_kernel.triton.dsv4_compress`), on a GPU or, on CPU tensors, under
        ``TRITON_INTERPRET=1``; ``"auto"``: the header (see the ``impl`` table of docs/sim-and-triton.md).

    Returns
    -------
    torch.Tensor
        ``out``, float32 ``[T // ratio, d]``.

    Raises
    ------
    ValueError
        ``ratio`` not 4 or 128; shapes that disagree; an unknown ``impl``, or ``"triton"`` where it cannot run.
    TypeError
        A dtype other than float32.
    """
    ratio = as_int(ratio, "ratio")
    impl = resolve_impl(impl, kv)
    if out is None:
        coff = 2 if ratio == 4 else 1
        out = torch.empty(rows_of(kv, 2) // ratio if ratio in RATIOS else 0, rows_of(kv, 2, 1) // coff,
                          dtype=torch.float32, device=kv.device)
    _compress_pool(kv, score, ape, ratio, out, impl)
    return out


@kernel_op("compress_pool", mutates_args=("out",))
def _compress_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, out: torch.Tensor,
                   impl: str) -> None:
    check_ratio(ratio)
    if impl == "triton":
        from sparsekv.jit_kernel.triton import dsv4_compress as triton_compress

        triton_compress.compress_pool(kv, score, ape, ratio, out)
        return
    DSV4_COMPRESS.module_for(kv).compress_pool(kv, score, ape, ratio, out, torch.get_num_threads())


def compress_extend(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                    sources: torch.Tensor, writes: torch.Tensor, out: torch.Tensor) -> None:
    """One streaming step of the raw ring over planned tables: pool every event, then store the ring rows.

    Parameters
    ----------
    kv, score : torch.Tensor
        float32 ``[N, coff * d]`` (coff = 2 for ratio 4, 1 for ratio 128), unit last stride: the new rows.
    ape : torch.Tensor
        float32 ``[ratio, coff * d]``, contiguous.
    ratio : int
        4 or 128.
    state : torch.Tensor
        float32 or bfloat16 ``[rows, 2 * coff * d]``, contiguous: the ring (``[kv | score]`` per row).
    sources : torch.Tensor
        int64 ``[E, W]`` (W = 8 for ratio 4, 128 for ratio 128): each event's window slots; ``s >= 0``
        is row ``s`` of ``kv``, ``-1`` a masked slot, ``s <= -2`` ring row ``-s - 2``.
    writes : torch.Tensor
        int64 ``[M, 2]``: (row of ``kv``, ring row) pairs, stored after every event is pooled.
    out : torch.Tensor
        float32 ``[E, d]``, contiguous: the pooled entries.

    Raises
    ------
    TypeError, ValueError
        A wrong dtype or shape (named).
    IndexError
        A table entry outside ``kv`` or ``state`` (host-readable tables; on the GPU the kernel skips
        it). Nothing is written when anything is raised.
    """
    _compress_extend(kv, score, ape, ratio, state, sources, writes, out)


@kernel_op("compress_extend", mutates_args=("state", "out"))
def _compress_extend(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                     sources: torch.Tensor, writes: torch.Tensor, out: torch.Tensor) -> None:
    DSV4_COMPRESS.module_for(kv).compress_extend(kv, score, ape, ratio, state, sources, writes, out,
                                                                 torch.get_num_threads())


def plan_raw_step(meta: torch.Tensor, num_requests: int, ratio: int, ring_size: int, span: int, num_events: int,
                  num_writes: int, plan: torch.Tensor) -> None:
    """Plan one streaming step of the raw ring on ``meta``'s device: the tables of :func:`compress_extend`.

    Parameters
    ----------
    meta : torch.Tensor
        int64 ``[9 B + R]``, contiguous: per request (B rows of 9) ``start, row0, event0, write0,
        write_from, ids, read_lo, read_count, write_lo`` (``csrc/dsv4_compress.cuh``, ``StepRequest``),
        then the R ring ids the requests name.
    num_requests : int
        B.
    ratio : int
        4 or 128.
    ring_size, span : int
        Rows per ring id; positions per ring id (0: one ring id per request).
    num_events, num_writes : int
        E and M, the sizes of the tables.
    plan : torch.Tensor
        int64 ``[E * (W + 2) + 2 M]``, contiguous (W = 8 for ratio 4, 128 for ratio 128), written:
        ``sources [E, W]``, ``anchors [E]``, the request of each event ``[E]``, ``writes [M, 2]``.

    Raises
    ------
    TypeError, ValueError
        A wrong dtype, shape or device, a size out of range (named).
    """
    _plan_raw_step(meta, num_requests, ratio, ring_size, span, num_events, num_writes, plan)


@kernel_op("plan_raw_step", mutates_args=("plan",))
def _plan_raw_step(meta: torch.Tensor, num_requests: int, ratio: int, ring_size: int, span: int, num_events: int,
                   num_writes: int, plan: torch.Tensor) -> None:
    DSV4_COMPRESS.module_for(meta).plan_raw_step(meta, num_requests, ratio, ring_size, span,
                                                                 num_events, num_writes, plan)


def compress_online_c128(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, state: torch.Tensor,
                         snapshots: int, segments: torch.Tensor, out: torch.Tensor) -> None:
    """One streaming step of the online C128 fold over planned segments.

    Parameters
    ----------
    kv, score : torch.Tensor
        float32 ``[N, d]``, unit last stride: the new rows.
    ape : torch.Tensor
        float32 ``[128, d]``, contiguous.
    state : torch.Tensor
        float32 ``[rows, 2 d]``, contiguous: per request, ``2 * snapshots`` rows of running
        (max, sum, accumulator) snapshots (row a = ``[acc | max]``, row b = ``[sum | 0]``).
    snapshots : int
        Snapshot slots per request ring (>= 1).
    segments : torch.Tensor
        int64 ``[S, 7]``: per segment (all in one 128-window) ``row0, pos0, count, read_row,
        out_row, ring_base, keep_from`` (``csrc/dsv4_compress.cuh``, ``Segment``).
    out : torch.Tensor
        float32 ``[E, d]``, contiguous: the entries the segments close.

    Raises
    ------
    TypeError, ValueError
        A wrong dtype or shape (named), ``snapshots < 1``.
    IndexError
        A segment naming rows outside ``kv``, ``state`` or ``out``, or spanning two windows
        (host-readable tables). Nothing is written when anything is raised.
    """
    _compress_online(kv, score, ape, state, snapshots, segments, out)


@kernel_op("compress_online_c128", mutates_args=("state", "out"))
def _compress_online(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, state: torch.Tensor, snapshots: int,
                     segments: torch.Tensor, out: torch.Tensor) -> None:
    DSV4_COMPRESS.module_for(kv).compress_online_c128(kv, score, ape, state, snapshots, segments, out)


def check_decode_rows_on_device(state_rows: torch.Tensor, positions: torch.Tensor, ring_rows: int) -> None:
    """Torch check, on the tables' own device, of the ring rows a decode step reads and writes (the C++
    entry checks host-readable tables the same way; on the GPU this runs with ``SPARSEKV_CHECK_INDICES=1``
    and costs a host sync).

    Raises
    ------
    IndexError
        A negative position, or a row of a position >= 0 outside ``[0, ring_rows)``.
    """
    negative = first_true(positions < 0)
    if negative is not None:
        (b,) = negative
        raise IndexError(f"sparsekv: argument `positions`[{b}] = {int(positions[b])} is negative")
    window = state_rows.shape[1]
    offsets = torch.arange(window - 1, -1, -1, device=state_rows.device)
    read = positions.to(state_rows.device)[:, None] >= offsets[None, :]  # position - offset >= 0
    bad = first_true(read & ((state_rows < 0) | (state_rows >= ring_rows)))
    if bad is not None:
        b, j = bad
        raise IndexError(f"sparsekv: argument `state_rows`[{b}, {j}] = {int(state_rows[b, j])} is outside state "
                         f"[0, {ring_rows})")


def check_decode_on_cuda(state_rows: torch.Tensor, positions: torch.Tensor, state: torch.Tensor) -> None:
    """:func:`check_decode_rows_on_device` for CUDA tables with ``SPARSEKV_CHECK_INDICES=1`` (the op bodies' hook)."""
    if (index_checks_on_device(state_rows) and state_rows.dim() == 2 and positions.dim() == 1
            and state_rows.shape[0] == positions.shape[0] and state.dim() == 2):
        check_decode_rows_on_device(state_rows, positions, state.shape[0])


def decode_outputs(kv: torch.Tensor, ratio: int, out: torch.Tensor | None,
                   emitted: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of a decode step of ``kv``'s rows: ``out`` and ``emitted``, allocated where not given."""
    if out is not None and emitted is not None:  # the decode loop's case: nothing to size
        return out, emitted
    coff = 2 if ratio == 4 else 1
    batch = rows_of(kv, 2)
    if out is None:
        out = torch.empty(batch, rows_of(kv, 2, 1) // coff, dtype=torch.float32, device=kv.device)
    if emitted is None:
        emitted = torch.empty(batch, dtype=torch.bool, device=kv.device)
    return out, emitted


def compress_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                    state_rows: torch.Tensor, positions: torch.Tensor, *, out: torch.Tensor | None = None,
                    emitted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of a batch on the raw ring, planned on the device (no store): returns ``(out, emitted)``.

    :func:`~sparsekv.jit_kernel.dsv4_compress_store.compress_decode_step` documents the arguments and
    results; it is this step, or this step fused with the store when given one.
    """
    ratio = as_int(ratio, "ratio")
    out, emitted = decode_outputs(kv, ratio, out, emitted)
    _compress_decode(kv, score, ape, ratio, state, state_rows, positions, out, emitted)
    return out, emitted


@kernel_op("compress_decode", mutates_args=("state", "out", "emitted"))
def _compress_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, ratio: int, state: torch.Tensor,
                     state_rows: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                     emitted: torch.Tensor) -> None:
    if ratio not in RATIOS:
        check_ratio(ratio)
    check_decode_on_cuda(state_rows, positions, state)
    DSV4_COMPRESS.module_for(kv).compress_decode(kv, score, ape, ratio, state, state_rows, positions,
                                                                 out, emitted)

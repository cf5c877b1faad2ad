"""The roofline model of every kernel, in one place: bytes and FLOPs per kernel at a shape, and the GPUs.

A kernel's roofline time on a GPU is ``max(HBM bytes / HBM bandwidth, FLOPs / tensor-core peak,
host bytes / PCIe bandwidth)``: the least time the bytes it must move and the products it must
compute allow, with no launch latency. The benchmarks put it next to the measured time
(:func:`fields`): ``measured_over_roofline`` is how far a kernel is from what the hardware allows.

The bytes count what a kernel must touch once in HBM at least (each input read once, each output
written once); the FLOPs count 2 per multiply-add of the matrix products (the softmax, norms and
scaling are small next to them). Each cost function's docstring gives its formula, so a reader can
check a figure by hand; ``tests/test_roofline.py`` does.

GPU peaks are the vendors' dense figures (no sparsity): HBM bandwidth, bf16 and fp8 tensor-core
FLOP/s, fp32 FMA on the CUDA cores, and the host link (PCIe Gen5 x16, about 55 GB/s each way in
practice).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.kv_layout import INDEXER_FP8, V4

__all__ = ["GPUS", "Cost", "Gpu", "attention", "compress", "compress_store", "fields", "gather_rows", "gpu_named",
           "indexer_scores", "indexer_topk", "quantize", "store", "swap_in"]


@dataclass(frozen=True)
class Gpu:
    """One GPU's peaks (per second)."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    pcie_bytes_per_s: float = 55e9


#: H100 SXM, H200 SXM, B200: HBM bandwidth and dense tensor-core peaks.
GPUS = {
    "H100": Gpu("H100", hbm_bytes_per_s=3.35e12, bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12),
    "H200": Gpu("H200", hbm_bytes_per_s=4.8e12, bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12),
    "B200": Gpu("B200", hbm_bytes_per_s=8e12, bf16_flops=2250e12, fp8_flops=4500e12, fp32_flops=80e12),
}


def gpu_named(device_name: str) -> Gpu | None:
    """The :data:`GPUS` entry a device name (``torch.cuda.get_device_name()``) is, or None."""
    return next((gpu for key, gpu in GPUS.items() if key in device_name.upper()), None)


@dataclass(frozen=True)
class Cost:
    """What one kernel call must move and compute.

    Attributes
    ----------
    bytes : int
        HBM bytes read and written, each once.
    flops : int
        Matrix-product FLOPs (2 per multiply-add).
    math : str
        The peak the FLOPs run at: ``"bf16"``, ``"fp8"`` or ``"fp32"``.
    host_bytes : int
        Bytes over the host link (PCIe).
    """

    bytes: int
    flops: int = 0
    math: str = "bf16"
    host_bytes: int = 0

    def times_s(self, gpu: Gpu) -> dict:
        """Seconds of each bound on ``gpu``: ``memory``, ``math``, ``host``."""
        return {"memory": self.bytes / gpu.hbm_bytes_per_s,
                "math": self.flops / getattr(gpu, f"{self.math}_flops"),
                "host": self.host_bytes / gpu.pcie_bytes_per_s}

    def roofline_s(self, gpu: Gpu) -> float:
        """The least time on ``gpu``: the largest of :meth:`times_s`."""
        return max(self.times_s(gpu).values())

    def bound(self, gpu: Gpu) -> str:
        """Which of :meth:`times_s` sets the roofline on ``gpu``."""
        times = self.times_s(gpu)
        return max(times, key=times.get)


def fields(cost: Cost, measured_s: float | None = None, device_name: str | None = None) -> dict:
    """A benchmark row's roofline columns: bytes, FLOPs, each GPU's roofline time and bound, and,
    given a time measured on a GPU :data:`GPUS` knows, ``measured_over_roofline`` against that GPU's.

    A time measured on another device (the cpu backend, an unknown GPU) gets no ratio: the roofline
    of a GPU says nothing about it.
    """
    row = {"bytes": cost.bytes, "flops": cost.flops}
    if cost.flops:
        row["math"] = cost.math
    if cost.host_bytes:
        row["host_bytes"] = cost.host_bytes
    for key, gpu in GPUS.items():
        row[f"{key.lower()}_roofline_us"] = round(cost.roofline_s(gpu) * 1e6, 3)
    row["bound_h200"] = cost.bound(GPUS["H200"])
    gpu = gpu_named(device_name) if device_name else None
    if measured_s is not None and gpu is not None:
        row["roofline_gpu"] = gpu.name
        row["measured_over_roofline"] = round(measured_s / cost.roofline_s(gpu), 2)
    return row


HEAD_DIM = 512  # the attention's query/key/value width (V4 records)
INDEXER_DIM = 128


def attention(batch: int, top_k: int, heads: int = 64, q_bytes: int = 2, out_bytes: int = 2) -> Cost:
    """Sparse decode attention over ``top_k`` V4 rows per query row.

    bytes = ``batch * top_k * (584 + 4)`` (each selected record once, its int32 index) +
    ``batch * heads * 512 * (q_bytes + out_bytes)`` (query in, output out) + ``batch * heads * 4`` (lse)
    + ``heads * 4`` (sink); FLOPs = ``4 * batch * heads * 512 * top_k`` (QK^T and PV), bf16.
    """
    nbytes = (batch * top_k * (V4.bytes_per_token + 4) + batch * heads * HEAD_DIM * (q_bytes + out_bytes)
              + batch * heads * 4 + heads * 4)
    return Cost(nbytes, 4 * batch * heads * HEAD_DIM * top_k, "bf16")


def indexer_scores(batch: int, entries: int, heads: int = 64, page_slots: int = 64, q_bytes: int = 2,
                   key_bytes: int = INDEXER_FP8.bytes_per_token) -> Cost:
    """Lightning-indexer scores of ``entries`` keys per row (FP8: 132 B records; FP4: ``key_bytes=68``).

    bytes = ``batch * entries * (key_bytes + 4)`` (each key record once, one fp32 score written) +
    ``batch * (entries / page_slots) * 4`` (page table) + ``batch * heads * (128 * q_bytes + 4)``
    (query, weights); FLOPs = ``2 * batch * heads * 128 * entries``, fp8.
    """
    nbytes = (batch * entries * (key_bytes + 4) + batch * (entries // page_slots) * 4
              + batch * heads * (INDEXER_DIM * q_bytes + 4))
    return Cost(nbytes, 2 * batch * heads * INDEXER_DIM * entries, "fp8")


def indexer_topk(batch: int, entries: int, top_k: int) -> Cost:
    """Top-k of ``entries`` fp32 scores per row: bytes = ``batch * (entries + top_k) * 4`` (the row
    read once, the int32 tokens written)."""
    return Cost(batch * (entries + top_k) * 4)


def _window_bytes(tokens: int, ratio: int, d: int) -> int:
    coff = 2 if ratio == 4 else 1  # C4 windows overlap: each token carries an A and a B half
    return tokens * 2 * coff * d * 4  # fp32 kv and score, each token read once


def compress(tokens: int, ratio: int, d: int = 512) -> Cost:
    """Compressor pool of ``tokens`` raw tokens into ``tokens / ratio`` fp32 entries.

    bytes = ``tokens * 2 * coff * d * 4`` (fp32 kv and score; coff = 2 for C4, 1 for C128) +
    ``(tokens / ratio) * d * 4`` (the entries written).
    """
    return Cost(_window_bytes(tokens, ratio, d) + tokens // ratio * d * 4)


def compress_store(tokens: int, ratio: int, d: int = 512) -> Cost:
    """The compressor fused with the store: bytes = ``tokens * 2 * coff * d * 4`` +
    ``(tokens / ratio) * 584`` (one V4 record per entry)."""
    return Cost(_window_bytes(tokens, ratio, d) + tokens // ratio * V4.bytes_per_token)


def store(entries: int, d: int = 512, record_bytes: int = V4.bytes_per_token) -> Cost:
    """Norm + RoPE + quantize + store of ``entries`` fp32 entries: bytes = ``entries * (d * 4 + 8 + 8 +
    record_bytes)`` (the entry, its int64 position and slot, the record written)."""
    return Cost(entries * (d * 4 + 16 + record_bytes))


def quantize(rows: int, x_bytes: int = 2) -> Cost:
    """FP8 quantize of ``rows`` 512-wide rows into V4 records: bytes = ``rows * (512 * x_bytes + 8 +
    584)`` (the row, its int64 slot, the record)."""
    return Cost(rows * (HEAD_DIM * x_bytes + 8 + V4.bytes_per_token))


def gather_rows(rows: int, row_bytes: int, index_bytes: int = 8) -> Cost:
    """Indexed copy of ``rows`` rows: bytes = ``rows * (2 * row_bytes + 2 * index_bytes)`` (each row
    read and written once, both indices read)."""
    return Cost(rows * (2 * row_bytes + 2 * index_bytes))


def swap_in(batch: int, top_k: int, misses: int, item_bytes: int = V4.bytes_per_token, table_bytes: int = 4) -> Cost:
    """One HiSparse swap-in step: each of the ``batch * top_k`` selected tokens looked up once
    (``table_bytes`` each for the top-k, the token -> slot table and the slot written back, so
    ``3 * table_bytes``), and ``misses`` items copied host -> device: ``host_bytes = misses *
    item_bytes`` over PCIe, written once in HBM."""
    return Cost(batch * top_k * 3 * table_bytes + misses * item_bytes, host_bytes=misses * item_bytes)

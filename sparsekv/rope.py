"""RoPE parameters and the float32 cos/sin table every DSV4 store and attention path rotates by.

A leaf that the wrappers (:mod:`sparsekv.jit_kernel.dsv4_store`, the fused compress-store), the
runtime layers and the torch references import alike, so none of them imports a wrapper for it. The
kernels rotate the trailing :data:`ROPE_DIMS` channels of each row (``csrc/include/sparsekv/rope.h``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparsekv.checks import as_float, as_int, int_in

__all__ = ["ROPE_DIMS", "RopeParams", "RopeTable"]

#: Rotated dims at the tail of every stored entry (32 pairs).
ROPE_DIMS = 64


@dataclass(frozen=True)
class RopeTable:
    """The float32 RoPE table a store rotates by: ``cos[pos, i]`` and ``sin[pos, i]`` of pair ``i``
    of the 64 rotated dims, ``[max_position, 32]`` each, contiguous, on the cache's device (the
    model's own table when it has one; :meth:`RopeParams.table` builds it the model's way)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def max_position(self) -> int:
        return self.cos.shape[0]


@dataclass(frozen=True)
class RopeParams:
    """RoPE with optional YaRN blending (``factor > 1``), no mscale.

    DSV4 compressed layers: ``RopeParams(160000, 16, 65536, 32, 1)``; SWA-only layers:
    ``RopeParams(10000)``. The types are checked here (TypeError naming the field for a string or
    a bool, a float ``original_max_positions``), the values when the table is built.
    """

    theta: float
    factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "beta_fast", "beta_slow"):
            as_float(getattr(self, name), f"rope.{name}")
        as_int(self.original_max_positions, "rope.original_max_positions")

    def inv_freq(self) -> torch.Tensor:
        """float32 ``[32]`` inverse frequencies ``theta^(-2i/64)``, YaRN-blended when ``factor > 1``
        (DeepSeek's rule: correction range from beta_fast / beta_slow, a linear ramp between)."""
        if not self.theta > 1.0:
            raise ValueError(f"sparsekv: argument `theta` must be > 1, got {self.theta}")
        if not self.factor > 0.0:
            raise ValueError(f"sparsekv: argument `factor` must be > 0, got {self.factor}")
        freq = 1.0 / (self.theta ** (torch.arange(0, ROPE_DIMS, 2, dtype=torch.float32) / ROPE_DIMS))
        if self.factor <= 1.0:
            return freq
        if self.original_max_positions <= 0 or not self.beta_fast > 0 or not self.beta_slow > 0:
            raise ValueError("sparsekv: arguments `original_max_positions`, `beta_fast`, `beta_slow` must be positive "
                             "when YaRN is on (factor > 1)")

        def corr(rotations: float) -> float:
            return ROPE_DIMS * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (
                2 * math.log(self.theta))

        low = max(math.floor(corr(self.beta_fast)), 0)
        high = min(math.ceil(corr(self.beta_slow)), ROPE_DIMS - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(ROPE_DIMS // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        return freq / self.factor * ramp + freq * (1 - ramp)

    def table(self, max_position: int, device: torch.device | str | None = None) -> RopeTable:
        """The model's float32 table for positions ``[0, max_position)``: ``t`` and the inverse
        frequencies in float32, ``angle = outer(t, inv_freq)`` in float32, then its cos and sin.

        Raises
        ------
        TypeError
            ``max_position`` is not an int.
        ValueError
            ``max_position < 1`` or invalid parameters (named).
        """
        max_position = int_in(max_position, "max_position", 1)
        angle = torch.outer(torch.arange(max_position, dtype=torch.float32), self.inv_freq())
        return RopeTable(torch.cos(angle).to(device).contiguous(), torch.sin(angle).to(device).contiguous())

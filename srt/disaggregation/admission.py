"""Prefill admission for PD: a request is bounded by the full KV pool, never by the SWA pool.

A PD prefill server only needs SWA slots for the chunk it is computing and the window behind it,
so capping prompts at the SWA pool size (what DSV4 prefill once did: about 18k tokens for
DeepSeek-V4-Pro) rejects valid long prompts. The bound is the model runner's token pool size:

* with HiSparse, the allocator's logical (host-backed) capacity ``size_full``;
* with a hybrid SWA pool (DSV4 included), the full pool ``full_max_total_num_tokens``;
* otherwise ``max_total_num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsekv.srt.model_executor.pool_configurator import MemoryPoolConfig


def max_token_pool_size(config: MemoryPoolConfig, hisparse_allocator=None) -> int:
    """The token capacity requests are admitted against (see the module docstring).

    Parameters
    ----------
    config : MemoryPoolConfig
        The rank's final pool sizes.
    hisparse_allocator : HiSparseTokenToKVPoolAllocator, optional
        The HiSparse allocator when HiSparse is on.
    """
    if hisparse_allocator is not None:
        return int(hisparse_allocator.size_full)
    if config.full_max_total_num_tokens is not None:
        return int(config.full_max_total_num_tokens)
    return int(config.max_total_num_tokens)


@dataclass(frozen=True)
class PrefillAdmission:
    """The prefill bootstrap queue's capacity check.

    Attributes
    ----------
    max_total_num_tokens : int
        The bound, :func:`max_token_pool_size`.
    """

    max_total_num_tokens: int

    @classmethod
    def for_pool(cls, config: MemoryPoolConfig, hisparse_allocator=None) -> PrefillAdmission:
        """The check for a rank with these pool sizes (and HiSparse allocator, if on)."""
        return cls(max_token_pool_size(config, hisparse_allocator))

    def rejection(self, input_len: int) -> str | None:
        """Why a prompt of ``input_len`` tokens is rejected, or None when it is admitted.

        Raises
        ------
        ValueError
            A negative length.
        """
        if input_len < 0:
            raise ValueError(f"sparsekv: argument `input_len` must be >= 0, got {input_len}")
        if input_len > self.max_total_num_tokens:
            return (f"the prompt has {input_len} tokens, more than the KV pool holds "
                    f"({self.max_total_num_tokens} tokens); it can never be admitted")
        return None

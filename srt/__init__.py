"""Runtime classes, laid out as in sglang's ``srt``: ``mem_cache`` (pools, host pools, allocators,
typed ids), ``model_executor`` (memory planning), ``managers`` (the HiSparse coordinator) and
``streams``. Import the subpackages; each re-exports its public names."""

__all__ = ["managers", "mem_cache", "model_executor", "streams"]

"""FlashMLA's kernels behind our public functions (``impl="flashmla"``), one module per kernel stem.

Each module adapts the ``flash_mla`` package (github.com/deepseek-ai/FlashMLA, installed by the user)
to the contract of the wrapper of the same stem: our checks run first, FlashMLA runs on our tensors
as they are. Nothing here imports ``flash_mla`` at import time.
"""

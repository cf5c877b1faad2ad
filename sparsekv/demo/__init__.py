"""``sparsekv demo``: a DeepSeek-V4-shaped prefill and decode through every kernel, checked.

:mod:`~sparsekv.demo.model` is the seeded model, :mod:`~sparsekv.demo.stack` one process's plan,
pools and steps, :mod:`~sparsekv.demo.pd` the prefill/decode split over NIXL, and
:mod:`~sparsekv.demo.command` the command (``make demo`` runs it with its defaults).
"""

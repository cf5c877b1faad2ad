"""``sparsekv demo``: a DeepSeek-V4-shaped prefill and decode through every kernel, checked.

:mod:`~sparsekv.cli.demo.model` is the seeded model, :mod:`~sparsekv.cli.demo.stack` one process's plan,
pools and steps, :mod:`~sparsekv.cli.demo.pd` the prefill/decode split over NIXL, and
:mod:`~sparsekv.cli.demo.command` the command (``make demo`` runs it with its defaults).
"""

"""The ``sparsekv`` console script.

Each subcommand lives in the module that owns its feature; this file only wires them up. A
subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import sparsekv

# subcommand -> (module, one-line help). The modules import lazily so `sparsekv plan-memory`
# never pays for torch or the JIT loader.
SUBCOMMANDS = {
    "jit": ("sparsekv.jit_kernel.cli", "build, list, inspect and clean JIT kernel modules"),
    "plan-memory": ("sparsekv.srt.model_executor.plan_memory", "plan KV pool sizes for a model and budget"),
    "pd-demo": ("sparsekv.srt.disaggregation.pd_demo", "loopback prefill -> decode KV transfer over NIXL, checked"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsekv", description="JIT kernels, memory planning and HiSparse pools for DeepSeek-V4-class models"
    )
    parser.add_argument("--version", action="version", version=f"sparsekv {sparsekv.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Only the chosen subcommand's module is imported; it adds its own arguments.
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
        sub = argparse.ArgumentParser(prog=f"sparsekv {argv[0]}", description=SUBCOMMANDS[argv[0]][1])
        module.add_arguments(sub)
        return int(module.run(sub.parse_args(argv[1:])) or 0)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

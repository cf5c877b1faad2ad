"""The ``sparsekv`` console script: the one shell every command runs in.

Each command is a module of this package (``sparsekv.cli.jit``, ``.bench``, ``.plan_memory``,
``.demo``...); this file only wires them up and owns the manners every command shares:

* ``--help`` on every command and subcommand, with the examples of :data:`SUBCOMMANDS` that name it;
* an error is one line on stderr, ``<command>: error: <message>``: exit code 2 for a usage error
  (:class:`UsageError`, or argparse's: the message names the flag) and 1 for a failure (any other
  exception); the Python traceback only with ``--debug``;
* a closed pipe (``sparsekv jit list | head -1``) ends the command quietly; Ctrl-C exits 130;
* ``-v`` shows INFO records of the ``sparsekv.*`` loggers (one line per JIT compile), ``-vv`` or
  ``--debug`` DEBUG; otherwise ``SPARSEKV_LOG_LEVEL`` (default WARNING); :func:`sparsekv.log.configure`
  is the one place a handler is attached.

Tool scripts (``tools/``) parse with :class:`CliParser`, so their usage errors read the same.

To add a subcommand, add one entry to :data:`SUBCOMMANDS`; its module provides
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code) and may raise :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import sparsekv


@dataclass(frozen=True)
class Subcommand:
    """A ``sparsekv`` subcommand: the module that implements it, a one-line help, usage examples."""

    module: str
    help: str
    examples: tuple[str, ...]


# The modules import lazily, so `sparsekv plan-memory` never pays for torch or the JIT loader.
SUBCOMMANDS = {
    "jit": Subcommand(
        "sparsekv.cli.jit",
        "build, list, inspect and clean JIT kernel modules",
        (
            "sparsekv jit list",
            "sparsekv jit list --json",
            "sparsekv jit build --all",
            "sparsekv jit build gather_rows --backend cuda --arch 9.0a,10.0a",
            "sparsekv jit build --instance 'hisparse:num_top_k=512,hot_buffer_size=1024'",
            "sparsekv jit build --model dsv4-flash --hot-buffer 1024 -v",
            "sparsekv jit build --triton --arch 9.0a,10.0a --json",
            "sparsekv jit info",
            "sparsekv jit info --json",
            "sparsekv jit clean --stale --dry-run",
            "sparsekv jit clean",
            "sparsekv jit verify",
            "sparsekv jit verify --repair --json",
            "sparsekv jit prune --older-than 30",
            "sparsekv jit prune --max-size 20G --dry-run",
            "sparsekv jit doctor",
            "sparsekv jit doctor --json > doctor.json",
            "sparsekv jit explain-key gather_rows index_dtype=int64",
            "sparsekv jit explain-key hisparse num_top_k=512 hot_buffer_size=1024 --json > a.json",
            "sparsekv jit explain-key --diff a.json b.json",
            "sparsekv jit export kernels.tar --all",
            "sparsekv jit export kernels.tar --model dsv4-flash",
            "sparsekv jit import kernels.tar",
            "SPARSEKV_CACHE_DIR=/opt/kernels sparsekv jit import kernels.tar",
        ),
    ),
    "demo": Subcommand(
        "sparsekv.cli.demo.command",
        "a DSV4-shaped prefill and decode through every kernel, HiSparse and PD, checked against fp64 torch",
        (
            "sparsekv demo",
            "sparsekv demo --tokens 4096 --steps 64 --plot demo.png --json demo.json",
            "sparsekv demo --hisparse 4 --pd",
            "sparsekv demo --hisparse off",
        ),
    ),
    "bench": Subcommand(
        "sparsekv.cli.bench",
        "run the benchmark of every kernel family (or one): results.json, PNG plots, a table of ratios",
        (
            "sparsekv bench all --quick --out bench-results",
            "sparsekv bench gather_rows --quick --out /tmp/bench",
            "sparsekv bench dsv4_attention --backend cuda",
            "sparsekv bench --list",
        ),
    ),
    "plan-memory": Subcommand(
        "sparsekv.cli.plan_memory",
        "plan KV pool sizes for a model and a per-rank KV budget",
        (
            "sparsekv plan-memory --model dsv4-flash --kv-budget 60GiB --pp 4 --hisparse 2",
            "sparsekv plan-memory --list-cases",
            "sparsekv plan-memory --case flash-pp2-40GiB --json",
            "sparsekv plan-memory --case my_case.json --json",
        ),
    ),
    "pd-demo": Subcommand(
        "sparsekv.cli.pd_demo",
        "loopback prefill -> decode KV transfer over NIXL or Mooncake, checked byte for byte",
        (
            "sparsekv pd-demo",
            "sparsekv pd-demo --engine mooncake --hisparse off",
            "sparsekv pd-demo --hisparse on --pp-size 2 --json",
            "sparsekv pd-demo --kill-decode-after 2",
        ),
    ),
}

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(Exception):
    """The command line asks for something impossible (exit code 2); the message names the flag."""


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``prog: error: message (see prog --help)``."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _examples_epilog(examples: tuple[str, ...]) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in examples)


def _add_global_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    # Accepted before and after the subcommand; only the top level sets defaults, so a subcommand's
    # parser never overwrites what was given before it. A subcommand that defines one of these
    # options itself keeps its own.
    suppress = {} if defaults else {"default": argparse.SUPPRESS}
    taken = parser._option_string_actions
    group = parser.add_argument_group("output")
    if not {"-v", "--verbose"} & taken.keys():
        group.add_argument("-v", "--verbose", action="count", help="-v: INFO log lines (e.g. each JIT compile), "
                           "-vv or --debug: DEBUG (default: SPARSEKV_LOG_LEVEL, else WARNING)",
                           **({"default": 0} | suppress))
    if "--debug" not in taken:
        group.add_argument("--debug", action="store_true", help="show the Python traceback of an error, and DEBUG "
                           "log lines",
                           **({"default": False} | suppress))


def _nested_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.values()


def _finish_nested(parser: argparse.ArgumentParser, examples: tuple[str, ...]) -> None:
    """Give each nested subcommand (``sparsekv jit build``) the global options and the examples
    that run it."""
    for nested in _nested_parsers(parser):
        _add_global_options(nested, defaults=False)
        runs = re.compile(rf"(^|\s){re.escape(nested.prog)}(\s|$)")
        mine = tuple(e for e in examples if runs.search(e))
        if mine and nested.epilog is None:
            nested.epilog = _examples_epilog(mine)
            nested.formatter_class = argparse.RawDescriptionHelpFormatter
        _finish_nested(nested, examples)


def build_parser(load: str | tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The ``sparsekv`` parser; the subcommands named in ``load`` (or ``"all"``) get their arguments.

    Loading a subcommand imports its module, so :func:`main` loads only the one being run.
    """
    load = tuple(SUBCOMMANDS) if load == "all" else (load,) if isinstance(load, str) else load
    every_example = tuple(e for sub in SUBCOMMANDS.values() for e in sub.examples)
    parser = CliParser(
        prog="sparsekv",
        description="JIT kernels, memory planning and HiSparse pools for DeepSeek-V4-class models.",
        epilog=_examples_epilog(every_example) + "\n\nRun 'sparsekv COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sparsekv {sparsekv.__version__}")
    _add_global_options(parser, defaults=True)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CliParser)
    for name, sub in SUBCOMMANDS.items():
        sub_parser = subparsers.add_parser(
            name, help=sub.help, description=sub.help[0].upper() + sub.help[1:] + ".",
            epilog=_examples_epilog(sub.examples), formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_global_options(sub_parser, defaults=False)
        if name in load:
            importlib.import_module(sub.module).add_arguments(sub_parser)
            _finish_nested(sub_parser, sub.examples)
    return parser


def iter_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()
                  ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command of ``parser`` as ``(argv prefix, parser)``: ``()``, ``("jit",)``, ``("jit", "build")``..."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, nested in action.choices.items():
                yield from iter_commands(nested, prefix + (name,))


def _chosen_subcommand(argv: list[str]) -> str | None:
    for arg in argv:
        if arg in SUBCOMMANDS:
            return arg
        if not arg.startswith("-"):
            return None  # a positional that is no subcommand: argparse reports it
    return None


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost parser ``args`` went through (``sparsekv jit build``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return _chosen_parser(chosen, args)
    return parser


def _quiet_broken_pipe() -> int:
    # The reader went away (`| head`): point stdout at /dev/null so the interpreter's final flush
    # cannot raise again, and end without a message.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``sparsekv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    try:
        try:
            code = _run(sys.argv[1:] if argv is None else list(argv))
        except SystemExit as e:  # argparse: --help, --version, a usage error (already printed)
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else EXIT_FAILURE
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _message(error: BaseException) -> str:
    # Library messages may start with "sparsekv: " (for a program's log); the command's name is said already.
    return str(error).removeprefix("sparsekv: ")


def _run(argv: list[str]) -> int:
    from sparsekv import log

    parser = build_parser(load=_chosen_subcommand(argv) or ())
    args, extras = parser.parse_known_args(argv)
    prog = _chosen_parser(parser, args).prog  # the innermost command: `sparsekv jit build`
    if extras:  # reported here, so the message names the (nested) command they were given to
        print(f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)", file=sys.stderr)
        return EXIT_USAGE
    try:
        log.configure("DEBUG" if args.debug else {0: None, 1: "INFO"}.get(args.verbose, "DEBUG"))
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command].module).run(args) or 0)
    except BrokenPipeError:
        raise
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: error: {_message(e)} (see {prog} --help)", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the one place every other failure becomes a message
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (--debug shows the traceback)"
        print(f"{prog}: error: {type(e).__name__}: {_message(e)}{hint}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())

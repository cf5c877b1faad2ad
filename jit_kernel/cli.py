"""``sparsekv jit``: list, build (ahead of time), inspect and clean JIT kernel modules."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from sparsekv.jit_kernel import cache, loader, toolchain
from sparsekv.jit_kernel.registry import discover


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="every registered module instance and where it is cached")
    build = sub.add_parser("build", help="prebuild modules (ahead of time, e.g. for air-gapped machines)")
    build.add_argument("names", nargs="*", help="kernel families to build (default with --all: every one)")
    build.add_argument("--all", action="store_true", help="build every registered family's whole instance table")
    build.add_argument("--backend", choices=loader.BACKENDS, default="cpu")
    build.add_argument("--arch", help="cuda archs, e.g. 9.0a,10.0a (default: SPARSEKV_CUDA_ARCH, ...)")
    sub.add_parser("info", help="cache directory, size and entries")
    clean = sub.add_parser("clean", help="delete cached modules")
    clean.add_argument("--stale", action="store_true",
                       help="only entries a load would no longer use (old headers, flags or toolchains)")


def _cached_entries() -> list[dict]:
    roots = cache.open_roots()
    found = []
    for root in dict.fromkeys(roots.read + (roots.write,)):
        for entry in cache.entries(root):
            doc = json.loads((entry / cache.KEY_FILE).read_text())
            size = sum(p.stat().st_size for p in entry.iterdir())
            found.append({"root": str(root), "entry": entry.name, "name": doc["name"],
                          "args": tuple(doc["template_args"]), "backend": doc["backend"],
                          "archs": doc["archs"], "bytes": size})
    return found


def _is_current(family, entry: dict) -> bool | None:
    """Whether a cached entry is what a load would use now (headers, flags and toolchain unchanged);
    None when its toolchain is not installed here. Judged from the entry's own template arguments, so
    instances outside the family's table (open instantiation) are judged like the table's."""
    try:
        plan = loader.make_plan(family.name, entry["args"], header=family.header,
                                exports=family.exports, kernels=family.kernels, backend=entry["backend"],
                                arch=tuple(entry["archs"]) or None, probe_dir=None)
    except toolchain.ToolchainError:
        return None
    return plan.entry_name() == entry["entry"]


def _list() -> int:
    families = discover()
    cached = _cached_entries()
    for family in families.values():
        print(f"{family.name}  (csrc/{family.header}; exports: {', '.join(family.exports)})")
        for instance in family.instances:
            args = tuple(loader.cpp_template_arg(a) for a in family.template_args(instance))
            where = []
            for c in cached:
                if c["name"] != family.name or c["args"] != args:
                    continue
                state = {True: "", False: " (stale)", None: " (toolchain missing)"}[_is_current(family, c)]
                where.append(c["backend"] + (f"[{','.join(c['archs'])}]" if c["archs"] else "") + state)
            print(f"  {family.describe(instance):<60} cached: {', '.join(where) or '-'}")
    return 0


def _build(args: argparse.Namespace) -> int:
    families = discover()
    if args.all:
        chosen = list(families.values())
    elif args.names:
        unknown = [n for n in args.names if n not in families]
        if unknown:
            print(f"sparsekv jit build: unknown families {unknown}; known: {sorted(families)}", file=sys.stderr)
            return 2
        chosen = [families[n] for n in args.names]
    else:
        print("sparsekv jit build: name families to build, or --all", file=sys.stderr)
        return 2
    jobs = [(f, inst) for f in chosen for inst in f.instances]
    start = time.perf_counter()
    with tqdm(jobs, desc=f"jit build [{args.backend}]", unit="module") as bar:
        for family, instance in bar:
            bar.set_postfix_str(family.describe(instance))
            family.module(**instance, backend=args.backend, arch=args.arch)
    print(f"built {len(jobs)} module instances for the {args.backend} backend in {time.perf_counter() - start:.1f} s")
    return 0


def _info() -> int:
    roots = cache.open_roots()
    cached = _cached_entries()
    print(json.dumps({"cache_dir": str(roots.write), "read_roots": [str(r) for r in roots.read],
                      "entries": len(cached), "bytes": sum(c["bytes"] for c in cached),
                      "csrc": str(loader.csrc_root())}, indent=2))
    return 0


def _stale_entries() -> list[Path]:
    families = discover()
    stale = []
    for c in _cached_entries():
        family = families.get(c["name"])
        if family is None or _is_current(family, c) is False:
            stale.append(Path(c["root"]) / c["entry"])
    return stale


def _clean(only_stale: bool) -> int:
    roots = cache.open_roots()
    if only_stale:
        targets = [p for p in _stale_entries() if p.parent == roots.write]
    else:
        targets = [child for child in Path(roots.write).iterdir() if child.is_dir()]
    for target in targets:
        shutil.rmtree(target, ignore_errors=True)
    print(f"removed {len(targets)} {'stale entries' if only_stale else 'cache directories'} from {roots.write}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list()
    if args.action == "build":
        return _build(args)
    if args.action == "info":
        return _info()
    return _clean(args.stale)

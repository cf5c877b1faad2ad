"""``sparsekv jit``: build, inspect, verify, ship and clean JIT kernel modules.

The shell (:mod:`sparsekv.cli`) gives every subcommand its manners: examples in ``--help``, one-line
errors (exit 2 for a usage error, 1 for a failure), ``--debug``, ``-v`` (each compile with its time),
a quiet closed pipe. Here: progress bars only on a terminal, ``--json`` wherever a table is printed,
and a ``ValueError`` (a bad value on the command line or in a ``SPARSEKV_*`` variable, found by the
library) is a usage error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from sparsekv import env
from sparsekv.argtypes import int_range, number_range
from sparsekv.cli import CliParser, UsageError


def _instance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", action="append", default=[], metavar="FAMILY:k=v,...",
                   help="one module instance, e.g. 'gather_rows:index_dtype=int64' (repeatable)")
    p.add_argument("--model", choices=("dsv4-flash", "dsv4-pro", "demo"),
                   help="every instance this model's serving path loads ('demo': what `sparsekv demo` loads)")
    p.add_argument("--hot-buffer", type=int, metavar="N", help="with --model: hot-buffer slots (default 2 x top-k)")
    p.add_argument("--page-size", type=int, metavar="N", help="with --model: full-pool page size (default 256)")
    p.add_argument("--backend", choices=("cpu", "cuda", "sim"), default="cpu")
    p.add_argument("--arch", help="cuda archs, e.g. 9.0a,10.0a (default: SPARSEKV_CUDA_ARCH, then the visible GPU)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``jit`` subcommands to ``parser`` (the shell adds their examples and global options)."""
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=CliParser)

    def add(name: str, help_text: str, json_flag: bool = True) -> argparse.ArgumentParser:
        action = sub.add_parser(name, help=help_text, description=help_text)
        if json_flag:
            action.add_argument("--json", action="store_true", help="machine-readable output")
        return action

    add("list", "every registered module instance and where it is cached")
    build = add("build", "prebuild modules ahead of time (for strict-mode serving, images, air-gapped sites)")
    build.add_argument("names", nargs="*", help="kernel families whose whole instance table to build (with --triton: "
                                                "the Triton kernels to compile, by name; default all)")
    build.add_argument("--all", action="store_true", help="every registered family's instance table")
    build.add_argument("--triton", action="store_true",
                       help="compile every Triton kernel (or those named) ahead of time for --arch (no GPU needed); "
                            "report registers and shared memory per kernel")
    _instance_args(build)
    build.add_argument("--jobs", "-j", type=int_range(1), metavar="N",
                       help="parallel compiles (default: SPARSEKV_MAX_JOBS, else by free cores and memory)")
    add("info", "cache roots, entry counts and sizes")
    clean = add("clean", "delete cached modules (all, or only stale ones)")
    clean.add_argument("--stale", action="store_true",
                       help="only entries a load would no longer use, and leftovers of dead or failed builds")
    clean.add_argument("--dry-run", action="store_true", help="show what would be removed, remove nothing")
    verify = add("verify", "check every cached artifact's sha256 against its key.json")
    verify.add_argument("--repair", action="store_true", help="remove bad entries (the next load rebuilds them)")
    prune = add("prune", "remove entries not loaded for a while, or the least recently loaded beyond a size")
    prune.add_argument("--older-than", type=number_range(0), metavar="DAYS",
                       help="entries not loaded for DAYS days (a finite number >= 0)")
    prune.add_argument("--max-size", metavar="SIZE", help="keep the cache under SIZE, e.g. 20G (default: "
                                                          "SPARSEKV_CACHE_MAX_SIZE)")
    prune.add_argument("--dry-run", action="store_true", help="show what would be removed, remove nothing")
    add("doctor", "check compilers, CUDA, GPU, tvm-ffi and the cache; print fixes")
    explain = add("explain-key", "every input of a module's cache key (why two machines or checkouts differ)")
    explain.add_argument("family", nargs="?", help="kernel family, e.g. gather_rows")
    explain.add_argument("values", nargs="*", metavar="k=v", help="template arguments by name")
    explain.add_argument("--backend", choices=("cpu", "cuda", "sim"), default="cpu")
    explain.add_argument("--arch", help="cuda archs (cuda backend)")
    explain.add_argument("--diff", nargs=2, metavar=("A.json", "B.json"),
                         help="compare two `explain-key --json` outputs field by field")
    export = add("export", "write built modules and their key.json to a tar bundle")
    export.add_argument("file", help="bundle to write, e.g. kernels.tar")
    export.add_argument("--all", action="store_true", help="every valid entry in the cache")
    _instance_args(export)
    imp = add("import", "verify a bundle (hashes, platform, tvm-ffi) and add its modules to the cache")
    imp.add_argument("file", help="bundle to read")


# --- instances -------------------------------------------------------------------------------------


def parse_value(text: str) -> object:
    """A template argument as typed: ``true``/``false`` -> bool, an integer -> int, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text, 0)
    except ValueError:
        return text.strip()


def parse_values(items: list[str], what: str) -> dict[str, object]:
    """``["k=v", ...]`` -> ``{k: value}``."""
    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"{what}: expected k=v, got {item!r}")
        if key.strip() in values:
            raise UsageError(f"{what}: {key.strip()!r} is given twice")
        values[key.strip()] = parse_value(value)
    return values


# --- instances: plain values by parameter name, validated by the family ------------------------------


def _typed(value: object) -> object:
    """A value typed on a command line as the family expects it: torch dtype names become dtypes."""
    if isinstance(value, str):
        import torch

        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return value


def resolve_instance(family, values: dict[str, object]) -> dict[str, object]:
    """The instance (plain values by parameter name) of ``family`` named by ``values``.

    Any values the family's own validation accepts name an instance (open instantiation); values
    left out are taken from the one table entry that fits the rest, when exactly one does.

    Raises
    ------
    ValueError
        Unknown parameter names, or values the family rejects (the message names the argument).
    """
    values = {k: _typed(v) for k, v in values.items()}
    if set(family.params) - set(values):
        fits = [inst for inst in family.instances if all(inst.get(k) == v for k, v in values.items())]
        if len(fits) == 1:
            values = {**fits[0], **values}
    family.template_args(values)
    return values


def template_args(family, instance: dict[str, object]) -> tuple:
    """The C++ template arguments of one instance, rendered as the cache key records them."""
    from sparsekv.jit_kernel.build.loader import cpp_template_arg

    return tuple(cpp_template_arg(a) for a in family.template_args(instance))


def instance_values(family, instance: dict[str, object]) -> dict[str, object]:
    """One instance as ``{parameter: value}`` (JSON-ready)."""
    return {k: str(v).removeprefix("torch.") if not isinstance(v, (bool, int, str)) else v for k, v in instance.items()}


def _family(families: dict, name: str):
    if name not in families:
        raise UsageError(f"unknown kernel family {name!r}; known: {', '.join(sorted(families))}")
    return families[name]


#: ``model_instances``' arguments -> the ``--model`` flags that set them (for its messages).
FLAG_OF = {"`hot_buffer_size`": "--hot-buffer", "`page_size`": "--page-size"}


def _selected(args: argparse.Namespace, families: dict) -> list[tuple]:
    """``(family, instance)`` pairs named by ``names``/``--all``/``--instance``/``--model``, de-duplicated."""
    from sparsekv.srt.model_executor.deployment import model_instances
    from sparsekv.srt.model_executor.plan_breakdown import name_flags

    chosen = []
    if getattr(args, "all", False):
        chosen += [(f, i) for f in families.values() for i in f.instances]
    for name in getattr(args, "names", []) or []:
        family = _family(families, name)
        chosen += [(family, i) for i in family.instances]
    for spec in args.instance:
        name, sep, rest = spec.partition(":")
        family = _family(families, name.strip())
        values = parse_values([p for p in rest.split(",") if p.strip()], f"--instance {spec!r}") if sep else {}
        chosen.append((family, resolve_instance(family, values)))
    if args.model:
        try:
            instances = model_instances(args.model, hot_buffer_size=args.hot_buffer, page_size=args.page_size)
        except ValueError as exc:  # the library names its arguments; the user gave flags
            raise UsageError(name_flags(str(exc), FLAG_OF)) from exc
        for name, values in instances:
            family = _family(families, name)
            chosen.append((family, resolve_instance(family, values)))
    elif args.hot_buffer is not None or args.page_size is not None:
        raise UsageError("--hot-buffer and --page-size go with --model")
    unique = {(f.name, template_args(f, i)): (f, i) for f, i in reversed(chosen)}  # first occurrence wins
    return list(reversed(unique.values()))


def _plan(family, args: tuple, backend: str, arch, probe_dir=None, csrc: Path | None = None):
    """The build plan of ``family`` for C++ template arguments ``args`` (see :func:`template_args`)."""
    from sparsekv.jit_kernel.build import loader

    return loader.make_plan(family.name, args, header=family.header, exports=family.exports,
                            kernels=family.kernels, backend=backend, arch=arch, probe_dir=probe_dir, csrc=csrc)


# --- output helpers --------------------------------------------------------------------------------


def _emit(args: argparse.Namespace, doc, text: Callable[[], str]) -> None:
    print(json.dumps(doc, indent=2, default=str) if getattr(args, "json", False) else text())


def _bar(total: int, desc: str):
    """A tqdm bar on stderr, drawn only when stderr is a terminal (no carriage returns in logs)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="module", file=sys.stderr, disable=not sys.stderr.isatty(),
                dynamic_ncols=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# --- subcommands -----------------------------------------------------------------------------------


def _roots():
    from sparsekv.jit_kernel.build import cache

    roots = cache.open_roots()
    try:
        write = roots.write
    except PermissionError:
        write = None
    return roots, [r for r in dict.fromkeys(roots.read + ((write,) if write else ())) if r.is_dir()], write


def _cached_entries() -> list[dict]:
    """Every published entry of every root: the one count ``list``, ``info`` and ``clean`` share."""
    from sparsekv.jit_kernel.build import cache

    found = []
    for root in _roots()[1]:
        for entry in cache.entries(root):
            try:
                doc = json.loads((entry / cache.KEY_FILE).read_text())
                size = cache.entry_bytes(entry)
            except (OSError, ValueError):
                doc, size = {}, 0
            found.append({"root": str(root), "entry": entry.name, "name": doc.get("name", "?"),
                          "args": tuple(doc.get("template_args", ())), "backend": doc.get("backend", "?"),
                          "archs": doc.get("archs", []), "bytes": size})
    return found


def _is_current(family, entry: dict) -> bool | None:
    """Whether a cached entry is what a load would use now (judged from its own template arguments);
    None when its toolchain is not installed."""
    from sparsekv.jit_kernel.build import arch as arch_mod
    from sparsekv.jit_kernel.build import toolchain

    try:
        plan = _plan(family, entry["args"], entry["backend"], tuple(entry["archs"]) or None)
    except (toolchain.ToolchainError, arch_mod.ArchError):
        return None
    return plan.entry_name() == entry["entry"]


def _list(args) -> int:
    from sparsekv.jit_kernel.build.registry import discover

    cached = _cached_entries()
    rows = []
    for family in discover().values():
        for instance in family.instances:
            cpp = template_args(family, instance)
            where = []
            for c in cached:
                if c["name"] == family.name and c["args"] == cpp:
                    state = {True: "current", False: "stale", None: "toolchain missing"}[
                        _is_current(family, c)]
                    where.append({"backend": c["backend"], "archs": c["archs"], "state": state, "entry": c["entry"]})
            rows.append({"family": family.name, "header": family.header, "instance": family.describe(instance),
                         "params": instance_values(family, instance), "cached": where})
    # Entries outside the tables (instances built on demand, families since removed) are listed too.
    listed = {(r["family"], e["entry"]) for r in rows for e in r["cached"]}
    for c in cached:
        if (c["name"], c["entry"]) not in listed:
            rows.append({"family": c["name"], "header": None, "instance": f"{c['name']}<{', '.join(c['args'])}>",
                         "params": None, "cached": [{"backend": c["backend"], "archs": c["archs"],
                                                     "state": "not in the instance table", "entry": c["entry"]}]})

    def text() -> str:
        lines = []
        for row in rows:
            where = [w["backend"] + (f"[{','.join(w['archs'])}]" if w["archs"] else "")
                     + ("" if w["state"] == "current" else f" ({w['state']})") for w in row["cached"]]
            lines.append(f"{row['instance']:<64} cached: {', '.join(where) or '-'}")
        return "\n".join(lines)

    _emit(args, rows, text)
    return 0


def _build(args) -> int:
    from sparsekv.jit_kernel.build import cache, loader, resources
    from sparsekv.jit_kernel.build.registry import discover

    if args.triton:
        if args.all or args.instance or args.model:
            raise UsageError("--triton builds the Triton kernels only; build the header families in another call")
        return _build_triton(args)
    loader.building_on_purpose()
    families = discover()
    if not (args.all or args.names or args.instance or args.model):
        raise UsageError("name families to build, or --all, --instance or --model, or --triton")
    jobs = _selected(args, families)
    roots = cache.open_roots()
    plans = [(f, i, _plan(f, template_args(f, i), args.backend, args.arch, roots.probe_dir())) for f, i in jobs]
    cached = [p for _, _, p in plans if any(cache.valid_artifact(root / p.entry_name()) for root in roots.read)]
    workers = min(len(plans), resources.build_jobs(args.backend, args.jobs)) or 1
    start = time.perf_counter()
    with _bar(len(plans), f"building ({workers} jobs)") as bar, \
            concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(loader.find_or_build, plan, roots): (f, i) for f, i, plan in plans}
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
                family, instance = futures[future]
                bar.set_postfix_str(family.describe(instance)[:60])
                bar.update()
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    seconds = time.perf_counter() - start
    built = len(plans) - len(cached)
    doc = {"backend": args.backend, "built": built, "cached": len(cached), "jobs": workers,
           "seconds": round(seconds, 2), "entries": [p.entry_name() for _, _, p in plans]}
    _emit(args, doc, lambda: f"built {built} module instances for the {args.backend} backend in {seconds:.1f} s "
                             f"({workers} parallel jobs); {len(cached)} were already cached")
    return 0


def _build_triton(args) -> int:
    from sparsekv.jit_kernel.build import cache
    from sparsekv.jit_kernel.build.arch import resolve_arch_list

    try:
        from sparsekv.jit_kernel.triton import aot, interpreting
    except ImportError as exc:
        raise UsageError(f"--triton needs triton installed ({exc})") from exc
    archs = resolve_arch_list(args.arch)
    kernels = aot.aot_kernels()
    unknown = sorted(set(args.names) - {k.name for k in kernels})
    if unknown:
        raise UsageError(f"--triton: no Triton kernel is named {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(k.name for k in kernels)}")
    if args.names:
        kernels = [k for k in kernels if k.name in args.names]
    if interpreting():
        # Under the interpreter @triton.jit gives functions that cannot compile: build in a child without it.
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        command = ["jit", "build", "--triton", "--arch", ",".join(archs), *args.names] + (["--json"] if args.json
                                                                                          else [])
        return subprocess.run([sys.executable, "-m", "sparsekv", *command], env=env).returncode
    root = cache.open_roots().write
    start = time.perf_counter()
    reports = []
    with _bar(len(kernels) * len(archs), "compiling triton kernels") as bar:
        for kernel in kernels:
            for arch in archs:
                reports.append(aot.build(kernel, arch, root))
                bar.update()
    seconds = time.perf_counter() - start
    doc = {"archs": list(archs), "kernels": reports, "seconds": round(seconds, 2)}

    def text() -> str:
        rows = [f"{r['kernel']:<40} {r['arch']:>6} {r['registers']:>4} regs {r['shared_bytes']:>7} B shared"
                f"{'  (cached)' if r['cached'] else ''}" for r in reports]
        return "\n".join(rows + [f"compiled {len(reports)} Triton kernels for {','.join(archs)} in {seconds:.1f} s"])

    _emit(args, doc, text)
    return 0


def _info(args) -> int:
    from sparsekv.jit_kernel.build import loader

    roots, existing, write = _roots()
    cached = _cached_entries()
    per_root = {str(r): {"entries": 0, "bytes": 0} for r in existing}
    for c in cached:
        per_root[c["root"]]["entries"] += 1
        per_root[c["root"]]["bytes"] += c["bytes"]
    doc = {"cache_dir": str(write) if write else None, "configured": str(roots.primary), "roots": per_root,
           "entries": len(cached), "bytes": sum(c["bytes"] for c in cached), "csrc": str(loader.csrc_root()),
           "strict": env.jit_strict()}

    def text() -> str:
        lines = [f"cache: {doc['cache_dir'] or 'not writable'} (configured {doc['configured']})"]
        lines += [f"  {root}: {v['entries']} entries, {_human(v['bytes'])}" for root, v in per_root.items()]
        lines += [f"total: {doc['entries']} entries, {_human(doc['bytes'])}", f"headers: {doc['csrc']}",
                  f"strict mode: {'on' if doc['strict'] else 'off'}"]
        return "\n".join(lines)

    _emit(args, doc, text)
    return 0


def _stale_entries() -> list[Path]:
    from sparsekv.jit_kernel.build.registry import discover

    families = discover()
    stale = []
    for c in _cached_entries():
        family = families.get(c["name"])
        if family is None or _is_current(family, c) is False:
            stale.append(Path(c["root"]) / c["entry"])
    return stale


def _clean(args) -> int:
    from sparsekv.jit_kernel.build import cache

    _, existing, write = _roots()
    if write is None:
        raise RuntimeError("sparsekv: no writable cache root to clean")
    if args.stale:
        entries = [p for p in _stale_entries() if p.parent == write]
    else:
        entries = cache.entries(write)
    leftovers = cache.sweep_leftovers(write, dry_run=True)
    if not args.dry_run:
        for entry in entries:
            cache.discard(entry)
        leftovers = cache.sweep_leftovers(write)
        if not args.stale:
            shutil.rmtree(write / ".index", ignore_errors=True)  # shortcuts to entries that are gone
    staging = [p for p in leftovers if p.parent.name in (".staging", ".trash")]
    verb = "would remove" if args.dry_run else "removed"
    kind = "stale entries" if args.stale else "entries"
    doc = {"root": str(write), "dry_run": args.dry_run, "stale_only": args.stale,
           "entries": [p.name for p in entries], "leftovers": [str(p) for p in staging]}
    _emit(args, doc, lambda: "\n".join([f"  {p.name}" for p in entries] * bool(args.dry_run)
                                       + [f"{verb} {len(entries)} {kind} and {len(staging)} leftovers of dead or "
                                          f"failed builds from {write}"]))
    return 0


def _verify(args) -> int:
    from sparsekv.jit_kernel.build import cache

    _, existing, write = _roots()
    results = []
    for root in existing:
        for entry in cache.entries(root):
            problem = cache.verify_entry(entry)
            repaired = False
            if problem and args.repair:
                try:
                    cache.discard(entry)
                    repaired = True
                except OSError as exc:
                    problem += f" (cannot remove: {exc.strerror})"
            results.append({"entry": entry.name, "root": str(root), "ok": problem is None, "problem": problem,
                            "removed": repaired})
    bad = [r for r in results if not r["ok"]]

    def text() -> str:
        lines = [f"BAD {r['entry']}: {r['problem']}" + ("; removed, the next load rebuilds it" if r["removed"] else "")
                 for r in bad]
        lines.append(f"verified {len(results)} entries: {len(results) - len(bad)} ok, {len(bad)} bad"
                     + ("" if not bad or args.repair else " (run `sparsekv jit verify --repair`)"))
        return "\n".join(lines)

    _emit(args, {"entries": results, "bad": len(bad)}, text)
    return 1 if any(not r["removed"] for r in bad) else 0


def _prune(args) -> int:
    from sparsekv.jit_kernel.build import cache

    _, _, write = _roots()
    if write is None:
        raise RuntimeError("sparsekv: no writable cache root to prune")
    max_bytes = env.parse_size(args.max_size, "--max-size") if args.max_size else env.cache_max_size()
    if args.older_than is None and max_bytes is None:
        raise UsageError("give --older-than DAYS and/or --max-size SIZE (or set SPARSEKV_CACHE_MAX_SIZE)")
    older = None if args.older_than is None else args.older_than * 86400.0
    removed = cache.prune(write, older_than_s=older, max_bytes=max_bytes, dry_run=args.dry_run)
    remaining = cache.entries(write)
    doc = {"root": str(write), "dry_run": args.dry_run, "removed": [p.name for p in removed],
           "remaining_entries": len(remaining) - (len(removed) if args.dry_run else 0)}
    verb = "would remove" if args.dry_run else "removed"
    _emit(args, doc, lambda: "\n".join([f"  {p.name}" for p in removed]
                                       + [f"{verb} {len(removed)} entries from {write}"]))
    return 0


def _doctor(args) -> int:
    from sparsekv.jit_kernel.build import doctor

    checks = doctor.run_checks()
    _emit(args, doctor.as_json(checks), lambda: doctor.as_text(checks))
    return 0 if doctor.usable(checks) else 1


def explain(family, instance: dict, backend: str, arch, csrc: Path | None = None) -> dict:
    """Every input of ``family``'s cache key for ``instance`` (no absolute path: checkouts compare equal)."""

    plan = _plan(family, template_args(family, instance), backend, arch, csrc=csrc)
    return {"family": family.name, "instance": family.describe(instance), "entry": plan.entry_name(),
            "key": plan.key_doc()}


def _flatten(doc, prefix: str = "") -> dict[str, object]:
    if isinstance(doc, dict):
        out = {}
        for k, v in doc.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: doc}


def diff_keys(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """``(field, a, b)`` for every key input that differs between two ``explain-key --json`` documents."""
    fa, fb = _flatten(a.get("key", a)), _flatten(b.get("key", b))
    missing = object()
    return [(k, fa.get(k, "<absent>"), fb.get(k, "<absent>")) for k in sorted(set(fa) | set(fb))
            if fa.get(k, missing) != fb.get(k, missing)]


def _explain(args) -> int:
    from sparsekv.jit_kernel.build.registry import discover

    if args.diff:
        docs = []
        for path in args.diff:
            try:
                docs.append(json.loads(Path(path).read_text()))
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"sparsekv: cannot read {path} as `explain-key --json` output ({exc})") from exc
        rows = diff_keys(*docs)
        doc = {"identical": not rows, "differences": [{"field": k, "a": x, "b": y} for k, x, y in rows]}
        _emit(args, doc, lambda: "identical keys" if not rows else "\n".join(
            [f"{len(rows)} key input{' differs' if len(rows) == 1 else 's differ'}:"]
            + [f"  {k}:\n    A: {x}\n    B: {y}" for k, x, y in rows]))
        return 1 if rows else 0  # as diff(1): 1 when the keys differ
    if not args.family:
        raise UsageError("name a kernel family (or use --diff A.json B.json)")
    family = _family(discover(), args.family)
    instance = resolve_instance(family, parse_values(args.values, "explain-key"))
    doc = explain(family, instance, args.backend, args.arch)

    def text() -> str:
        lines = [f"{doc['instance']} -> entry {doc['entry']}"]
        for k, v in _flatten(doc["key"]).items():
            lines.append(f"  {k}: {v}")
        return "\n".join(lines)

    _emit(args, doc, text)
    return 0


def _export(args) -> int:
    from sparsekv.jit_kernel.build import bundle, cache
    from sparsekv.jit_kernel.build.registry import discover

    _, existing, _ = _roots()
    if args.all:
        dirs = [e for r in existing for e in cache.entries(r)]  # each checked in full by export_bundle
    else:
        if not (args.instance or args.model):
            raise UsageError("choose what to export: --all, --instance or --model")
        args.names = []
        wanted = {_plan(f, template_args(f, i), args.backend, args.arch).entry_name()
                  for f, i in _selected(args, discover())}
        dirs = [e for r in existing for e in cache.entries(r) if e.name in wanted]
        missing = wanted - {e.name for e in dirs}
        if missing:
            raise RuntimeError(f"sparsekv: not built here: {', '.join(sorted(missing))}; run `sparsekv jit build` "
                               f"with the same options first")
    manifest = bundle.export_bundle(Path(args.file), list({e.name: e for e in dirs}.values()))
    _emit(args, manifest, lambda: f"exported {len(manifest['entries'])} modules to {args.file}")
    return 0


def _import(args) -> int:
    from sparsekv.jit_kernel.build import bundle, cache

    root = cache.open_roots().write
    imported, present = bundle.import_bundle(Path(args.file), root)
    doc = {"root": str(root), "imported": imported, "already_present": present}
    _emit(args, doc, lambda: f"imported {len(imported)} modules into {root} ({len(present)} already present)")
    return 0


ACTIONS = {"list": _list, "build": _build, "info": _info, "clean": _clean, "verify": _verify, "prune": _prune,
           "doctor": _doctor, "explain-key": _explain, "export": _export, "import": _import}


def run(args: argparse.Namespace) -> int:
    """Run one ``sparsekv jit`` subcommand; returns the exit status (errors: see the module docstring)."""
    try:
        return ACTIONS[args.action](args)
    except ValueError as exc:  # a bad value of the user's, named by the library's message
        raise UsageError(str(exc)) from exc

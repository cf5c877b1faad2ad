"""The repository layout's import directions (CONTRIBUTING.md, "Layout"), pinned on the sources.

Every ``import`` of every module is read with ``ast`` (function-level imports included, and the
names a package resolves lazily through its ``_LAZY`` table), and the rules hold for what a module
can REACH through any chain of imports, not only for its direct imports: a lazy import three hops
away breaks a direction as surely as a direct one. Kernel headers are read for their includes. A
fresh process checks that memory planning imports neither the kernel package nor torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDER_OF = {"jit_kernel": "sparsekv.jit_kernel", "srt": "sparsekv.srt", "sparsekv": "sparsekv"}

# The front ends: the console script's shell and every command (sparsekv/cli/), ``python -m sparsekv``.
FRONT_ENDS = ("sparsekv.cli", "sparsekv.__main__")
LIBRARIES = ("sparsekv.jit_kernel", "sparsekv.srt", "sparsekv.testing")

# (modules, prefixes they never reach, why); a prefix "a.b" names a.b and its submodules.
UNREACHABLE = [
    ("sparsekv.jit_kernel", ("sparsekv.srt", "sparsekv.testing"),
     "kernels know nothing of pools or of the test harness"),
    ("sparsekv.srt", ("sparsekv.testing",), "runtime code does not depend on the test harness"),
    ("sparsekv.srt.model_executor", ("sparsekv.jit_kernel",),
     "memory planning never loads the kernel package (layouts: sparsekv.kv_layout)"),
    ("sparsekv.testing.reference", ("sparsekv.jit_kernel",),
     "a torch reference is the wrappers' oracle, never built on one (layouts: sparsekv.kv_layout, "
     "RoPE: sparsekv.rope)"),
]
# (folder or file, prefixes never imported at module level, why)
NOT_AT_IMPORT = [
    ("srt/model_executor", ("torch", "tvm_ffi"), "memory planning imports no torch at import"),
    ("sparsekv/kv_layout.py", ("torch", "tvm_ffi"), "the layout table is a torch-free leaf"),
    ("sparsekv/env.py", ("torch", "tvm_ffi"), "the environment table is a torch-free leaf"),
    ("sparsekv/checks.py", ("torch", "tvm_ffi", "numpy"), "the scalar checks are a torch-free leaf"),
]

def _module_name(path: Path) -> list[str]:
    rel = path.relative_to(REPO).with_suffix("").parts
    return FOLDER_OF[rel[0]].split(".") + list(rel[1:])


def _imports(path: Path) -> list[tuple[int, bool, str]]:
    """``(line, at module level, module)`` of every import in ``path``, relative ones resolved;
    ``from package import name`` also yields ``package.name`` (a submodule, or not: see :func:`_graph`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    typing_only = _under_type_checking(tree)
    found = []
    for node in ast.walk(tree):
        if node.__class__ not in (ast.Import, ast.ImportFrom) or node.lineno in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            if node.level:
                package = _module_name(path)[: -node.level] if path.name != "__init__.py" else \
                    _module_name(path)[: len(_module_name(path)) - node.level]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module
            names = [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
        found += [(node.lineno, id(node) in top, name) for name in names]
    return found


def _under_type_checking(tree: ast.Module) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks (annotations only, never imported at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _lazy_table(path: Path) -> dict[str, str]:
    """A package's ``_LAZY`` table (name -> submodule), which its ``__getattr__`` imports on access."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return {k.value: v.value for k, v in zip(node.value.keys, node.value.values)}
    return {}


@cache
def _graph() -> dict[str, frozenset[str]]:
    """Every sparsekv module -> the sparsekv modules importing it executes directly: its imports
    (a ``from package import Name`` that the package resolves lazily counts as importing the module
    defining Name) and the packages above it (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)."""
    paths = {}
    for folder in FOLDER_OF:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = _module_name(path)
            paths[".".join(name[:-1] if name[-1] == "__init__" else name)] = path
    lazy = {name: _lazy_table(path) for name, path in paths.items() if path.name == "__init__.py"}

    def resolve(module: str) -> str | None:
        package, _, attr = module.rpartition(".")
        if module in paths:
            return module
        if attr in lazy.get(package, {}):
            return f"{package}.{lazy[package][attr]}"
        return package if package in paths else None

    graph = {}
    for name, path in paths.items():
        targets = {resolve(module) for _, _, module in _imports(path)}
        parts = name.split(".")
        targets |= {".".join(parts[:i]) for i in range(1, len(parts))}
        graph[name] = frozenset(t for t in targets if t and t != name)
    return graph


def _reachable(module: str) -> set[str]:
    graph, seen, todo = _graph(), set(), [module]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def _matches(module: str, prefix: str) -> bool:
    """``prefix`` "a.b" names a.b and its submodules; "a." names every submodule of a."""
    return module.startswith(prefix) if prefix.endswith(".") else module == prefix or module.startswith(prefix + ".")


def _front_ends() -> set[str]:
    """The front-end modules: those under :data:`FRONT_ENDS`."""
    return {m for m in _graph() if any(_matches(m, p) for p in FRONT_ENDS)}


def test_every_command_lives_in_the_cli_package():
    """The shell's commands are modules of ``sparsekv.cli`` (a library keeps pure functions)."""
    from sparsekv.cli import SUBCOMMANDS

    assert {name: sub.module for name, sub in SUBCOMMANDS.items() if not _matches(sub.module, "sparsekv.cli")} == {}


@pytest.mark.parametrize("where, never, why", UNREACHABLE, ids=[w for w, *_ in UNREACHABLE])
def test_what_a_layer_can_reach(where, never, why):
    bad = [f"{module} reaches {target}" for module in sorted(_graph()) if _matches(module, where)
           for target in sorted(_reachable(module)) if any(_matches(target, p) for p in never)]
    assert not bad, f"{why}:\n" + "\n".join(bad)


# jit_kernel/ holds the family wrappers (one per header csrc/<stem>.cuh) and what every wrapper
# shares; jit_kernel/build/ the machinery that compiles and loads them.
BUILD = "sparsekv.jit_kernel.build"
# dsv4 re-exports the DSV4 families; torch_op registers custom ops; hisparse_params: both swap-ins' values
WRAPPER_HELPERS = {"__init__", "dsv4", "torch_op", "hisparse_params", "bound_call"}


def test_jit_kernel_holds_the_family_wrappers_and_build_the_machinery():
    """Each module directly under ``jit_kernel/`` is a family's wrapper (its stem has a header) or a
    named helper wrappers share; the machinery (registry, loader, cache, ...) is in ``build/``."""
    headers = {p.stem for p in (REPO / "csrc").glob("*.cuh")}
    stray = sorted(p.name for p in (REPO / "jit_kernel").glob("*.py") if p.stem not in headers | WRAPPER_HELPERS)
    assert not stray, f"neither a family wrapper (no csrc/<stem>.cuh) nor a shared helper: {stray}"
    machinery = {p.stem for p in (REPO / "jit_kernel" / "build").glob("*.py")}
    assert {"registry", "loader", "cache", "toolchain", "arch"} <= machinery and not machinery & headers


def test_the_build_machinery_knows_no_family():
    """``sparsekv.jit_kernel.build`` reaches no wrapper: families declare what to build, the machinery
    builds whatever it is given (``registry.discover`` imports the wrappers by name, at run time)."""
    wrappers = {m for m in _graph() if _matches(m, "sparsekv.jit_kernel.") and not _matches(m, BUILD)}
    bad = [f"{m} reaches {t}" for m in sorted(_graph()) if _matches(m, BUILD)
           for t in sorted(_reachable(m) & wrappers)]
    assert wrappers and not bad, "\n".join(bad)


def test_the_root_modules_are_leaves():
    """``sparsekv/*.py`` (env, kv_layout, log, ...) reach only each other: anyone may import them."""
    roots = {m for m in _graph() if m.count(".") == 1} - _front_ends()
    assert {"sparsekv.env", "sparsekv.kv_layout", "sparsekv.log", "sparsekv._lazy"} <= roots
    bad = [f"{m} reaches {t}" for m in sorted(roots) for t in sorted(_reachable(m) - roots - {"sparsekv"})]
    assert not bad, "\n".join(bad)


def test_front_ends_import_libraries_never_the_reverse():
    """Nothing outside the front ends (the libraries jit_kernel, srt, testing, and the root leaves) reaches
    ``sparsekv.cli``: a command line is a consumer of the libraries, never a layer below them."""
    front = _front_ends()
    libraries = {m for m in _graph() if any(_matches(m, p) for p in LIBRARIES)}
    assert libraries and front and not libraries & front
    bad = [f"{m} reaches {t}" for m in sorted(set(_graph()) - front) for t in sorted(_reachable(m) & front)]
    assert not bad, "\n".join(bad)


def _circles() -> set[frozenset[str]]:
    """The import circles: sets of modules each of which reaches every other (a package reached back
    from its own submodule is no circle: importing the submodule runs the package first)."""
    graph = _graph()
    circles = {frozenset(m for m in _reachable(module) if module in _reachable(m)) | {module}
               for module in graph if module in _reachable(module)}
    return {c for c in circles if not all(_matches(m, min(c, key=len)) for m in c)}


def test_no_import_circles():
    """Every import chain runs one way (issue 29 took apart the last five circles)."""
    assert not _circles(), "import circles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in _circles())


@pytest.mark.parametrize("where, at_import, why", NOT_AT_IMPORT, ids=[w for w, *_ in NOT_AT_IMPORT])
def test_nothing_heavy_at_import(where, at_import, why):
    root = REPO / where
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    assert files, where
    bad = [f"{path.relative_to(REPO)}:{line} imports {module}" for path in files
           for line, top_level, module in _imports(path) if top_level and any(_matches(module, p) for p in at_import)]
    assert not bad, f"{why}:\n" + "\n".join(bad)


def test_the_rules_see_the_chains_they_forbid():
    """The graph follows function-level imports through several hops (the jit front end builds a
    model's instances from the planner's presets) and names resolved through a package's lazy table."""
    assert "sparsekv.srt.model_executor.model_spec" in _reachable("sparsekv.cli.jit")
    assert {"sparsekv.srt.model_executor.model_spec", "sparsekv.srt.model_executor.pool_planner"} <= \
        _graph()["sparsekv.cli.demo.stack"]  # `from sparsekv.srt.model_executor import DSV4ModelSpec, plan_pipeline`


def test_kernel_headers_include_only_the_shared_headers():
    """A family's header includes the shared headers of csrc/include/sparsekv/, never another family's:
    what two families share (RoPE, the row stores, the store's finish, the window pooling, the swap-in)
    is a building block there. The shared headers include only each other; the simulator
    (csrc/sim/, test infrastructure) is none of them."""
    include = re.compile(r'#\s*include\s*"([^"]+)"')
    shared = {f"sparsekv/{p.name}" for p in (REPO / "csrc" / "include" / "sparsekv").iterdir()}
    assert "sparsekv/sim.h" not in shared and (REPO / "csrc" / "sim" / "sim.h").is_file()
    headers = sorted((REPO / "csrc").glob("*.cuh")) + sorted((REPO / "csrc" / "include" / "sparsekv").iterdir())
    bad = [f"{header.relative_to(REPO)} includes {name}" for header in headers
           for name in include.findall(header.read_text()) if name not in shared]
    assert not bad, "\n".join(bad)


def _families() -> dict:
    from sparsekv.jit_kernel.build.registry import discover

    return discover()


def test_no_hand_kept_list_of_families():
    """Every list of kernel families is derived from the registry (``discover()``, ``KernelFamily.stem``)
    or from the stems' files, never written out: no tuple, list, set or dict literal anywhere in the
    code or the tests names three families (or their ``bench_<stem>.py`` / ``test_<stem>.py``), so a
    new family needs no edit outside its own files (docs/kernel-development.md, "To add a kernel family")."""
    families = _families()
    names = set(families) | {family.stem for family in families.values()}
    bad = []
    for folder in ("sparsekv", "jit_kernel", "srt", "tools", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
                if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or elements is None:
                    continue
                named = {e.value.removeprefix("bench_").removeprefix("test_").removesuffix(".py") for e in elements
                         if isinstance(e, ast.Constant) and isinstance(e.value, str)} & names
                if len(named) >= 3:
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno} lists {sorted(named)}")
    assert not bad, "derive these from the registry:\n" + "\n".join(bad)


def _imports_of_testing(path: Path, kind: str) -> set[str]:
    """The ``sparsekv.testing.<kind>.<stem>`` modules a test file imports (``kind``: reference, strategies)."""
    prefix = f"sparsekv.testing.{kind}."
    return {module[len(prefix):].split(".")[0] for _, _, module in _imports(path) if module.startswith(prefix)}


def test_a_family_is_its_stems_files():
    """Adding a family is its header, wrapper, reference, strategies, tests and benchmark, by stem
    (docs/kernel-development.md): every registered family's stem has each, where a family that fuses
    others (the fused compress-store, the indexed swap-in) may take its reference and strategies from
    the families it fuses (its tests import theirs: their strategies bring their references); and every
    reference and strategies module is a family's."""
    stems = sorted({family.stem for family in _families().values()})
    missing = []
    for stem in stems:
        test = REPO / "tests" / "kernels" / f"test_{stem}.py"
        for path in (f"csrc/{stem}.cuh", f"jit_kernel/{stem}.py", f"tests/kernels/test_{stem}.py",
                     f"tools/bench/bench_{stem}.py"):
            if not (REPO / path).is_file():
                missing.append(path)
        borrowed = test.is_file() and (_imports_of_testing(test, "reference") | _imports_of_testing(test, "strategies")
                                       ) & set(stems)
        for kind in ("reference", "strategies"):
            if not (REPO / "sparsekv" / "testing" / kind / f"{stem}.py").is_file() and not borrowed:
                missing.append(f"sparsekv/testing/{kind}/{stem}.py (or the fused families', imported by its tests)")
    assert not missing, "\n".join(missing)
    for kind in ("reference", "strategies"):
        modules = {p.stem for p in (REPO / "sparsekv" / "testing" / kind).glob("*.py")} - {"__init__"}
        assert modules and modules <= set(stems), f"{kind} modules of no family: {sorted(modules - set(stems))}"


def test_planning_imports_neither_the_kernel_package_nor_torch():
    code = ("import sys; import sparsekv.cli.plan_memory, sparsekv.srt.model_executor.plan_breakdown, "
            "sparsekv.srt.model_executor.pool_planner; "
            "print(sorted(m for m in sys.modules if m.startswith(('sparsekv.jit_kernel', 'torch', 'tvm_ffi'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_file_cites_documents_outside_the_repository():
    pattern = re.compile(r"\.\./shared|(?<![\w.])shared/(golden|reference|seeds)|reference/[\w-]+\.md")
    suffixes = {".py", ".h", ".cuh", ".md", ".toml", ".txt", ".cfg"}
    bad = []
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in {".venv", ".git", ".cache", "build"} or path.suffix not in suffixes or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line) and path.name != "test_layout.py":
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)

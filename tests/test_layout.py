"""The repository layout's import directions (README, "Layout"), pinned on the sources.

Every ``import`` of every module is read with ``ast`` (function-level imports included), so a
direction cannot be broken by a lazy import either; kernel headers are read for their includes.
A fresh process checks that memory planning imports neither the kernel package nor torch.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# (folder or file, prefixes never imported, prefixes never imported at module level, why)
FORBIDDEN = [
    ("jit_kernel", ("sparsekv.srt", "sparsekv.testing"), (), "kernels know nothing of pools or of the test harness"),
    ("srt", ("sparsekv.testing",), (), "runtime code does not depend on the test harness"),
    ("srt/model_executor", ("sparsekv.jit_kernel",), ("torch", "tvm_ffi"),
     "memory planning never loads the kernel package (layouts: sparsekv.kv_layout) nor torch at import"),
    ("sparsekv/kv_layout.py", ("sparsekv.",), ("torch", "tvm_ffi"), "the layout table is a leaf, importable by anyone"),
    ("sparsekv/env.py", ("sparsekv.",), ("torch", "tvm_ffi"), "the environment table is a leaf"),
]
FOLDER_OF = {"jit_kernel": "sparsekv.jit_kernel", "srt": "sparsekv.srt", "sparsekv": "sparsekv"}


def _module_name(path: Path) -> list[str]:
    rel = path.relative_to(REPO).with_suffix("").parts
    return FOLDER_OF[rel[0]].split(".") + list(rel[1:])


def _imports(path: Path) -> list[tuple[int, bool, str]]:
    """``(line, at module level, module)`` of every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    typing_only = _under_type_checking(tree)
    found = []
    for node in ast.walk(tree):
        if node.__class__ not in (ast.Import, ast.ImportFrom) or node.lineno in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif node.level:
            package = _module_name(path)[: -node.level] if path.name != "__init__.py" else \
                _module_name(path)[: len(_module_name(path)) - node.level]
            names = [".".join(package + ([node.module] if node.module else []))]
        else:
            names = [node.module]
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


def _matches(module: str, prefix: str) -> bool:
    """``prefix`` "a.b" names a.b and its submodules; "a." names every submodule of a."""
    return module.startswith(prefix) if prefix.endswith(".") else module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("where, anywhere, at_import, why", FORBIDDEN, ids=[w for w, *_ in FORBIDDEN])
def test_import_directions(where, anywhere, at_import, why):
    root = REPO / where
    files = [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))
    assert files, where
    bad = []
    for path in files:
        for line, top_level, module in _imports(path):
            forbidden = anywhere + (at_import if top_level else ())
            if any(_matches(module, prefix) for prefix in forbidden):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, f"{why}:\n" + "\n".join(bad)


# The exceptions: the fused store runs the compressor's window pooling and the quantizer's row
# stores in a single pass over the window, so it builds on those two families' headers; the indexed
# swap-in is the swap-in with other tables, so it builds on its layouts, checks and hash table.
FUSED_FAMILY_INCLUDES = {"dsv4_store.cuh": {"dsv4_compress.cuh", "dsv4_quant.cuh"},
                         "hisparse_index.cuh": {"hisparse.cuh"}}


def test_kernel_headers_include_only_the_shared_headers():
    """A family's header includes the shared headers of csrc/include/sparsekv/, never another family's
    (except the listed fused families)."""
    include = re.compile(r'#\s*include\s*"([^"]+)"')
    for header in sorted((REPO / "csrc").glob("*.cuh")):
        allowed = FUSED_FAMILY_INCLUDES.get(header.name, set())
        for name in include.findall(header.read_text()):
            assert name.startswith("sparsekv/") or name in allowed, f"{header.name} includes {name}"
    for header in sorted((REPO / "csrc" / "include" / "sparsekv").iterdir()):
        for name in include.findall(header.read_text()):
            assert name.startswith("sparsekv/"), f"{header.name} includes {name}"


def test_planning_imports_neither_the_kernel_package_nor_torch():
    code = ("import sys; import sparsekv.srt.model_executor.plan_memory, sparsekv.srt.model_executor.pool_planner; "
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

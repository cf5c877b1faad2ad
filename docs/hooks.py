"""MkDocs hooks (``mkdocs.yml``, ``hooks:``): the API reference reads the package as installed.

The import names map folders (``setup.py``'s ``FOLDER_OF``: ``srt/`` is ``sparsekv.srt``), so
the reference's generator, which reads sources without importing them, is given a tree in which
``sparsekv/srt`` and the others are links to those folders.
"""

from __future__ import annotations

import ast
import shutil
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

REPO = Path(__file__).resolve().parent.parent


def folder_of_import_name() -> dict[str, str]:
    """``setup.py``'s ``FOLDER_OF`` mapping, read without running ``setup()``."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FOLDER_OF" for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError("setup.py defines no FOLDER_OF")


def package_tree(root: Path) -> Path:
    """Link ``sparsekv/``'s entries and each mapped folder under ``root/sparsekv``; return ``root``."""
    package = root / "sparsekv"
    package.mkdir()
    mapped = {name.split(".", 1)[1]: folder for name, folder in folder_of_import_name().items()}
    for entry in (REPO / "sparsekv").iterdir():
        if entry.name not in mapped and entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in mapped.items():
        (package / name).symlink_to(REPO / folder)
    return root


_TREE: Path | None = None


@event_priority(100)  # before mkdocstrings reads its handlers' options
def on_config(config):
    global _TREE
    _TREE = package_tree(Path(tempfile.mkdtemp(prefix="sparsekv-docs-")))
    python = config["plugins"]["mkdocstrings"].config["handlers"].setdefault("python", {})
    python["paths"] = [str(_TREE)]
    return config


def on_shutdown():
    if _TREE is not None:
        shutil.rmtree(_TREE, ignore_errors=True)

"""The documentation site builds strictly (``mkdocs build --strict``, as ``make docs`` runs it): a
broken link or anchor, a page left out of the navigation, or a docstring the API reference cannot
read is an error. The blocks of its pages run in ``tests/test_readme.py``."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from sparsekv.testing.components import needs

REPO = Path(__file__).resolve().parent.parent
try:
    import mkdocs  # noqa: F401
    import mkdocstrings_handlers.python  # noqa: F401

    DOCS_MISSING = None
except ImportError as error:
    DOCS_MISSING = f"the `docs` extra is not installed ({error})"


@needs("MkDocs", DOCS_MISSING)
def test_the_docs_build_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # The reference is generated from the sources: a class of each layer is there with its docstring.
    for name in ("sparsekv.srt.mem_cache.deepseekv4_memory_pool.DeepSeekV4TokenToKVPool",
                 "sparsekv.srt.managers.hisparse_coordinator.HiSparseCoordinator",
                 "sparsekv.jit_kernel.dsv4.sparse_decode_attention"):
        assert f'id="{name}"' in api, name


def test_the_hook_maps_every_folder_the_package_maps(tmp_path):
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    docs_hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_hooks)
    tree = docs_hooks.package_tree(tmp_path) / "sparsekv"
    for name, folder in docs_hooks.folder_of_import_name().items():
        assert (tree / name.split(".", 1)[1]).resolve() == (REPO / folder).resolve()
    assert (tree / "kv_layout.py").resolve() == (REPO / "sparsekv" / "kv_layout.py").resolve()
    assert not (tree / "__pycache__").exists()


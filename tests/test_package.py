"""Package contract: each public subpackage re-exports its public names (``__all__``, resolved
lazily), the package is typed, the extras are documented, and importing does no work (no torch for
the planner, no directories, no compile)."""

from __future__ import annotations

import doctest
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sparsekv
import sparsekv.jit_kernel
import sparsekv.srt
import sparsekv.srt.managers
import sparsekv.srt.mem_cache
import sparsekv.srt.model_executor

REPO = Path(__file__).resolve().parent.parent
PUBLIC = [sparsekv.jit_kernel, sparsekv.srt.mem_cache, sparsekv.srt.model_executor, sparsekv.srt.managers]


@pytest.mark.parametrize("package", PUBLIC, ids=lambda p: p.__name__)
def test_every_lazy_name_resolves(package):
    assert package.__all__ == sorted(package.__all__) and package.__all__
    for name in package.__all__:
        assert getattr(package, name).__name__ == name
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_the_readme_imports_work():
    from sparsekv.srt.managers import HiSparseCoordinator
    from sparsekv.srt.model_executor import DSV4PoolConfigurator, MemoryPoolConfigurator

    assert issubclass(DSV4PoolConfigurator, MemoryPoolConfigurator) and HiSparseCoordinator.__module__.endswith(
        "hisparse_coordinator")
    assert set(sparsekv.srt.__all__) == {"RequestStateError", "layers", "managers", "mem_cache", "model_executor",
                                         "streams"}
    assert sparsekv.srt.RequestStateError.__module__ == "sparsekv.srt.errors"


def test_the_model_executor_example_runs():
    assert doctest.testmod(sparsekv.srt.model_executor).attempted > 0
    assert doctest.testmod(sparsekv.srt.model_executor).failed == 0


def test_the_package_is_typed():
    assert (Path(sparsekv.__file__).parent / "py.typed").is_file()


def test_every_extra_is_documented():
    extras = importlib.metadata.metadata("sparsekv").get_all("Provides-Extra")
    assert extras
    readme = (REPO / "README.md").read_text()
    assert [name for name in extras if f"| `{name}` |" not in readme] == []


def test_importing_creates_nothing_and_the_planner_stays_torch_free(tmp_path):
    cache_dir = tmp_path / "cache"
    probe = (
        "import sys\n"
        "import sparsekv, sparsekv.jit_kernel, sparsekv.srt.mem_cache, sparsekv.srt.model_executor as m\n"
        "[getattr(m, name) for name in m.__all__]\n"
        "light = 'torch' not in sys.modules\n"
        "import sparsekv.jit_kernel.gather_rows, sparsekv.jit_kernel.hisparse\n"
        "import sparsekv.srt.managers.hisparse_coordinator\n"
        "print(light)\n"
    )
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir), HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "True"
    assert not cache_dir.exists() and not (tmp_path / "home").exists()


def test_help_of_the_dsv4_reexport_shows_the_maths():
    """A reader of help(sparsekv.jit_kernel.dsv4) sees the formulas, not only the names."""
    import pydoc

    import sparsekv.jit_kernel.dsv4 as dsv4

    text = " ".join(pydoc.render_doc(dsv4, renderer=pydoc.plaintext).split())
    for formula in ("(sum_j exp(l_j) + exp(sink[h]))",  # the sink joins the denominator only
                    "key = value",
                    "slots 4-7 are tokens ``4i .. 4i+3`` on the *last* ``d``",  # which half each token feeds
                    "relu(q[b, h] . k_i)", "i < (t + 1) // 4"):
        assert formula in text, formula

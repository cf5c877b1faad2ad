"""The README is a contract: every ```bash and ```python block runs, and everything it names exists.

A block preceded by ``<!-- readme-test: skip (reason) -->`` is skipped with that reason (one that
needs a GPU, or one that runs this very test suite); ``<!-- readme-test: slow (reason) -->`` runs
only with ``--slow``; ``<!-- readme-test: gpu (reason) -->`` runs only where CUDA is available.
Shell blocks run with ``bash -euo pipefail`` in the repository with the test's Python environment
first on ``PATH`` (a block that runs ``jit clean`` gets a private JIT cache, so it cannot touch the
cache other tests use); Python blocks run in a fresh interpreter in an empty directory.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
MARKER = re.compile(r"<!-- readme-test: (skip|slow|gpu) \((.+)\) -->")


@dataclass
class Block:
    language: str
    code: str
    line: int
    marker: tuple[str, str] | None


def readme_blocks() -> list[Block]:
    blocks, lines = [], README.splitlines()
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w+)", lines[i].strip())
        if fence:
            end = lines.index("```", i + 1)
            previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
            marker = MARKER.fullmatch(previous.strip())
            blocks.append(Block(fence.group(1), "\n".join(lines[i + 1 : end]), i + 1,
                                marker.groups() if marker else None))
            i = end
        i += 1
    return blocks


BLOCKS = readme_blocks()
RUNNABLE = [b for b in BLOCKS if b.language in ("bash", "python")]


def test_the_readme_has_install_python_and_cli_blocks():
    assert {b.language for b in BLOCKS} >= {"bash", "python"}
    assert all(b.language in ("bash", "python", "json") for b in BLOCKS), "a block of a language no test runs"
    # The README opens with the two fresh-machine commands (the demo, the tests), then install + activate.
    opening, install = RUNNABLE[0].code, RUNNABLE[1].code
    assert opening.splitlines()[0].startswith("make demo") and opening.splitlines()[1].startswith("make test")
    assert "make install" in install and "source .venv/bin/activate" in install


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: f"line{b.line}-{b.language}")
def test_readme_block_runs(block, tmp_path, request):
    if block.marker is not None:
        kind, reason = block.marker
        if kind == "skip":
            pytest.skip(reason)
        if kind == "slow" and not request.config.getoption("--slow"):
            pytest.skip(f"slow: {reason}")
        if kind == "gpu":
            import torch

            if not torch.cuda.is_available():
                pytest.skip(f"needs a GPU: {reason}")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if block.language == "bash":
        if "jit clean" in block.code:  # never clean the cache other tests are using
            env["SPARSEKV_CACHE_DIR"] = str(tmp_path / "cache")
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", block.code], REPO
    else:
        cmd, cwd = [sys.executable, "-c", block.code], tmp_path
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"README line {block.line}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stdout + done.stderr


def test_everything_the_readme_points_to_exists():
    assert "../" not in README and "shared/" not in README
    for target in re.findall(r"\]\(([^)]+)\)", README):
        assert target.startswith("http") or (REPO / target).exists(), target
    for token in re.findall(r"`([^`\s]+)`", README):
        if re.fullmatch(r"(csrc|docs|jit_kernel|srt|sparsekv|tests|tools)/[\w./-]*", token) and "<" not in token:
            assert (REPO / token).exists(), token


def test_the_add_a_kernel_family_steps_name_files_the_example_family_has():
    """The numbered steps are a recipe a reader follows: every path they name with ``<stem>`` exists for
    ``gather_rows``, the family the README names as the smallest complete example, and the others exist."""
    section = README.split("To add a kernel family `<stem>`", 1)[1].split("\n\n", 2)[1]
    steps = re.findall(r"^\d+\. ", section, flags=re.MULTILINE)
    assert len(steps) >= 5 and steps[0] == "1. ", section
    path = re.compile(r"(csrc|jit_kernel|srt|sparsekv|tests|tools)/[\w./<>*-]*")
    paths = [t for t in re.findall(r"`([^`\s]+)`", section) if path.fullmatch(t)]
    assert any("<stem>" in p for p in paths), paths
    for path in paths:
        concrete = path.replace("<stem>", "gather_rows")
        assert list(REPO.glob(concrete)) if "*" in concrete else (REPO / concrete).exists(), path


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_what_is_inside_table_names_importable_things():
    # Each row: the first `sparsekv.*` name is the package; every bare name in the row is one of its
    # attributes (`from sparsekv.srt.model_executor import MemoryPoolConfigurator` must work).
    section = README.split("## What is inside", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "sparsekv." in line]
    assert len(rows) >= 8
    for row in rows:
        tokens = re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", row))  # asides in parentheses are prose
        dotted = [t for t in tokens if re.fullmatch(r"sparsekv(\.\w+)+", t)]
        where = _resolve(dotted[0])
        package = where if isinstance(where, type(sys)) else _resolve(dotted[0].rsplit(".", 1)[0])
        for name in (t for t in tokens if re.fullmatch(r"[A-Za-z_]\w*", t) and not t.startswith("SPARSEKV")):
            assert hasattr(package, name), (row.split("|")[1].strip(), package.__name__, name)
        for name in dotted:
            _resolve(name)


def test_the_readme_says_which_layouts_the_copy_supports():
    from sparsekv.jit_kernel.hisparse_copy import HISPARSE_COPY
    from sparsekv.kv_layout import V4

    row = next(line for line in README.splitlines() if line.startswith("| paged token / page copy"))
    v4_only = {HISPARSE_COPY.template_args(i)[0] for i in HISPARSE_COPY.instances} == {V4.cpp_type}
    assert ("V4 (584 B) layout only" in row) == v4_only

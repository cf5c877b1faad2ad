"""The README, CONTRIBUTING.md and docs/ are a contract: every ```bash and ```python block runs, and
everything they name exists.

A block that must not run in the default profile is named, with the reason, in CONTRIBUTING.md's
table of blocks that do not run (by its file and the start of its first line): ``never`` is not a
test item (the table names why), ``slow`` runs only with ``--slow`` (deselected without it), ``gpu``
only where CUDA is available (a GPU skip elsewhere, the one kind of skip CI allows).
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

from sparsekv.testing.components import skip_for_gpu

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
DOC_FILES = ["README.md", "CONTRIBUTING.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
TEXT = {name: (REPO / name).read_text() for name in DOC_FILES}
INDEX = TEXT["docs/index.md"]
KERNEL_DEVELOPMENT = TEXT["docs/kernel-development.md"]


@dataclass
class Block:
    file: str
    language: str
    code: str
    line: int


def blocks_of(file: str) -> list[Block]:
    blocks, lines = [], TEXT[file].splitlines()
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w+)", lines[i].strip())
        if fence:
            end = lines.index("```", i + 1)
            blocks.append(Block(file, fence.group(1), "\n".join(lines[i + 1 : end]), i + 1))
            i = end
        i += 1
    return blocks


def not_run_table() -> list[tuple[str, str, str, str]]:
    """CONTRIBUTING.md's rows (file, start of the first line, runs, why) of blocks that do not run."""
    section = TEXT["CONTRIBUTING.md"].split("| file | block starts with | runs | why |", 1)[1]
    rows = []
    for line in section.splitlines()[2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append((cells[0].strip("`"), cells[1][1:-1], cells[2], cells[3].replace("\\|", "|")))
    return rows


BLOCKS = [block for file in DOC_FILES for block in blocks_of(file)]
RUNNABLE = [b for b in BLOCKS if b.language in ("bash", "python")]
NOT_RUN = not_run_table()


def marker(block: Block) -> tuple[str, str] | None:
    first = block.code.splitlines()[0] if block.code else ""
    rows = [(runs, why) for file, start, runs, why in NOT_RUN if file == block.file and first.startswith(start)]
    return rows[0] if rows else None


def test_the_readme_has_install_python_and_cli_blocks():
    readme = [b for b in RUNNABLE if b.file == "README.md"]
    assert {b.language for b in readme} >= {"bash", "python"}
    assert all(b.language in ("bash", "python", "json") for b in BLOCKS), "a block of a language no test runs"
    # The README opens with the two fresh-machine commands (the demo, the tests), then install + activate.
    opening, install = readme[0].code, readme[1].code
    assert opening.splitlines()[0].startswith("make demo") and opening.splitlines()[1].startswith("make test")
    assert "make install" in install and "source .venv/bin/activate" in install


def test_the_readme_is_a_front_page():
    """What a user needs first, under 250 lines, and a way to every page of the site."""
    assert len(README.splitlines()) < 250
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", README))
    assert pages - linked == set(), "pages the README does not lead to"


def test_every_row_of_the_not_run_table_names_one_block():
    assert len(NOT_RUN) >= 5
    for file, start, runs, why in NOT_RUN:
        assert runs in ("never", "slow", "gpu") and why, (file, start)
        matches = [b for b in RUNNABLE if b.file == file and b.code.splitlines()[0].startswith(start)]
        assert len(matches) == 1, (file, start, len(matches))


def _block_param(block: Block):
    slow = (marker(block) or ("",))[0] == "slow"
    return pytest.param(block, marks=[pytest.mark.slow] if slow else [],
                        id=f"{block.file}:line{block.line}-{block.language}")


@pytest.mark.parametrize("block", [_block_param(b) for b in RUNNABLE if (marker(b) or ("",))[0] != "never"])
def test_doc_block_runs(block, tmp_path, request):
    found = marker(block)
    if found is not None and found[0] == "gpu":
        import torch

        if not torch.cuda.is_available():
            skip_for_gpu(found[1])
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if block.language == "bash":
        if "jit clean" in block.code:  # never clean the cache other tests are using
            env["SPARSEKV_CACHE_DIR"] = str(tmp_path / "cache")
        if block.code.startswith("make demo") and not request.config.getoption("--slow"):
            # The README's command at the demo's smallest size (the same kernels and checks; about 3 CPU
            # seconds against 37 at the default size, which --slow runs).
            env["DEMO_ARGS"] = "--tokens 16 --steps 1"
        cmd, cwd = ["bash", "-euo", "pipefail", "-c", block.code], REPO
    else:
        cmd, cwd = [sys.executable, "-c", block.code], tmp_path
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block.file} line {block.line}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("file", DOC_FILES)
def test_everything_the_docs_point_to_exists(file):
    text = TEXT[file]
    assert "../" not in text and "shared/" not in text
    for target in re.findall(r"\]\(([^)]+)\)", text):
        path = target.split("#", 1)[0]
        assert target.startswith("http") or (REPO / file).parent.joinpath(path).exists(), target
    for token in re.findall(r"`([^`\s]+)`", text):
        if re.fullmatch(r"(csrc|docs|jit_kernel|srt|sparsekv|tests|tools)/[\w./-]*", token) and "<" not in token:
            assert (REPO / token).exists(), token


def test_the_add_a_kernel_family_steps_name_files_the_example_family_has():
    """The numbered steps are a recipe a reader follows: every path they name with ``<stem>`` exists for
    ``gather_rows``, the family the page names as the smallest complete example, and the others exist."""
    section = KERNEL_DEVELOPMENT.split("To add a kernel family `<stem>`", 1)[1].split("\n\n", 2)[1]
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
    section = INDEX.split("## What is inside", 1)[1].split("\n## ", 1)[0]
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


def test_the_overview_says_which_layouts_the_copy_supports():
    from sparsekv.jit_kernel.hisparse_copy import HISPARSE_COPY
    from sparsekv.kv_layout import V4

    row = next(line for line in INDEX.splitlines() if line.startswith("| paged token / page copy"))
    v4_only = {HISPARSE_COPY.template_args(i)[0] for i in HISPARSE_COPY.instances} == {V4.cpp_type}
    assert ("V4 (584 B) layout only" in row) == v4_only


def test_the_readme_engine_example_is_the_attention_backend_and_runs():
    """The README's one engine example is the backend's prefill and decode (run by test_doc_block_runs)."""
    python = [b for b in RUNNABLE if b.file == "README.md" and b.language == "python"]
    assert len(python) == 1 and marker(python[0]) is None
    code = python[0].code
    assert "Dsv4AttentionBackend(" in code and "forward_extend(" in code and "forward_decode(" in code
    assert len(code.splitlines()) <= 40

"""Map the repository's top-level folders to import names under ``sparsekv``.

``jit_kernel/`` -> ``sparsekv.jit_kernel``, ``srt/`` -> ``sparsekv.srt``, ``csrc/`` ->
``sparsekv.csrc`` (headers only, shipped as package data). The same mapping serves an editable
install and a wheel; everything else is in pyproject.toml.
"""

import warnings

from setuptools import find_packages, setup
from setuptools.warnings import InformationOnly

# An editable install of mapped folders uses a meta-path finder, and setuptools then notes that a
# folder named like the package in the working directory may shadow it. Here `sparsekv/` is the
# package itself, so the note (printed on every `pip install -e .`) says nothing; silence only it.
warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)

FOLDER_OF = {"sparsekv.jit_kernel": "jit_kernel", "sparsekv.srt": "srt", "sparsekv.csrc": "csrc"}


def packages_under(prefix: str, folder: str) -> list[str]:
    return [prefix] + [f"{prefix}.{sub}" for sub in find_packages(folder)]


packages = find_packages(include=["sparsekv", "sparsekv.*"])
for prefix, folder in FOLDER_OF.items():
    packages += packages_under(prefix, folder)
# Header folders hold no Python; they are listed as (namespace) packages so setuptools ships them
# as data without warning that an importable folder is missing from `packages`.
packages += ["sparsekv.csrc.include", "sparsekv.csrc.include.sparsekv", "sparsekv.csrc.sim"]
# The benchmark scripts ship as data, so `sparsekv bench` runs them from a wheel too (they stay
# scripts in tools/bench; the command runs them as files, never imports them).
packages += ["sparsekv.benchmarks"]

setup(
    packages=packages,
    package_dir={"sparsekv": "sparsekv", "sparsekv.benchmarks": "tools/bench", **FOLDER_OF},
    package_data={
        "sparsekv": ["py.typed"],
        "sparsekv.csrc": ["*.cuh", "*.h"],
        "sparsekv.csrc.include.sparsekv": ["*.h", "*.cuh"],
        "sparsekv.csrc.sim": ["*.h"],
        "sparsekv.srt.model_executor.cases": ["*.json"],
        "sparsekv.benchmarks": ["bench_*.py"],
    },
)

"""``python -m sparsekv``: the ``sparsekv`` command. Importing the module runs nothing (the API
reference's generator imports every module of the package)."""

from sparsekv.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

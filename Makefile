# `make demo` and `make test` work on a fresh clone: each creates .venv with pinned versions first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sparsekv-installed
PD_STAMP := $(VENV)/.sparsekv-pd-installed
# nvcc on PATH here is a wrapper; the toolkit root it calls is what the cuda backend needs.
CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,)
export CUDA_HOME
PYTEST_ARGS ?=

.PHONY: install install-pd demo docs lint test test-demos test-gpu test-slow test-sanitize test-sanitize-sim test-sim test-sim-and-demos clean-venv

$(STAMP): pyproject.toml setup.py constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and alone, so the pinned CPU wheel is taken and nothing pulls a CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt setuptools wheel
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e '.[test,bench,docs]'
	touch $(STAMP)

# The optional PD transfer engines, each an extra of its own (the demo and the kernels need neither).
$(PD_STAMP): $(STAMP) tools/fetch_mooncake_libs.sh
	# The `pd` extra (NIXL), after torch and without its declared dependencies: see pyproject.toml.
	$(PY) -m pip install -q -c constraints.txt --no-deps nixl-cu12 nixl
	# The `mooncake` extra (the optional second engine), and the system libraries it links where the
	# system lacks them, extracted into $(VENV)/sysroot. Best effort: without them only the Mooncake
	# tests skip, with the reason.
	$(PY) -m pip install -q -c constraints.txt mooncake-transfer-engine-non-cuda
	PYTHON=$(PY) tools/fetch_mooncake_libs.sh $(VENV)/sysroot || { echo "warning: Mooncake's system libraries are missing; its tests will skip (and fail under SPARSEKV_REQUIRE_ALL=1)"; test "$$SPARSEKV_REQUIRE_ALL" != 1; }
	touch $(PD_STAMP)

# The venv the README's first command creates (what the demo and the tests need);
# `source .venv/bin/activate` enters it.
install: $(STAMP)

# NIXL (`pd` extra) and Mooncake (`mooncake` extra, with its system libraries): `sparsekv demo --pd`,
# `sparsekv pd-demo` and the PD tests. `make test` installs them; `make demo` does not.
install-pd: $(PD_STAMP)

# DEMO_ARGS: flags for `sparsekv demo` (tests/test_readme.py runs the README's `make demo` at the
# smallest size, --tokens 16 --steps 1; the default size under --slow).
demo: $(STAMP)
	$(PY) -m sparsekv demo $(DEMO_ARGS)

# The documentation site into site/, strictly (a warning is an error); tests/test_docs.py runs the same build.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: lint $(PD_STAMP)
	$(PY) -m pytest -n 2 -q $(PYTEST_ARGS)

test-slow: $(PD_STAMP)
	$(PY) -m pytest -n 2 -q --slow $(PYTEST_ARGS)

# The demo at its smallest size with the kernels' CUDA path on the simulator, and with the Triton twins
# under the interpreter: two slow tests of tests/test_demo.py (make test leaves them out), named by node
# id, which runs them without --slow (tests/conftest.py).
DEMO_TESTS := tests/test_demo.py::test_a_tiny_demo_on_sim_checks_hold \
	tests/test_demo.py::test_tiny_demo_with_the_triton_indexer_and_attention
test-demos: $(STAMP)
	$(PY) -m pytest -n 2 -q $(PYTEST_ARGS) $(DEMO_TESTS)

# Runs the kernel tests on the cuda backend too, and fails if no GPU is visible.
test-gpu: $(STAMP)
	SPARSEKV_TEST_BACKENDS=cpu,cuda $(PY) -m pytest -q $(PYTEST_ARGS)

# One-call GPU verification on a bare GPU image (no venv: the image's python3 and torch; apache-tvm-ffi
# from the carried wheel folder): tools/gpu_check.py. DRY_RUN=1 lists the steps and checks the
# plumbing without a GPU (CI runs it).
GPU_CHECK_OUT ?= gpu-check
GPU_CHECK_PYTHON ?= python3
GPU_CHECK_BUDGET_S ?= 420
gpu-check:
	$(GPU_CHECK_PYTHON) tools/gpu_check.py --out $(GPU_CHECK_OUT) --budget-s $(GPU_CHECK_BUDGET_S) $(if $(DRY_RUN),--dry-run,)

# Every kernel property test (and the planted-bug test) against cpu modules built with ASan and
# UBSan: "memcheck without a GPU". Python is not instrumented, so the compiler's ASan runtime is
# preloaded, with libstdc++ (whose __cxa_throw ASan intercepts: kernels raise C++ exceptions for bad
# input). Leak checking is off: the interpreter's own allocations are not leaks. Sanitized modules
# have their own cache keys, so the cache stays warm across runs. Hypothesis draws a fifth of make
# test's examples here (the `sanitize` profile: docs/testing.md), every test still runs; --slow draws
# the deep profile. The cpu backend only: the core tests' sim
# copies (make test runs them) are not built with sanitizers. The Triton twins' tests are left out: the
# interpreter runs them in numpy, which the sanitizers do not see, and the header calls they compare
# against are the header tests' own (make test runs the twins).
SANITIZE_CXX ?= $(or $(SPARSEKV_CXX),$(CXX),c++)
test-sanitize: $(STAMP)
	LD_PRELOAD="$$($(SANITIZE_CXX) -print-file-name=libasan.so) $$($(SANITIZE_CXX) -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 SPARSEKV_SANITIZE=address,undefined \
	SPARSEKV_TEST_BACKENDS=cpu $(PY) -m pytest -n 2 -q $(PYTEST_ARGS) --ignore-glob='tests/kernels/*_triton.py' \
		tests/kernels tests/jit/test_jit_sanitize.py

# The CUDA code paths most at risk under ASan + UBSan: the compressors alone and fused with the store
# (every test of both), and the HiSparse swap-in (its small instances: the LRU walk, the generic and
# DSV4 layouts, the paged miss copies, both protected kernels, the speculative rows), on sim modules
# built with the sanitizers (the sim build runs each header's CUDA path: 16-byte loads, shared-memory
# stages, warp votes; test-sanitize's cpu build runs none of them). The cpu modules each sim call is
# checked against are test-sanitize's (the same keys: CI runs this after it). With log_path set, ASan
# and UBSan write their reports only to those files, never to stderr, and a report in a child process
# fails no test by itself: the stage fails when any file was written, and prints them. Hypothesis
# draws the `sanitize` profile, as in test-sanitize. The cost in CI: docs/testing.md.
SANITIZE_SIM_LOGS ?= $(CURDIR)/.cache/sanitize-sim
HISPARSE_TESTS := tests/kernels/test_hisparse.py
SANITIZE_SIM_TESTS ?= tests/kernels/test_dsv4_compress.py tests/kernels/test_dsv4_compress_store.py \
	$(HISPARSE_TESTS)::test_hits_newest_and_lru_then_misses_take_lru_slots \
	$(HISPARSE_TESTS)::test_kernel_matches_reference_on_a_mixed_batch \
	$(HISPARSE_TESTS)::test_dsv4_miss_reads_and_writes_paged_addresses \
	$(HISPARSE_TESTS)::test_a_protected_policy_follows_its_model_bit_for_bit \
	$(HISPARSE_TESTS)::test_speculative_rows_equal_running_them_one_after_another
test-sanitize-sim: $(STAMP)
	rm -rf $(SANITIZE_SIM_LOGS) && mkdir -p $(SANITIZE_SIM_LOGS)
	LD_PRELOAD="$$($(SANITIZE_CXX) -print-file-name=libasan.so) $$($(SANITIZE_CXX) -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0:log_path=$(SANITIZE_SIM_LOGS)/asan \
	UBSAN_OPTIONS=print_stacktrace=1:log_path=$(SANITIZE_SIM_LOGS)/ubsan SPARSEKV_SANITIZE=address,undefined \
	SPARSEKV_TEST_BACKENDS=sim $(PY) -m pytest -n 2 -q $(PYTEST_ARGS) $(SANITIZE_SIM_TESTS); status=$$?; \
	if [ -n "$$(ls -A $(SANITIZE_SIM_LOGS))" ]; then head -n 200 $(SANITIZE_SIM_LOGS)/*; \
		echo "test-sanitize-sim: sanitizer reports in $(SANITIZE_SIM_LOGS) (above)"; exit 1; fi; exit $$status

# Every kernel test on the sim backend (each header's CUDA path run on the CPU with GPU semantics:
# barriers, warp shuffles and ballots, shared memory, launch limits). The simulator's own planted-bug
# tests (tests/jit/test_jit_sim.py) and each family's core property test on sim run in `make test`.
# Sim modules have their own cache keys.
test-sim: $(STAMP)
	SPARSEKV_TEST_BACKENDS=sim $(PY) -m pytest -n 2 -q $(PYTEST_ARGS) tests/kernels

# CI's sim stage: test-sim and test-demos in one session. The demos are collected first, so each worker
# starts with one (the Triton demo is the longest test CI runs); in a stage of their own they kept one
# worker idle for most of it (docs/testing.md).
test-sim-and-demos: $(STAMP)
	SPARSEKV_TEST_BACKENDS=sim $(PY) -m pytest -n 2 -q $(PYTEST_ARGS) $(DEMO_TESTS) tests/kernels

clean-venv:
	rm -rf $(VENV)

"""``load_jit``: compile a kernel header into a tvm-ffi module at first use, then reuse it.

The cache key covers everything that can change the binary: module name, template arguments, the
bytes and csrc-relative paths of the header's transitive ``#include "..."`` closure, the generated
glue, flags, backend, CUDA arch list, compiler identities and the tvm-ffi version. It holds no
absolute path, so two checkouts share keys. The compilers read a snapshot of the hashed header
bytes, not ``csrc/`` (:func:`snapshot_closure`), so an entry holds the build of its key. Warm path:
key -> stat + hash-check -> load the ``.so``; no compiler, no ninja. See :mod:`sparsekv.jit_kernel.build.cache` for publishing and safety.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import tvm_ffi
import tvm_ffi.libinfo

from sparsekv import env, log
from sparsekv.jit_kernel.build import arch as arch_mod
from sparsekv.jit_kernel.build import cache, toolchain

logger = logging.getLogger("sparsekv.jit")
#: A compile running longer than this (seconds) is announced at WARNING while it runs.
#: ``(instance, seconds)`` of every compile this process ran, in order (reports: what was built, what came
#: from the cache).
COMPILED: list[tuple[str, float]] = []

#: cpu: the headers' host implementations; cuda: their CUDA path under nvcc; sim: the same CUDA path
#: under the host compiler, run on the CPU by the simulator in ``csrc/sim/sim.h``.
BACKENDS = ("cpu", "cuda", "sim")
#: The emulation header every sim module is built against (part of a sim module's include closure).
SIM_HEADER = "sim/sim.h"
# Bump when the glue or the build recipe changes in a way the other key inputs cannot see.
# 2: module.cpp exports the entry name it was built as (MODULE_KEY_EXPORT).
LOADER_FORMAT = 2
#: The export of every module that returns the cache entry name it was built as.
MODULE_KEY_EXPORT = "sparsekv_module_key"
CXX_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-DNDEBUG", "-Wall", "-Wno-unused-function")
NVCC_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC", "--expt-relaxed-constexpr")
#: A sim module's host side (module.cpp: the tvm-ffi entry, its checks and the launches) after CXX_FLAGS'
#: -O3; its simulated kernels (kernels_sim.cpp) keep -O3, and a sanitized module's -O0 comes after both.
#: The simulator is a test backend, some forty modules built cold a CI run: the host side is most of a
#: sim module's compile and none of its kernels' speed (docs/testing.md).
SIM_HOST_FLAGS = ("-O1",)


def cxx_flags(backend: str) -> tuple[str, ...]:
    """The host compiler's flags of a ``backend`` module (before sanitizer and extra flags); a sim module's
    host side takes :data:`SIM_HOST_FLAGS` after them."""
    return CXX_FLAGS + SIM_HOST_FLAGS if backend == "sim" else CXX_FLAGS

_INCLUDE = re.compile(r'#\s*include\s*([<"])([^>"]+)[>"]')


def _included_names(text: str) -> list[tuple[bool, str]]:
    """``(quoted, name)`` of every ``#include`` line."""
    # Line-wise prefilter: a MULTILINE regex over whole headers costs ~200 us each.
    names = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#") and "include" in stripped:
            match = _INCLUDE.match(stripped)
            if match:
                names.append((match.group(1) == '"', match.group(2)))
    return names


class JitCompileError(RuntimeError):
    """The compiler rejected a module.

    The message holds the compiler's first errors, the command to reproduce them and, for common
    causes, a hint. Attributes: ``what`` (module, arguments, backend), ``command``, ``cwd``,
    ``output`` (the compiler's whole output) and ``hint``.
    """

    def __init__(self, message: str, *, what: str = "", command: list[str] | None = None, cwd: str = "",
                 output: str = "", hint: str = "") -> None:
        super().__init__(message)
        self.what, self.command, self.cwd, self.output, self.hint = what, command or [], cwd, output, hint


class JitCompileTimeoutError(JitCompileError):
    """A module's build ran past ``SPARSEKV_JIT_COMPILE_TIMEOUT``; its compilers were killed. Not
    remembered: the next load of the module builds it again."""


class JitCacheMissError(RuntimeError):
    """``SPARSEKV_JIT_STRICT=1`` (or a CUDA-graph capture) and the module is not in the cache."""


class JitSanitizerError(RuntimeError):
    """``SPARSEKV_SANITIZE=address`` in a process that did not preload the compiler's ASan runtime."""


#: Lines of compiler output an error message keeps (the first errors; the rest is on the exception).
ERROR_LINES = 25
_DIAGNOSTIC = re.compile(r"(error|fatal)", re.IGNORECASE)
# (pattern in the compiler output, hint): the causes an operator meets most.
_HINTS = (
    (re.compile(r"unsupported gpu architecture|invalid value for --gpu-architecture|Unknown option '-arch'", re.I),
     "the CUDA arch is not supported by this nvcc; check SPARSEKV_CUDA_ARCH / --arch against `nvcc --list-gpu-arch`"),
    (re.compile(r"cuda_runtime\.h|cudart|libcudart", re.I),
     "the CUDA toolkit's headers or runtime library were not found; point CUDA_HOME at the toolkit root "
     "(the directory with bin/nvcc, include/ and lib64/libcudart.so)"),
    (re.compile(r"fatal error: .*: No such file or directory|cannot open source file", re.I),
     "a header was not found: check that csrc/ is complete (installed package or checkout) and, for system "
     "headers, that the compiler's development packages are installed"),
    (re.compile(r"sanitizer|libasan|libubsan|-lasan|-lubsan", re.I),
     "the sanitizer runtime is missing: install the compiler's libasan/libubsan, or unset SPARSEKV_SANITIZE"),
    (re.compile(r"unrecognized command[- ]line option|unknown argument", re.I),
     "a flag is not accepted by this compiler: check SPARSEKV_EXTRA_CFLAGS and SPARSEKV_CXX"),
)


def trim_compiler_output(output: str, limit: int = ERROR_LINES) -> str:
    """The compiler output from the first error on, at most ``limit`` lines (the first errors are the
    actionable ones; later ones usually follow from them)."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if _DIAGNOSTIC.search(line)), 0)
    # Keep the "In file included from" / "In instantiation of" context just above the first error.
    while first > 0 and lines[first - 1].startswith(("In file included", "                 from", "In instantiation")):
        first -= 1
    kept = lines[first:first + limit]
    more = len(lines) - first - len(kept)
    return "\n".join(kept + ([f"... ({more} more lines; the whole output is on the exception's `output`)"]
                             if more > 0 else []))


def compile_hint(output: str) -> str:
    """A hint for a common cause of ``output``, or ``""``."""
    for pattern, hint in _HINTS:
        if pattern.search(output):
            return hint
    return ""


@functools.cache
def csrc_root() -> Path:
    """The ``csrc`` directory: next to the ``jit_kernel`` package in a wheel, at the repo top level in a checkout."""
    return Path(os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "csrc")))


def include_closure(header: str, root: Path) -> dict[str, bytes]:
    """Bytes of ``header`` and every project header it includes, transitively, keyed by csrc-relative path.

    A quoted include is looked up next to the including file, then in ``csrc/`` and
    ``csrc/include/``; an angle-bracket include in ``csrc/include/`` only. Includes found in none of
    them (system and tvm-ffi headers) are covered by the compiler identity and tvm-ffi version in
    the key instead. Plain string paths keep this cheap: it runs on
    every first load in a process.
    """
    root_dir = os.path.realpath(root)
    if not os.path.isfile(os.path.join(root_dir, header)):
        raise FileNotFoundError(f"sparsekv: kernel header {header!r} not found under {root_dir}")
    found: dict[str, bytes] = {}
    pending = [os.path.normpath(header)]
    while pending:
        rel = pending.pop()
        if rel in found:
            continue
        with open(os.path.join(root_dir, rel), "rb") as f:
            data = f.read()
        found[rel] = data
        for quoted, name in _included_names(data.decode("utf-8", "replace")):
            for base in (os.path.dirname(rel), "", "include") if quoted else ("include",):
                candidate = os.path.normpath(os.path.join(base, name))
                if not candidate.startswith("..") and os.path.isfile(os.path.join(root_dir, candidate)):
                    pending.append(candidate)
                    break
    return dict(sorted(found.items()))


def cpp_template_arg(value: object) -> str:
    """Render one template argument: bool -> true/false, int -> literal, str -> verbatim C++."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"sparsekv: template argument {value!r} must be bool, int or a C++ type/expression string")


def _instance(template: str, args: tuple[str, ...]) -> str:
    return f"{template}<{', '.join(args)}>" if args else template


def generate_sources(
    header: str, exports: Mapping[str, str], kernels: Sequence[str], args: tuple[str, ...], backend: str
) -> dict[str, str]:
    """The translation units the loader compiles: ``module.cpp`` (tvm-ffi exports) and, for the cuda
    backend, ``kernels.cu`` (kernels and their launchers, free of tvm-ffi headers for fast nvcc) or,
    for the sim backend, ``kernels_sim.cpp`` (the same CUDA path under the host compiler)."""
    is_cuda = int(backend == "cuda")
    instances = [_instance(kernel, args) for kernel in kernels]
    lines = [
        "// Generated by sparsekv.jit_kernel; the kernel lives in the header below.",
        f"#define SPARSEKV_BACKEND_CUDA {is_cuda}",
        f"#define SPARSEKV_BACKEND_SIM {int(backend == 'sim')}",
        "#define SPARSEKV_HOST_ENTRY 1",
        f'#include "{header}"',
        "",
    ]
    if backend == "sim":
        # The host entries call run_on_cuda<K>; each forwards to the sim build of K through a C symbol.
        for i, k in enumerate(instances):
            lines += [
                f'extern "C" int sparsekv_sim_launch_{i}(const void* params, size_t params_size, void* stream);',
                f"template <> int sparsekv::run_on_cuda<{k}>(const {k}::Params& params, void* stream) {{",
                f"  return sparsekv_sim_launch_{i}(&params, sizeof(params), stream);",
                "}",
            ]
        lines.append("")
    lines += [f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({name}, ({_instance(fn, args)}));" for name, fn in exports.items()]
    lines += [
        "",
        "// The cache entry this module was built as (its compile defines SPARSEKV_MODULE_KEY): the loader",
        "// reads it after loading, so a module swapped into another entry's place is refused.",
        "static tvm::ffi::String sparsekv_module_key_value() { return SPARSEKV_MODULE_KEY; }",
        f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({MODULE_KEY_EXPORT}, sparsekv_module_key_value);",
    ]
    sources = {"module.cpp": "\n".join(lines) + "\n"}
    if is_cuda:
        cu = [
            "// Generated by sparsekv.jit_kernel: CUDA launchers for the kernels of the header below.",
            f'#include "{header}"',
            "",
        ]
        for k in instances:
            cu.append(f"template int sparsekv::run_on_cuda<{k}>(const {k}::Params&, void*);")
        cu += [
            'extern "C" const char* sparsekv_cuda_error_string(int e) {',
            "  return cudaGetErrorString(static_cast<cudaError_t>(e));",
            "}",
            'extern "C" int sparsekv_cuda_device_count(int* count) {',
            "  return static_cast<int>(cudaGetDeviceCount(count));",
            "}",
            'extern "C" int sparsekv_cuda_set_device(int device, int* previous) {',
            "  cudaError_t err = cudaGetDevice(previous);",
            "  if (err == cudaSuccess && *previous != device) err = cudaSetDevice(device);",
            "  return static_cast<int>(err);",
            "}",
            'extern "C" int sparsekv_cuda_is_pinned(const void* ptr, int* pinned) {',
            "  cudaPointerAttributes attr{};",
            "  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);",
            "  if (err != cudaSuccess) return static_cast<int>(err);",
            "  *pinned = attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeManaged;",
            "  return 0;",
            "}",
        ]
        sources["kernels.cu"] = "\n".join(cu) + "\n"
    elif backend == "sim":
        sim = [
            "// Generated by sparsekv.jit_kernel: the CUDA path of the header below, for the sim backend.",
            "// The header's namespace is renamed and its symbols stay inside this module: its CUDA-path",
            "// inline functions must not be merged with the host-path ones of module.cpp, nor its shared",
            "// memory with another module's. (sim.h has included every system header by then.)",
            f'#include "{SIM_HEADER}"',
            "#pragma GCC visibility push(hidden)",
            "#define sparsekv sparsekv_sim",
            f'#include "{header}"',
            "",
        ]
        for i, k in enumerate(instances):
            sim += [
                f'extern "C" int sparsekv_sim_launch_{i}(const void* params, size_t params_size, void* stream) {{',
                f"  using K = {k};",
                "  if (params_size != sizeof(K::Params)) {",
                f'    return cuda_sim::fail(cudaErrorInvalidValue, "sim: the host and sim builds disagree on '
                f'sizeof({k}::Params)");',
                "  }",
                "  return sparsekv::run_on_cuda<K>(*static_cast<const K::Params*>(params), stream);",
                "}",
            ]
        sim += [
            'extern "C" const char* sparsekv_cuda_error_string(int e) {',
            "  return cudaGetErrorString(static_cast<cudaError_t>(e));",
            "}",
            'extern "C" int sparsekv_cuda_device_count(int* count) {',
            "  *count = 1;",
            "  return 0;",
            "}",
        ]
        sources["kernels_sim.cpp"] = "\n".join(sim) + "\n"
    return sources


@dataclass(frozen=True)
class BuildPlan:
    """Everything needed to name, key and build one module instance."""

    name: str
    args: tuple[str, ...]
    backend: str
    archs: tuple[str, ...]
    sources: dict[str, str]
    closure: dict[str, bytes]
    cxx: toolchain.Compiler
    nvcc: toolchain.Compiler | None
    extra_cflags: tuple[str, ...]
    csrc: Path  # where the closure was read from; not part of the key (two checkouts share keys)
    sanitize: tuple[str, ...] = ()

    def key_doc(self) -> dict:
        return {
            "loader_format": LOADER_FORMAT,
            "name": self.name,
            "template_args": list(self.args),
            "backend": self.backend,
            "archs": list(self.archs),
            "sources": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in self.sources.items()},
            "include_closure": {k: hashlib.sha256(v).hexdigest() for k, v in self.closure.items()},
            "cxx": self.cxx.identity,
            "nvcc": self.nvcc.identity if self.nvcc else None,
            "cxx_flags": list(cxx_flags(self.backend)),
            "nvcc_flags": list(NVCC_FLAGS) if self.nvcc else [],
            "extra_cflags": list(self.extra_cflags),
            "sanitize": sanitizer_flags(self.sanitize),
            "tvm_ffi": tvm_ffi.__version__,
        }

    def describe(self) -> str:
        """``name<args> (backend[, archs])`` for messages."""
        where = self.backend + (f", arch {','.join(self.archs)}" if self.archs else "")
        return f"{self.name}<{', '.join(self.args)}> ({where})"

    def entry_name(self) -> str:
        return entry_name(self.key_doc())


def entry_name(key_doc: Mapping) -> str:
    """Cache entry directory of a key document: ``<name>__<readable args>__<backend>__<16 hex of its sha256>``
    (an ``artifact`` field, added at publish, is not part of the key)."""
    doc = {k: v for k, v in key_doc.items() if k != "artifact"}
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
    return entry_prefix(doc["name"], doc["template_args"], doc["backend"]) + digest


def entry_prefix(name: str, template_args: Sequence[str], backend: str) -> str:
    """The readable part of an entry name: ``<name>__<readable args>__<backend>__``."""
    readable = "_".join(re.sub(r"[^A-Za-z0-9]+", "", a) for a in template_args) or "noargs"
    return f"{name}__{readable}__{backend}__"


def _compiler_env() -> dict[str, str]:
    """The environment compilers run in: a sanitizer runtime preloaded into this process (see
    ``make test-sanitize``) is not preloaded into them, where it only costs time and memory."""
    environ = dict(os.environ)
    preload = [p for p in environ.get("LD_PRELOAD", "").split() if "san" not in os.path.basename(p)]
    if preload:
        environ["LD_PRELOAD"] = " ".join(preload)
    else:
        environ.pop("LD_PRELOAD", None)
    return environ


def _run(cmd: list[str], cwd: Path) -> subprocess.Popen:
    logger.debug("JIT: %s", shlex.join(cmd))
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_compiler_env())


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (a compiler driver's cc1plus, as, cicc, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), ()):
            found.append(child)
            pending.append(child)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a compiler and everything it started (a killed driver would leave its cc1plus running,
    and a child holding the output pipe would keep ``communicate`` waiting), then reap it."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.communicate()


def _wait_all(jobs: list[tuple[list[str], subprocess.Popen]], cwd: Path, what: str, deadline: float) -> None:
    """Wait for every job (none outlives a failure of another); past ``deadline`` (monotonic), or on
    an exception such as KeyboardInterrupt, kill them all."""
    failure = None
    try:
        for cmd, proc in jobs:
            try:
                out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timeout = env.jit_compile_timeout()
                raise JitCompileTimeoutError(
                    f"sparsekv: compiling {what} took longer than {timeout:g} s (SPARSEKV_JIT_COMPILE_TIMEOUT); "
                    f"the compiler (pid {proc.pid}) and what it started were killed. A loaded machine may need a "
                    f"larger SPARSEKV_JIT_COMPILE_TIMEOUT; a compiler that hangs can be reproduced with:\n"
                    f"  cd {shlex.quote(str(cwd))} && {shlex.join(cmd)}",
                    what=what, command=cmd, cwd=str(cwd),
                ) from None
            if proc.returncode != 0 and failure is None:
                failure = (cmd, proc.returncode, out)
    except BaseException:
        for _, proc in jobs:
            if proc.returncode is None:
                _kill_tree(proc)
        raise
    if failure is not None:
        cmd, code, out = failure
        hint = compile_hint(out)
        raise JitCompileError(
            f"sparsekv: compiling {what} failed (exit {code}).\n"
            f"Compiler output (first errors):\n{trim_compiler_output(out)}\n"
            + (f"Hint: {hint}\n" if hint else "")
            + f"Reproduce with:\n  cd {shlex.quote(str(cwd))} && {shlex.join(cmd)}",
            what=what, command=cmd, cwd=str(cwd), output=out, hint=hint,
        )


def sanitizer_flags(names: Sequence[str]) -> list[str]:
    """Compile and link flags of a sanitizer build (cpu backend): -O0 (exact reports; an ASan module
    compiles in about half the time of -O1, and the tests' kernel calls are small enough that the slower
    code does not show), with -g1: the line tables a report's ``file:line`` frames need, without the
    local-variable records of -g (a fifth to a third of the compile, which no report reads); every
    finding is fatal."""
    if not names:
        return []
    return [f"-fsanitize={','.join(names)}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-O0", "-g1"]


def _check_sanitizer_runtime(names: Sequence[str]) -> None:
    """An ASan module loaded into a process whose first library is not libasan aborts the process;
    refuse with the fix instead."""
    if "address" not in names:
        return
    with open("/proc/self/maps") as f:
        if "libasan" in f.read():
            return
    raise JitSanitizerError(
        "sparsekv: SPARSEKV_SANITIZE=address needs the compiler's ASan runtime loaded first; run with "
        "LD_PRELOAD=$(c++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 (as `make test-sanitize` does)"
    )


#: Set by the first compile of the process, which says (once, at WARNING) that compiling started.
_announced_compiling = False
PREBUILD_HINT = ("prebuild with `sparsekv jit build --model MODEL` (a model's serving path), `sparsekv jit build "
                 "--all`, or `sparsekv jit import BUNDLE`; SPARSEKV_JIT_STRICT=1 then forbids compiling")


def building_on_purpose() -> None:
    """The process compiles because it was asked to (``sparsekv jit build``): no first-compile
    warning, which is for a caller surprised by a compile."""
    global _announced_compiling
    _announced_compiling = True


def _announce_compile(what: str, reason: str) -> None:
    """Each compile at INFO with why it is built; the process's first one also once at WARNING."""
    global _announced_compiling
    if not _announced_compiling:
        _announced_compiling = True
        logger.warning("sparsekv: compiling JIT kernels in this process (a few seconds each; %s)", PREBUILD_HINT)
    logger.info("JIT: compiling %s (%s)", what, reason)


#: Where in a staging directory :func:`snapshot_closure` writes the keyed headers.
SNAPSHOT_DIR = "csrc"


def snapshot_closure(plan: BuildPlan, staging: Path) -> tuple[Path, Path]:
    """Write the include closure's bytes, the ones the key hashed, into ``staging``; returns its
    include directories (the snapshot's ``csrc`` and ``csrc/include``).

    The compilers read the headers from this snapshot, never from ``plan.csrc``: a header edited
    (or switched by a checkout or rebase) after the plan read it would otherwise be compiled into
    the entry named by its old bytes, and every later load of the old bytes would get the new code.
    A header the closure misses is then a compile error instead of a build from unkeyed bytes.
    """
    snapshot = staging / SNAPSHOT_DIR
    for rel, data in plan.closure.items():
        path = snapshot / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return snapshot, snapshot / "include"


def _source_path_map(staging: Path, plan: BuildPlan) -> list[str]:
    """The host-compiler flag naming the snapshot's headers by their ``plan.csrc`` paths in ``__FILE__``,
    debug line tables and sanitizer reports (the staging directory is renamed away after the build)."""
    return [f"-ffile-prefix-map={staging / SNAPSHOT_DIR}={plan.csrc}"]


def build_module(plan: BuildPlan, staging: Path, reason: str = "not in cache") -> Path:
    """Compile ``plan`` inside ``staging``; returns the path of the shared library. ``reason`` says
    why it is built (``"not in cache"``, ``"header changed: ..."``, ``"flags changed"``, ...)."""
    for name, text in plan.sources.items():
        (staging / name).write_text(text)
    includes = [f"-I{headers}" for headers in snapshot_closure(plan, staging)]
    ffi_include_dirs = [tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_dlpack_include_path()]
    ffi_includes = [f"-I{p}" for p in dict.fromkeys(ffi_include_dirs)]
    ffi_lib = Path(tvm_ffi.libinfo.find_libtvm_ffi())
    link = [f"-L{ffi_lib.parent}", "-ltvm_ffi"]
    # The key is defined on the command line, not in module.cpp: the key hashes module.cpp.
    includes = [f"-DSPARSEKV_MODULE_KEY=\"{plan.entry_name()}\"", *includes]
    what = plan.describe()
    start = time.perf_counter()
    _announce_compile(what, reason)
    _compile(plan, staging, what, includes, ffi_includes, link, time.monotonic() + env.jit_compile_timeout())
    shutil.rmtree(staging / SNAPSHOT_DIR)  # a failed compile keeps it, for its reproduce command
    seconds = time.perf_counter() - start
    COMPILED.append((what, seconds))
    logger.info("JIT: compiled %s in %.2f s", what, seconds)
    return staging / cache.ARTIFACT


def _compile(plan: BuildPlan, staging: Path, what: str, includes: list[str], ffi_includes: list[str],
             link: list[str], deadline: float) -> None:
    path_map = _source_path_map(staging, plan)  # host compiles only: nvcc does not take the flag
    if plan.backend == "cpu":
        cmd = [plan.cxx.path, *CXX_FLAGS, *sanitizer_flags(plan.sanitize), *plan.extra_cflags, *path_map, *includes,
               *ffi_includes, "-shared", "module.cpp", "-o", cache.ARTIFACT, *link]
        _wait_all([(cmd, _run(cmd, staging))], staging, what, deadline)
    elif plan.backend == "sim":
        rest = [*sanitizer_flags(plan.sanitize), *plan.extra_cflags, *path_map, *includes]
        sim_cmd = [plan.cxx.path, *CXX_FLAGS, *rest, "-c", "kernels_sim.cpp", "-o", "kernels_sim.o"]
        cxx_cmd = [plan.cxx.path, *cxx_flags("sim"), *rest, *ffi_includes, "-c", "module.cpp", "-o", "module.o"]
        _wait_all([(sim_cmd, _run(sim_cmd, staging)), (cxx_cmd, _run(cxx_cmd, staging))], staging, what, deadline)
        link_cmd = [plan.cxx.path, *sanitizer_flags(plan.sanitize), "-shared", "module.o", "kernels_sim.o", "-o",
                    cache.ARTIFACT, *link]
        _wait_all([(link_cmd, _run(link_cmd, staging))], staging, what, deadline)
    else:
        assert plan.nvcc is not None  # internal invariant: cuda plans always carry nvcc
        cuda_home = toolchain.cuda_home()
        nvcc_cmd = [plan.nvcc.path, *NVCC_FLAGS, *plan.extra_cflags, *arch_mod.gencode_flags(plan.archs), *includes,
                    "-c", "kernels.cu", "-o", "kernels.o"]
        cxx_cmd = [plan.cxx.path, *CXX_FLAGS, *plan.extra_cflags, *path_map, *includes, *ffi_includes, "-c",
                   "module.cpp", "-o", "module.o"]
        # nvcc and the host compiler run side by side; the .cu has no tvm-ffi headers, so it is the short one.
        _wait_all([(nvcc_cmd, _run(nvcc_cmd, staging)), (cxx_cmd, _run(cxx_cmd, staging))], staging, what, deadline)
        link_cmd = [plan.cxx.path, "-shared", "module.o", "kernels.o", "-o", cache.ARTIFACT, *link,
                    f"-L{cuda_home / 'lib64'}", "-lcudart"]
        _wait_all([(link_cmd, _run(link_cmd, staging))], staging, what, deadline)


_logging_checked = False


def _log_from_environment() -> None:
    """On the first module load of the process: :func:`sparsekv.log.configure_from_environment`
    (``SPARSEKV_LOG_LEVEL``, ``SPARSEKV_JIT_VERBOSE``). Library users need not configure logging."""
    global _logging_checked
    if not _logging_checked:
        _logging_checked = True
        log.configure_from_environment()


def make_plan(
    name: str,
    template_args: tuple,
    *,
    header: str,
    exports: Mapping[str, str],
    kernels: Sequence[str],
    backend: str,
    arch: str | tuple[str, ...] | None,
    probe_dir: Path | None,
    csrc: Path | None = None,
) -> BuildPlan:
    """Resolve a module request into a :class:`BuildPlan` (reads headers, probes compilers once).

    ``csrc`` defaults to the installed headers; a kernel developer may point it at another tree.
    """
    csrc = csrc_root() if csrc is None else Path(csrc)
    if backend not in BACKENDS:
        raise ValueError(f"sparsekv: backend must be one of {BACKENDS}, got {backend!r}")
    if not exports:
        raise ValueError("sparsekv: a JIT module needs at least one export")
    args = tuple(cpp_template_arg(a) for a in template_args)
    is_cuda = backend == "cuda"
    archs = arch_mod.resolve_arch_list(arch) if is_cuda else ()
    cxx, nvcc = _compilers(is_cuda, probe_dir)
    return BuildPlan(
        name=name,
        args=args,
        backend=backend,
        archs=archs,
        sources=generate_sources(header, exports, kernels, args, backend),
        closure=include_closure(header, csrc) | (include_closure(SIM_HEADER, csrc) if backend == "sim" else {}),
        cxx=cxx,
        nvcc=nvcc,
        extra_cflags=tuple(env.extra_cflags()),
        csrc=csrc,
        sanitize=() if is_cuda else env.sanitize(),
    )


#: Identity of a compiler that is not installed (strict mode only: nothing will be compiled).
ABSENT = toolchain.Compiler(path="", identity="<not installed>")


def _compilers(is_cuda: bool, probe_dir: Path | None) -> tuple[toolchain.Compiler, toolchain.Compiler | None]:
    """The host compiler and nvcc; in strict mode a missing one is :data:`ABSENT` (a prebuilt module
    may still be found, see :func:`_find_compatible`)."""
    try:
        cxx = toolchain.host_compiler(probe_dir)
    except toolchain.ToolchainError:
        if not env.jit_strict():
            raise
        cxx = ABSENT
    if not is_cuda:
        return cxx, None
    try:
        return cxx, toolchain.nvcc(probe_dir)
    except toolchain.ToolchainError:
        if not env.jit_strict():
            raise
        return cxx, ABSENT


# Key inputs that name the compilers rather than what they compile; a strict-mode process may load a
# module built by another compiler version (a bundle from a build machine) when all else matches.
_COMPILER_FIELDS = ("cxx", "nvcc")


def _find_compatible(plan: BuildPlan, roots: cache.CacheRoots) -> Path | None:
    """A valid artifact whose key equals ``plan``'s in everything but the compiler identities."""
    want = {k: v for k, v in plan.key_doc().items() if k not in _COMPILER_FIELDS}
    prefix = plan.entry_name().rsplit("__", 1)[0] + "__"
    for root in roots.read:
        for entry_dir in cache.entries(root):
            if not entry_dir.name.startswith(prefix):
                continue
            try:
                doc = json.loads((entry_dir / cache.KEY_FILE).read_text())
            except (OSError, ValueError):
                continue
            if {k: v for k, v in doc.items() if k not in _COMPILER_FIELDS and k != "artifact"} == want:
                so = cache.valid_artifact(entry_dir)
                if so is not None:
                    return so
    return None


# Entries whose compile failed in this process: a retry fails fast instead of recompiling (no
# rebuild storm). The entry name is a content key, so editing the sources gives a new name and a
# fresh attempt.
_failed: dict[str, JitCompileError] = {}


class JitModuleMismatchError(RuntimeError):
    """A loaded artifact is not the module of its cache entry (another instance's module copied or
    swapped into its place, or an index or path redirected elsewhere); the loader rebuilds it."""


# Paths whose loaded library was refused: the dynamic loader hands back the library it already
# loaded from a path, even after the file there was replaced, so their rebuilt files are loaded
# through another spelling of the path (path -> refusals so far).
_refused: dict[str, int] = {}


def _load(path: Path, entry: str) -> tvm_ffi.Module:
    """Load the artifact ``path`` of cache entry ``entry``, checking the entry name the module embeds.

    Raises
    ------
    JitModuleMismatchError
        The module was built as another entry, or embeds none.
    """
    refusals = _refused.get(str(path), 0)
    spelled = os.path.join(path.parent, *(["."] * refusals), path.name)
    module = tvm_ffi.load_module(spelled)
    try:
        embedded = module.get_function(MODULE_KEY_EXPORT)()
    except AttributeError:
        embedded = None
    if embedded != entry:
        _refused[str(path)] = refusals + 1
        raise JitModuleMismatchError(f"sparsekv: {path} is not the module of cache entry {entry} (it "
                                     + (f"was built as {embedded})" if embedded else "embeds no entry name)"))
    cache.mark_used(path.parent)
    return module


def _capturing_cuda_graph() -> bool:
    import torch  # already imported by tvm_ffi; only its CUDA state is read here

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def find_or_build(plan: BuildPlan, roots: cache.CacheRoots, reason: str = "not in cache") -> tvm_ffi.Module:
    """Load ``plan``'s artifact from any cache root, building and publishing it on a miss (logged
    with ``reason``: why the module is built)."""
    entry = plan.entry_name()
    _check_sanitizer_runtime(plan.sanitize)
    for root in roots.read:
        so = cache.valid_artifact(root / entry)
        if so is None:
            continue
        try:
            module = _load(so, entry)
            logger.debug("JIT: cache hit %s (%s)", entry, root)
            return module
        except Exception as exc:  # noqa: BLE001 - unloadable or another module: a miss, rebuilt below
            logger.warning("JIT artifact %s does not load (%s); rebuilding", so, exc)
    if _capturing_cuda_graph():
        raise JitCacheMissError(
            f"sparsekv: JIT module {plan.describe()} is not in the cache and the current CUDA stream is capturing "
            f"a graph, where a compile would stall or break the capture; load the module (or `sparsekv jit build`) "
            f"before capturing"
        )
    if env.jit_strict():
        so = _find_compatible(plan, roots)
        if so is not None:
            logger.info("JIT: strict mode loads %s built by another compiler version", so.parent.name)
            return _load(so, so.parent.name)
        raise JitCacheMissError(
            f"sparsekv: JIT module {plan.describe()} is not in the cache "
            f"({', '.join(map(str, roots.read)) or 'none exists'}; entry {entry}) and SPARSEKV_JIT_STRICT=1 "
            f"forbids compiling; prebuild it with `sparsekv jit build {plan.name}` (its table), "
            f"`sparsekv jit build --model MODEL` (a model's serving path) or import a bundle (`sparsekv jit import`); "
            f"`sparsekv jit explain-key` shows the key inputs"
        )
    if plan.cxx is ABSENT or plan.nvcc is ABSENT:  # only reachable when strict mode was switched off meanwhile
        raise toolchain.ToolchainError(f"sparsekv: no compiler to build {plan.describe()}")
    failed = _failed.get(entry)
    if failed is not None:
        raise JitCompileError(f"{failed} \n(remembered: this module failed to compile earlier in this process; "
                              f"it is retried once its sources, flags or compiler change)",
                              what=failed.what, command=failed.command, cwd=failed.cwd, output=failed.output,
                              hint=failed.hint)
    # A malformed SPARSEKV_CACHE_MAX_SIZE or timeout is reported before anything compiles.
    env.cache_max_size()
    env.jit_lock_timeout()
    try:
        return cache.build_and_publish(roots, entry, plan.key_doc(),
                                       lambda staging: build_module(plan, staging, reason),
                                       lambda so: _load(so, entry))
    except JitCompileTimeoutError:
        raise
    except JitCompileError as exc:
        _failed[entry] = exc
        raise


# The warm path's shortcut ("direct mode"): a small index file per module request records the
# entry its content key resolved to, with the size and mtime of every file that key was computed
# from (the headers of the include closure and the compilers). When none of them changed, the
# entry is loaded without reading headers, hashing them or probing compilers. Any change falls
# back to the full, content-addressed path, which rewrites the index. The index holds absolute
# paths: it is a local accelerator, never part of a key.
INDEX_DIR = ".index"


@dataclass(frozen=True)
class ModuleRequest:
    """What a caller asked for, resolved against the environment but not against file contents."""

    name: str
    template_args: tuple
    header: str
    exports: tuple
    kernels: tuple
    backend: str
    archs: tuple[str, ...]
    extra_cflags: tuple[str, ...]
    sanitize: tuple[str, ...]
    csrc: str
    compilers: tuple[str, ...]

    def digest(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:24]


def _stat_signature(paths: Sequence[str]) -> dict[str, list[int]]:
    signature = {}
    for path in paths:
        st = os.stat(path)
        signature[path] = [st.st_size, st.st_mtime_ns]
    return signature


def _load_indexed(request: ModuleRequest, roots: cache.CacheRoots) -> tvm_ffi.Module | None:
    """The module the index names, if every recorded file is unchanged and the artifact is valid.

    The index is a shortcut, not an authority: the entry it names must be a plain entry name whose
    key.json hashes to it and records this request's inputs (and the index exactly that key's
    headers and this request's compilers), and the module must embed that name.
    """
    _check_sanitizer_runtime(request.sanitize)
    prefix = entry_prefix(request.name, request.template_args, request.backend)
    for root in roots.read:
        try:
            index = json.loads((root / INDEX_DIR / f"{request.name}__{request.digest()}.json").read_text())
            entry = index["entry"]
            if index["tvm_ffi"] != tvm_ffi.__version__ or _stat_signature(index["files"]) != index["files"]:
                continue
            if not entry.startswith(prefix) or os.path.basename(entry) != entry:
                continue
            found = cache.read_entry(root / entry)
            if found is None or not _entry_answers(request, found[1], entry, index["files"]):
                continue
            module = _load(found[0], entry)
            logger.debug("JIT: cache hit %s (%s)", entry, root)
            return module
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        except Exception:  # noqa: BLE001 - an unloadable or mismatched artifact: take the full path
            continue
    return None


def _entry_answers(request: ModuleRequest, doc: Mapping, entry: str, files: Mapping[str, list[int]]) -> bool:
    """Whether the key document ``doc`` of ``entry`` is one ``request`` resolves to, given the index's
    stat signature ``files`` (the headers' bytes are what the index's stat signature vouches for)."""
    if entry_name(doc) != entry:
        return False
    sources = generate_sources(request.header, dict(request.exports), request.kernels, request.template_args,
                               request.backend)
    want = {"name": request.name, "template_args": list(request.template_args), "backend": request.backend,
            "archs": list(request.archs), "extra_cflags": list(request.extra_cflags),
            "sanitize": sanitizer_flags(request.sanitize), "tvm_ffi": tvm_ffi.__version__,
            "loader_format": LOADER_FORMAT,
            "sources": {k: hashlib.sha256(v.encode()).hexdigest() for k, v in sources.items()}}
    if any(doc.get(k) != v for k, v in want.items()):
        return False
    headers = [os.path.join(request.csrc, rel) for rel in doc["include_closure"]]
    return sorted(files) == sorted(headers + [c for c in request.compilers if c])


def _closure_changed(closure: Mapping[str, bytes], root: Path) -> bool:
    """Whether any header of ``closure`` (csrc-relative path -> bytes) now reads differently under ``root``."""
    for rel, data in closure.items():
        try:
            with open(os.path.join(root, rel), "rb") as f:
                if f.read() != data:
                    return True
        except OSError:
            return True
    return False


def _request_summary(request: ModuleRequest) -> dict:
    """What a later rebuild of the same instance compares to say why it rebuilds."""
    return {"instance": [request.header, list(request.template_args), request.backend],
            "flags": [list(request.archs), list(request.extra_cflags), list(request.sanitize)],
            "compilers": list(request.compilers)}


def rebuild_reason(request: ModuleRequest, roots: cache.CacheRoots) -> str:
    """Why ``request`` is not loaded from the cache, from the indexes earlier loads of the same
    instance left: ``"header changed: <files>"``, ``"compiler changed"``, ``"flags changed"`` (arch,
    SPARSEKV_EXTRA_CFLAGS or sanitizers), or ``"not in cache"``."""
    mine = _request_summary(request)
    flags_differ = False
    for root in roots.read:
        for path in sorted((root / INDEX_DIR).glob(f"{request.name}__*.json")):
            try:
                doc = json.loads(path.read_text())
                if doc.get("request", {}).get("instance") != mine["instance"]:
                    continue
                if doc["request"]["flags"] != mine["flags"]:
                    flags_differ = True
                    continue
                changed = []
                for file, signature in doc["files"].items():
                    try:
                        if _stat_signature([file])[file] != signature:
                            changed.append(file)
                    except OSError:
                        changed.append(file)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            headers = [os.path.basename(f) for f in changed if f not in request.compilers]
            if headers:
                return f"header changed: {', '.join(headers)}"
            if changed or doc["request"]["compilers"] != mine["compilers"]:
                return "compiler changed"
    return "flags changed" if flags_differ else "not in cache"


def _write_index(request: ModuleRequest, plan: BuildPlan, roots: cache.CacheRoots) -> None:
    """Record the request -> entry shortcut next to the artifact (best effort: a read-only root
    simply keeps taking the full path)."""
    entry = plan.entry_name()
    for root in roots.read:
        if cache.valid_artifact(root / entry) is None:
            continue
        files = [str(plan.csrc / rel) for rel in plan.closure] + [c for c in request.compilers if c]
        doc = {"entry": entry, "tvm_ffi": tvm_ffi.__version__, "files": _stat_signature(files),
               "request": _request_summary(request)}
        # Stat first, then check the bytes are still those the key hashed: a header edited since (e.g.
        # while the module compiled) must not be recorded as this entry's, or the next process would
        # load the old module for the new header until the header changed again.
        if _closure_changed(plan.closure, plan.csrc):
            return
        try:
            index_dir = root / INDEX_DIR
            index_dir.mkdir(mode=0o700, exist_ok=True)
            tmp = index_dir / f".{request.digest()}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, index_dir / f"{request.name}__{request.digest()}.json")
        except OSError:
            pass
        return


def _resolve_request(name: str, template_args: tuple, header: str, exports: Mapping[str, str],
                     kernels: Sequence[str], backend: str, arch) -> ModuleRequest:
    if backend not in BACKENDS:
        raise ValueError(f"sparsekv: backend must be one of {BACKENDS}, got {backend!r}")
    is_cuda = backend == "cuda"
    compilers = []
    for find in (toolchain.host_compiler_path,) + ((toolchain.nvcc_path,) if is_cuda else ()):
        try:
            compilers.append(find())
        except toolchain.ToolchainError:
            if not env.jit_strict():
                raise
            compilers.append("")  # strict mode without a compiler: resolved against the cache only
    return ModuleRequest(
        name=name, template_args=tuple(cpp_template_arg(a) for a in template_args), header=header,
        exports=tuple(exports.items()), kernels=tuple(kernels), backend=backend,
        archs=arch_mod.resolve_arch_list(arch) if is_cuda else (), extra_cflags=tuple(env.extra_cflags()),
        sanitize=() if is_cuda else env.sanitize(), csrc=str(csrc_root()), compilers=tuple(compilers),
    )


_load_lock = threading.Lock()


def load_jit(
    name: str,
    *template_args: object,
    header: str,
    exports: Mapping[str, str],
    kernels: Sequence[str] = (),
    backend: str = "cpu",
    arch: str | tuple[str, ...] | None = None,
) -> tvm_ffi.Module:
    """Compile (at first use) and load one instance of a kernel module.

    Parameters
    ----------
    name : str
        Module stem, e.g. ``"gather_rows"``.
    *template_args : bool, int or str
        Template arguments shared by every export and kernel of the module, e.g. ``("int64_t",)``.
    header : str
        Kernel header, relative to ``csrc/``.
    exports : Mapping[str, str]
        Exported Python name -> C++ function template (instantiated with ``template_args``).
    kernels : Sequence[str]
        Kernel structs (instantiated with ``template_args``) whose CUDA launchers the cuda and sim
        backends need; unused by the cpu backend.
    backend : {"cpu", "cuda", "sim"}
        Compiler and device the module targets (sim: the CUDA path on the CPU, see ``csrc/sim/sim.h``).
    arch : str or tuple of str, optional
        CUDA archs (cuda backend); default from ``SPARSEKV_CUDA_ARCH`` and friends.

    Returns
    -------
    tvm_ffi.Module
        The loaded module. Nothing is memoized here: each call resolves the request against the
        cache as a new process would, reading the environment inputs of the key (flags, sanitizers,
        arch) anew. The one in-process memo of loaded modules is :meth:`KernelFamily.module`'s.

    Raises
    ------
    JitCompileError
        The compiler rejected the module (its first errors, a hint and the reproduce command included);
        raised again without compiling for the rest of the process unless the sources change.
    JitCacheMissError
        Strict mode or CUDA-graph capture and the module is not cached (names module, args, backend, arch).
    sparsekv.jit_kernel.build.toolchain.ToolchainError
        A compiler or the CUDA toolkit is missing.
    sparsekv.jit_kernel.build.cache.CacheSecurityError
        The cache is writable by other users.
    """
    # One load at a time in this process: a second thread asking for the same module waits for the
    # first one's build and then finds it in the index (no second compile).
    with _load_lock:
        _log_from_environment()
        roots = cache.open_roots()
        request = _resolve_request(name, template_args, header, exports, kernels, backend, arch)
        module = _load_indexed(request, roots)
        if module is None:
            plan = make_plan(name, template_args, header=header, exports=exports, kernels=kernels,
                             backend=backend, arch=request.archs, probe_dir=roots.probe_dir())
            module = find_or_build(plan, roots, rebuild_reason(request, roots))
            _write_index(request, plan, roots)
    return module

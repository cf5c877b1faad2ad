"""CLI manners of every ``sparsekv`` command and every tool script, run as a user runs them.

The commands are discovered from the argparse parser (:func:`sparsekv.cli.iter_commands`), so a
subcommand registered later is covered without touching this file: each prints ``--help`` with an
example and rejects a bogus flag with one line on stderr and exit code 2. A table of bad
arguments checks the exit code (2 usage, 1 failure) and that the message is one line. No output
of any run contains a Python traceback.

The tool scripts' argument checks run in this process, each script as ``__main__`` with its own
``sys.argv`` and its folder first on ``sys.path``, as ``python tools/x.py`` runs it (:func:`run_script`):
a fresh interpreter would import torch again for every call, about 2 CPU seconds each, over a
minute for the table. The scripts also run as real processes: ``make gpu-check DRY_RUN=1``
(``tests/test_gpu_check.py``) runs every kernel benchmark's ``--help``, and two tests below run a
script as a user does.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest

from sparsekv.cli import SUBCOMMANDS, Subcommand, UsageError, build_parser, iter_commands, main

REPO = Path(__file__).resolve().parents[2]
COMMANDS = [prefix for prefix, _ in iter_commands(build_parser(load="all"))]
TOOLS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tools").rglob("*.py"))


def sparsekv(*argv: str, env: dict | None = None, cache_dir: Path | None = None) -> subprocess.CompletedProcess:
    run_env = dict(os.environ, **(env or {}))
    if cache_dir is not None:
        run_env["SPARSEKV_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "sparsekv", *argv], capture_output=True, text=True, env=run_env,
                          timeout=300, cwd=REPO)


def assert_no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stdout and "Traceback" not in done.stderr, done.stderr[-2000:]


def run_script(tool: str, *argv: str, monkeypatch) -> subprocess.CompletedProcess:
    """``python TOOL ARGV...`` in this process: the script runs as ``__main__`` with ``sys.argv`` and
    ``sys.path[0]`` as the interpreter sets them for a script; its exit code and output are returned
    as :func:`subprocess.run` would. An exception the script lets escape fails the calling test."""
    path = REPO / tool
    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [str(path), *argv])
        patch.setattr(sys, "path", [str(path.parent), *sys.path])  # and a script's own sys.path edits stay inside
        patch.chdir(REPO)
        siblings = set(sys.modules)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
        finally:
            for name in set(sys.modules) - siblings:  # a sibling script it imported (bench_hisparse) is not kept
                if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(REPO / "tools")):
                    del sys.modules[name]
    if isinstance(code, str):  # sys.exit("message"): printed to stderr, status 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess([tool, *argv], code or 0, out.getvalue(), err.getvalue())


#: What only the shell (and sparsekv.log, for the handler) may define: one error type, one parser class,
#: one place that attaches a log handler. A command or tool that grew its own would drift from the others.
SHELL_ONLY = {"class UsageError": "sparsekv/cli/__init__.py", "(argparse.ArgumentParser)": "sparsekv/cli/__init__.py",
              "ArgumentParser(": None, "addHandler(": "sparsekv/log.py", "basicConfig(": None}


def test_one_shell_defines_the_errors_the_parser_and_the_log_handler():
    sources = {p.relative_to(REPO).as_posix(): p.read_text() for folder in ("sparsekv", "jit_kernel", "srt", "tools")
               for p in sorted((REPO / folder).rglob("*.py"))}
    found = {(needle, path) for path, text in sources.items() for needle in SHELL_ONLY if needle in text}
    assert found == {(needle, where) for needle, where in SHELL_ONLY.items() if where}


def test_discovery_sees_every_registered_command():
    names = {c[0] for c in COMMANDS if c}
    assert {"jit", "plan-memory"} <= names
    assert ("jit", "build") in COMMANDS and ("jit", "list") in COMMANDS


# These two run in-process (main() returns the exit code; an escaping exception fails the test).
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "sparsekv")
def test_every_command_prints_help_with_an_example(command, capsys):
    code = main([*command, "--help"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.startswith(f"usage: {' '.join(('sparsekv',) + command)}")
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert any(line.strip().startswith(" ".join(("sparsekv",) + command)) for line in examples), out


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "sparsekv")
def test_every_command_rejects_an_unknown_flag_in_one_line(command, capsys):
    code = main([*command, "--no-such-flag"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(" ".join(("sparsekv",) + command) + ": error: ")


BAD_ARGUMENTS = [
    # (argv, exit code(s), words the one-line message must contain, any case)
    (["no-such-command"], 2, "invalid choice"),
    (["plan-memory"], 2, "exactly one of"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "60"], 2, "did you mean 60GiB"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "60 parsecs"], 2, "--kv-budget"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "1" * 400 + "GiB"], 2, "--kv-budget"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "2PiB"], 2, "1 PiB"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "40GiB", "--pp", "x"], 2, "--pp"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "40GiB", "--pp", "9" * 400], 2, "--pp"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "40GiB", "--page-size", "100"], 2, "--page-size"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "40GiB", "--max-running-requests", "9" * 400], 2,
     "--max-running-requests"),
    (["plan-memory", "--case", "no-such-case"], 2, "--list-cases"),
    (["plan-memory", "--case", "flash-pp1-40GiB", "--model", "dsv4-flash"], 2, "exactly one of"),
    (["plan-memory", "--model", "dsv4-flash", "--kv-budget", "1GiB"], 1, "SWA pool"),
    (["jit"], 2, "ACTION"),
    (["jit", "build"], 2, "jit build"),
    (["jit", "build", "no_such_kernel"], 2, "no_such_kernel"),
    # no GPU and no arch given (or a GPU but a bogus arch list): a failure of ours, not a traceback
    (["jit", "build", "gather_rows", "--backend", "cuda"], (1, 2), "arch"),
    (["jit", "build", "--instance", "gather_rows:index_dtype=int64,index_dtype=int32"], 2, "given twice"),
    (["jit", "prune", "--older-than", "-1", "--dry-run"], 2, "--older-than"),
    (["jit", "prune", "--older-than", "nan", "--dry-run"], 2, "--older-than"),
    (["bench", "no_such_bench"], 2, "NAME"),
    (["bench", "gather_rows", "--backend", "gpu"], 2, "--backend"),
    # pd-demo: every flag checked when parsed (these once ran, stalled or printed a traceback)
    (["pd-demo", "--seq-lens", "-5"], 2, "--seq-lens"),
    (["pd-demo", "--seq-lens", ""], 2, "--seq-lens"),
    (["pd-demo", "--seq-lens", "abc"], 2, "--seq-lens"),
    (["pd-demo", "--layers", "0"], 2, "--layers"),
    (["pd-demo", "--pp-size", "0"], 2, "--pp-size"),
    (["pd-demo", "--pp-size", "100"], 2, "--pp-size"),
    (["pd-demo", "--timeout", "-1"], 2, "--timeout"),
    (["pd-demo", "--timeout", "nan"], 2, "--timeout"),
    (["pd-demo", "--budget-mib", str(10**9)], 2, "--budget-mib"),
    # no C4 layer in 2 layers: once a 19.6 GB plan, now refused before any process starts
    (["pd-demo", "--layers", "2", "--pp-size", "1", "--hisparse", "on"], 2, "--hisparse on"),
    (["pd-demo", "--layers", "2"], 2, "--hisparse both"),
]

#: Every tool script's flags, held to the same manners (exit 2, one line naming the flag, no traceback).
BAD_TOOL_ARGUMENTS = [
    ("tools/hisparse_sim.py", ["--hot", "abc"], "--hot"),
    ("tools/hisparse_sim.py", ["--trace", "/nonexistent/trace.json"], "--trace"),
    ("tools/hisparse_sim.py", ["--top-k", "0"], "--top-k"),
    ("tools/hisparse_sim.py", ["--requests", "-1"], "--requests"),
    ("tools/hisparse_sim.py", ["--growth", "2"], "--growth"),
    ("tools/hisparse_sim.py", ["--json", "/nonexistent/out.json"], "--json"),
    ("tools/bench/bench_pd_transfer.py", ["--layers", "0"], "--layers"),
    ("tools/bench/bench_pd_transfer.py", ["--repeats", "0"], "--repeats"),
    ("tools/bench/bench_pd_transfer.py", ["--stream", "-1"], "--stream"),
    ("tools/bench/bench_jit_loader.py", ["--fresh-runs", "0"], "--fresh-runs"),
    ("tools/bench/bench_jit_loader.py", ["--plot", "/nonexistent/plot.png"], "--plot"),
    ("tools/bench/bench_dsv4_compress.py", ["--backend", "gpu"], "--backend"),
    ("tools/gpu_check.py", ["--budget-s", "nan"], "--budget-s"),
    ("tools/gpu_check.py", ["--jobs", "0"], "--jobs"),
    ("tools/gpu_check.py", ["--out", "/proc/x", "--dry-run"], "--out /proc/x: cannot create the folder"),
]


@pytest.mark.parametrize("tool, argv, needle", BAD_TOOL_ARGUMENTS, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else v)
def test_bad_tool_arguments_give_one_line_and_exit_2(tool, argv, needle, monkeypatch):
    done = run_script(tool, *argv, monkeypatch=monkeypatch)
    assert_no_traceback(done)
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and needle in done.stderr, done.stderr


def test_a_trace_nested_past_the_parser_is_a_usage_error(tmp_path):
    trace = tmp_path / "nested.json"
    trace.write_text("[" * 100_000 + "]" * 100_000)
    done = subprocess.run([sys.executable, "tools/hisparse_sim.py", "--trace", str(trace)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert_no_traceback(done)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert f"--trace {trace}: not a readable trace file (RecursionError" in done.stderr


def test_a_cuda_backend_without_a_gpu_is_a_usage_error():
    done = subprocess.run([sys.executable, "tools/bench/bench_dsv4_compress.py", "--backend", "cuda"],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert_no_traceback(done)
    assert done.returncode == 2 and "--backend" in done.stderr and "CUDA" in done.stderr, done.stderr


def test_a_cache_dir_that_is_a_file_is_refused(tmp_path, sparsekv_cli):
    (tmp_path / "file").write_text("")
    done = sparsekv_cli("jit", "build", "gather_rows", cache_dir=tmp_path / "file")
    assert_no_traceback(done)
    assert done.returncode == 1 and "not a directory" in done.stderr


@pytest.mark.parametrize("argv, code, needle", BAD_ARGUMENTS, ids=lambda v: " ".join(v)[:60] if isinstance(v, list)
                         else None)
def test_bad_arguments_give_one_line_and_the_right_exit_code(argv, code, needle, tmp_path, monkeypatch, capsys):
    env = {"SPARSEKV_CUDA_ARCH": "", "TVM_FFI_CUDA_ARCH_LIST": "", "CUDA_VISIBLE_DEVICES": ""}
    if "cuda" in argv:  # hiding the GPU takes a process of its own (this one may have seen it already)
        done = sparsekv(*argv, cache_dir=tmp_path / "cache", env=env)
    else:  # in this process: a fresh interpreter would import torch again for many of them, about 2 CPU s each
        for name, value in {**env, "SPARSEKV_CACHE_DIR": str(tmp_path / "cache")}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(REPO)
        returncode = main(argv)
        out, err = capsys.readouterr()
        done = subprocess.CompletedProcess(argv, returncode, out, err)
    assert_no_traceback(done)
    assert done.returncode in (code if isinstance(code, tuple) else (code,)), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert needle.lower() in done.stderr.lower()


@pytest.fixture
def failing_subcommand(monkeypatch):
    """A registered subcommand whose run() fails the way a bug or an error of ours would."""
    module = types.ModuleType("sparsekv_test_failing_subcommand")
    module.add_arguments = lambda parser: parser.add_argument("--usage", action="store_true")

    def run(args):
        if args.usage:
            raise UsageError("--usage: this is a usage error")
        raise RuntimeError("the device is on fire")

    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SUBCOMMANDS, "fail", Subcommand(module.__name__, "fails", ("sparsekv fail",)))


def test_a_failure_is_one_line_and_its_traceback_shows_only_under_debug(failing_subcommand, capsys):
    assert main(["fail"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "sparsekv fail: error: RuntimeError: the device is on fire (--debug shows the traceback)"]
    assert main(["fail", "--usage"]) == 2
    assert capsys.readouterr().err.splitlines() == ["sparsekv fail: error: --usage: this is a usage error "
                                                    "(see sparsekv fail --help)"]
    for argv in (["--debug", "fail"], ["fail", "--debug"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "RuntimeError: the device is on fire" in err


def test_a_jit_failure_is_one_line(tmp_path, sparsekv_cli):
    # The cuda backend with a malformed arch list fails inside the JIT loader.
    done = sparsekv_cli("jit", "build", "gather_rows", "--backend", "cuda", "--arch", "banana",
                        cache_dir=tmp_path / "c")
    assert_no_traceback(done)
    assert done.returncode in (1, 2) and "banana" in done.stderr


def test_a_closed_pipe_is_quiet():
    # `sparsekv plan-memory ... | head -1`: the reader goes away before the output is written.
    for argv in (["plan-memory", "--list-cases"], ["plan-memory", "--case", "flash-pp2-40GiB"], ["--help"],
                 ["jit", "list"]):
        proc = subprocess.Popen([sys.executable, "-m", "sparsekv", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=REPO)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0 and err == "", (argv, err)


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_script_prints_help_and_rejects_a_bogus_flag(tool, monkeypatch):
    done = run_script(tool, "--help", monkeypatch=monkeypatch)
    assert_no_traceback(done)
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
    bad = run_script(tool, "--no-such-flag", monkeypatch=monkeypatch)
    assert_no_traceback(bad)
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr


@pytest.mark.parametrize("tool", ["tools/hisparse_sim.py"])
def test_top_level_tools_show_an_example(tool):
    # As a user runs it (a real process: the script imports no torch, so this costs little).
    done = subprocess.run([sys.executable, tool, "--help"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert "example:\n  python " + tool in done.stdout


# ---- logging -------------------------------------------------------------------------------------


def compile_lines(stderr: str) -> list[str]:
    # (searched, not matched at line start: a progress bar may share the terminal line)
    return re.findall(r"sparsekv\.jit INFO: .*compiled .* in [0-9.]+ s", stderr)


def test_verbose_shows_one_line_per_compile_with_its_time(tmp_path, sparsekv_cli):
    """One compile per run, the cheapest there is (three in all); two compiles giving two lines, each
    naming its instance: ``tests/jit/test_jit_cli.py::test_build_progress_logs_and_counts``."""
    argv = ["jit", "build", "--instance", "gather_rows:index_dtype=int32"]
    quiet = sparsekv_cli(*argv, cache_dir=tmp_path / "quiet")
    assert quiet.returncode == 0 and compile_lines(quiet.stderr) == []
    for how, loud in (("-v", sparsekv_cli("-v", *argv, cache_dir=tmp_path / "verbose")),
                      ("SPARSEKV_LOG_LEVEL", sparsekv_cli(*argv, cache_dir=tmp_path / "level",
                                                          SPARSEKV_LOG_LEVEL="INFO"))):
        assert loud.returncode == 0, (how, loud.stderr)
        lines = compile_lines(loud.stderr)
        assert len(lines) == 1 and "gather_rows<int32_t>" in lines[0], (how, loud.stderr)


def test_a_bad_log_level_is_a_usage_error(sparsekv_cli):
    done = sparsekv_cli("plan-memory", "--list-cases", cache_dir=None, SPARSEKV_LOG_LEVEL="chatty")
    assert done.returncode == 2 and "SPARSEKV_LOG_LEVEL" in done.stderr and done.stdout == ""


def test_the_library_logs_once_configured_from_the_environment():
    probe = ("import logging, sparsekv.log\n"
             "logging.getLogger('sparsekv.jit').info('before')\n"
             "sparsekv.log.configure()\n"
             "logging.getLogger('sparsekv.jit').info('after')\n"
             "logging.getLogger('other').warning('not ours')\n")
    env = dict(os.environ, SPARSEKV_LOG_LEVEL="INFO")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert done.stderr.splitlines() == ["sparsekv.jit INFO: after", "not ours"]


@pytest.fixture
def restore_sparsekv_logger():
    logger = logging.getLogger("sparsekv")
    saved = (logger.level, list(logger.handlers))
    yield
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]


def test_logging_configures_the_sparsekv_logger_never_the_root(restore_sparsekv_logger, capsys):
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    ours = logging.getLogger("sparsekv")
    assert main(["-v", "plan-memory", "--list-cases"]) == 0
    handlers = list(ours.handlers)
    assert ours.level == logging.INFO and handlers
    assert main(["-vv", "plan-memory", "--list-cases"]) == 0
    assert ours.level == logging.DEBUG and ours.handlers == handlers  # configured again, not stacked
    assert (root.level, list(root.handlers)) == before
    logging.getLogger("sparsekv.jit").info("a record")
    assert "sparsekv.jit INFO: a record" in capsys.readouterr().err


def test_sparsekv_log_level_reaches_library_users_with_cache_hits_at_debug(tmp_path):
    """A program that never configures logging still sees the JIT's records when SPARSEKV_LOG_LEVEL is
    set (a handler on the `sparsekv` logger, not on root); DEBUG shows cache hits."""
    probe = ("import logging, torch\n"
             "from sparsekv.jit_kernel.gather_rows import GATHER_ROWS\n"
             "GATHER_ROWS.module(index_dtype=torch.int64)\n"
             "logging.getLogger('other').info('not ours')\n"
             "print(len(logging.getLogger().handlers), len(logging.getLogger('sparsekv').handlers))\n")
    env = dict(os.environ, SPARSEKV_LOG_LEVEL="DEBUG")
    first = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    hit = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert hit.stdout.split() == ["0", "1"]
    assert re.search(r"sparsekv\.jit DEBUG: JIT: cache hit gather_rows__", hit.stderr), hit.stderr
    assert "not ours" not in hit.stderr
    quiet = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                           env={k: v for k, v in env.items() if k != "SPARSEKV_LOG_LEVEL"})
    assert quiet.stderr == "" and quiet.stdout.split() == ["0", "0"]

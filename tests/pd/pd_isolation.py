"""Running a test scenario in a child process inside a private network namespace.

Some engines' listeners bind every interface whatever host they are given (Mooncake's handshake
and data listeners bind ``0.0.0.0``; :attr:`~sparsekv.srt.disaggregation.engines.Engine.binds_every_interface`).
So a test that starts one runs it in a child process in a new network namespace that holds only
``lo`` (``unshare -n``, or ``unshare -rn`` without root) where the machine allows one, and directly
otherwise (all its traffic still goes to 127.0.0.1 either way).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CHILD_TIMEOUT_S = 150


@functools.cache
def netns_prefix() -> list[str]:
    """A command prefix that runs its command in a new network namespace with ``lo`` up; [] if none works."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return []
    for unshare in (["unshare", "-n"], ["unshare", "-rn"]):
        try:
            probe = subprocess.run([*unshare, "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", 'ip link set lo up && exec "$@"', "netns"]
    return []  # no namespace here: run directly (the engines still talk over 127.0.0.1 only)


# The file's folder leads sys.path, as under pytest: its imports of helper modules beside it resolve.
_RUNNER = ("import json, os, runpy, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); "
           "m = runpy.run_path(sys.argv[1]); print(json.dumps(m[sys.argv[2]](*json.loads(sys.argv[3])), default=str))")


def run_isolated(path: str, scenario: str, *args, engine_wait_s: int = 30) -> dict:
    """``scenario(*args)`` of the file ``path``, run in a child process (in a private network
    namespace where possible); its JSON result. Mooncake bounds its wait for a batch by
    ``MC_TRANSFER_TIMEOUT`` from the environment (no API sets it): ``engine_wait_s`` in the child."""
    argv = [sys.executable, "-c", _RUNNER, str(Path(path).resolve()), scenario, json.dumps(args)]
    done = subprocess.run([*netns_prefix(), *argv], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          env={**os.environ, "MC_TRANSFER_TIMEOUT": str(engine_wait_s)})
    assert done.returncode == 0, f"{scenario} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])

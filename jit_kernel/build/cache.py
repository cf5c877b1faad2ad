"""The on-disk artifact cache: safe lookup, locked build, atomic publish.

Layout under a cache root::

    <root>/<entry>/module.so      the artifact
    <root>/<entry>/key.json       every key input (no absolute path) + the artifact's size, mtime and sha256
    <root>/.index/                per-request stat signatures -> entry (the warm path's shortcut)
    <root>/.locks/<entry>.lock    serializes builders of one entry (readers never lock)
    <root>/.staging/<entry>.<host>.<pid>.<random>/
                                  private build directories, renamed into place when complete
    <root>/.trash/                entries being deleted (renamed here first, so removal is atomic)
    <root>/.toolchain/            compiler --version probes

A build killed mid-compile (SIGKILL, OOM) or a failed compile leaves its staging directory behind;
the next build in that root, ``sparsekv jit clean --stale`` and ``sparsekv jit prune`` remove every
leftover whose builder is gone (same host: its pid is dead and its entry lock is free; another
host sharing the cache: its entry lock is free and it is older than :data:`FOREIGN_STAGING_AGE_S`).

Rules: a root, entry or artifact that another user owns or can write is never loaded (a library
loaded from such a place runs someone else's code). An artifact whose size or hash disagrees with
its key.json, or that fails to load, is a miss and is rebuilt. A process uses one root only (see
:class:`CacheRoots`): a configured root we cannot write is still read, and a miss there is an error.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from sparsekv import env

logger = logging.getLogger("sparsekv.jit")

ARTIFACT = "module.so"
KEY_FILE = "key.json"


class CacheSecurityError(PermissionError):
    """A cache directory or file that another user could have written."""


class CacheUnwritableError(PermissionError):
    """The cache root (configured, or the default and then the private fallback) accepts no new modules."""


def check_private(path: Path, what: str, st: os.stat_result | None = None) -> None:
    """Refuse ``path`` unless it is owned by us (or root) and not writable by group or others
    (``st``: its stat, when the caller has it).

    Raises
    ------
    CacheSecurityError
        With the path, its owner and mode, and how to fix it.
    """
    st = os.stat(path) if st is None else st
    if st.st_uid not in (os.getuid(), 0):
        raise CacheSecurityError(
            f"sparsekv: refusing JIT {what} {path}: owned by uid {st.st_uid}, not by this user "
            f"(uid {os.getuid()}); set SPARSEKV_CACHE_DIR to a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheSecurityError(
            f"sparsekv: refusing JIT {what} {path}: writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod go-w {path}` or set SPARSEKV_CACHE_DIR to a private directory"
        )


def fallback_root() -> Path:
    """The private per-user root used when no root is configured and the default one is unusable."""
    return Path(tempfile.gettempdir()) / f"sparsekv-cache-{os.getuid()}"


def _ensure_private_dir(path: Path) -> bool:
    """Create ``path`` (mode 0700) if missing; True if it exists afterwards."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return path.is_dir()
    return True


def _writable(path: Path) -> bool:
    """True if we can create files in ``path`` (tried, not inferred from mode bits: root ignores
    them, and a read-only mount or immutable directory refuses even root)."""
    probe = os.path.join(path, f".probe.{os.getpid()}.{threading.get_ident()}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return False
    os.unlink(probe)
    return True


def _usable_default(path: Path) -> bool:
    """Whether the default root is, or can become, a directory we write to. Asked of the kernel
    (``access``: it knows read-only mounts and immutable directories, even for root), so the
    decision writes nothing."""
    if path.is_dir():
        return os.access(path, os.W_OK | os.X_OK)
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return not path.exists() and parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


class CacheRoots:
    """The one root artifacts are read from and written to.

    A configured root (``SPARSEKV_CACHE_DIR``) is the only root: a read-only one is still read, and a
    miss there raises :class:`CacheUnwritableError` instead of building elsewhere. Without one, the
    default (``$XDG_CACHE_HOME/sparsekv`` or ``~/.cache/sparsekv``) is the root, or, when it cannot
    be created or written, the private fallback ``$TMPDIR/sparsekv-cache-<uid>`` alone. So a process
    never loads a module that another cache published. Reading never writes: the warm path only
    stats and loads.

    Attributes
    ----------
    primary : Path
        The configured root, or the default one.
    configured : bool
        Whether ``primary`` was configured.
    """

    def __init__(self, primary: Path, *, configured: bool = True) -> None:
        if primary.exists() and not primary.is_dir():  # once: silently fell back to $TMPDIR
            if configured:
                raise CacheUnwritableError(f"sparsekv: SPARSEKV_CACHE_DIR={primary} is not a directory (a regular "
                                           "file is there); point it at a directory")
        self.primary = primary
        self.configured = configured
        if configured:
            _private_dir_or_absent(primary)  # refuse an unsafe configured root up front

    @functools.cached_property
    def root(self) -> Path:
        """The root this process uses (see the class docstring)."""
        if self.configured or _usable_default(self.primary):
            return self.primary
        return fallback_root()

    @property
    def read(self) -> tuple[Path, ...]:
        """The root, when it is an existing, private directory; else nothing."""
        return (self.root,) if _private_dir_or_absent(self.root) else ()

    @functools.cached_property
    def write(self) -> Path:
        """The root new artifacts are published to (created, mode 0700, on first use).

        Raises
        ------
        CacheUnwritableError
            The root cannot be created or written.
        """
        root = self.root
        if _ensure_private_dir(root):
            check_private(root, "cache directory")
            if _writable(root):
                if root != self.primary:
                    logger.info("JIT cache %s cannot be written; using %s", self.primary, root)
                return root
        if self.configured:
            raise CacheUnwritableError(
                f"sparsekv: cannot write a JIT module: the cache SPARSEKV_CACHE_DIR={root} is read-only (its modules "
                f"are still loaded); point SPARSEKV_CACHE_DIR at a writable directory of your own, or prebuild the "
                f"modules (`sparsekv jit build`) where the cache is writable"
            )
        raise CacheUnwritableError(
            f"sparsekv: cannot write a JIT module: neither the default cache {self.primary} nor the fallback "
            f"{fallback_root()} is writable by uid {os.getuid()}; set SPARSEKV_CACHE_DIR to a writable directory "
            f"of your own"
        )

    def probe_dir(self) -> Path | None:
        """Where compiler probes are cached: ``<write root>/.toolchain``; None when nothing is writable
        (a read-only deployment still loads its hits)."""
        try:
            return self.write / ".toolchain"
        except PermissionError:
            return None


def _private_dir_or_absent(root: Path) -> bool:
    """True for an existing private directory; False if absent. The configured root is refused
    loudly when unsafe; an unsafe fallback is merely skipped for reading (writing will refuse it)."""
    if not root.is_dir():
        return False
    try:
        check_private(root, "cache directory")
    except CacheSecurityError:
        if root == fallback_root():
            return False
        raise
    return True


def open_roots() -> CacheRoots:
    """Resolve the cache root from ``SPARSEKV_CACHE_DIR`` (or the default), checking its safety.

    Raises
    ------
    CacheSecurityError
        The configured root is owned by another user or writable by others.
    """
    configured = env.configured_cache_dir()
    if configured is not None:
        return CacheRoots(configured)
    return CacheRoots(env.cache_dir(), configured=False)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def valid_artifact(entry_dir: Path) -> Path | None:
    """The entry's artifact if it is complete, private and matches its key.json; else None.

    Size and mtime equal to the recorded ones prove the file untouched since it was published
    (cheap: a stat). A file with the recorded size but another mtime (a cache copied without
    preserving times, e.g. a prebuilt cache shipped to another machine) is checked by its sha256.
    That the artifact is the module of this entry (not another one copied into its place with its
    size and mtime) is checked after loading, by the entry name the module embeds.
    """
    found = read_entry(entry_dir)
    return None if found is None else found[0]


def read_entry(entry_dir: Path) -> tuple[Path, dict] | None:
    """:func:`valid_artifact`'s artifact and the entry's key document; None when not valid."""
    so = entry_dir / ARTIFACT
    try:
        doc = json.loads((entry_dir / KEY_FILE).read_text())
        recorded = doc["artifact"]
        check_private(entry_dir, "cache entry")
        st = os.stat(so)
        check_private(so, "artifact", st)
        if st.st_size != recorded["size"]:
            return None
        if st.st_mtime_ns != recorded["mtime_ns"] and _sha256(so) != recorded["sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return so, doc


def _lock_path(root: Path, entry: str) -> Path:
    return root / ".locks" / f"{entry}.lock"


def _open_locked(path: Path, blocking: bool):
    """Open and flock ``path``; None if ``blocking`` is False and someone holds it.

    A lock file may be unlinked by a cleaner (see :func:`sweep_leftovers`) between our open and
    our flock; a lock on the unlinked inode excludes nobody, so we retry until the inode we locked
    is the one the path names.
    """
    while True:
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.close()
            return None
        try:
            same = os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return handle
        handle.close()


#: A lock holder seen stopped, or gone while its lock stays held, this long (at most the lock
#: timeout) ends the wait: it will not finish the build.
STALLED_HOLDER_S = 10.0
#: Longest pause between two tries of a held lock.
LOCK_POLL_S = 0.25


class CacheLockTimeoutError(TimeoutError):
    """Another process held a module's build lock too long, or is stopped or gone while holding it.

    Attributes: ``pid`` (the holder's, or None when it did not record one) and ``lock`` (the lock file).
    """

    def __init__(self, message: str, *, pid: int | None, lock: Path) -> None:
        super().__init__(message)
        self.pid, self.lock = pid, lock


def _lock_holder(path: Path) -> tuple[int | None, str]:
    """``(pid, host)`` the holder wrote into the lock file; ``(None, "")`` when it wrote none."""
    try:
        pid, host = path.read_text().split()
        return int(pid), host
    except (OSError, ValueError):
        return None, ""


def _process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (R, S, D, T stopped, t traced, Z, ...); None when no such
    process; ``"?"`` where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else "?"
    except (OSError, IndexError):
        return "?"


def _wait_for_lock(path: Path, entry: str):
    """Take the build lock ``path``, waiting at most ``SPARSEKV_JIT_LOCK_TIMEOUT`` for its holder, and
    less (:data:`STALLED_HOLDER_S`) for a holder that is stopped or gone; then record our pid in it."""
    timeout = env.jit_lock_timeout()
    start = time.monotonic()
    stalled_since = None
    pause = 0.01
    while True:
        handle = _open_locked(path, blocking=False)
        if handle is not None:
            handle.truncate(0)  # opened for appending: the write lands at 0
            handle.write(f"{os.getpid()} {_host_tag()}\n")
            handle.flush()
            return handle
        now = time.monotonic()
        pid, host = _lock_holder(path)
        local = pid is not None and host == _host_tag()
        state = _process_state(pid) if local else "?"
        # A holder that has just taken the lock may not have written its pid yet: the previous
        # holder's is read meanwhile, so only a state that lasts counts.
        if state in (None, "Z", "T", "t"):
            stalled_since = now if stalled_since is None else stalled_since
        else:
            stalled_since = None
        waited = now - start
        # At the overall bound, a holder seen stopped or gone is named as such however briefly it was seen:
        # the stall's own clock starts after ours, so it could never win against a shorter timeout.
        if stalled_since is not None and (now - stalled_since >= min(STALLED_HOLDER_S, timeout) or waited >= timeout):
            why = (f"is stopped (state {state}: SIGSTOP, ^Z or a debugger); resume it (`kill -CONT {pid}`) or end it"
                   if state in ("T", "t") else
                   "has exited, but the lock is still held (by a process it started?); end that process")
            raise CacheLockTimeoutError(
                f"sparsekv: gave up after {waited:.1f} s waiting for the build lock of JIT module {entry}: its "
                f"holder, pid {pid}, {why}, then load again (lock file {path})", pid=pid, lock=path)
        if waited >= timeout:
            holder = f"pid {pid}" + ("" if local else f" on host {host}") if pid else "another process"
            raise CacheLockTimeoutError(
                f"sparsekv: gave up after {waited:.1f} s (SPARSEKV_JIT_LOCK_TIMEOUT) waiting for {holder} to finish "
                f"building JIT module {entry}; if it is stuck, end it and load again (lock file {path})",
                pid=pid, lock=path)
        time.sleep(min(pause, timeout - waited))
        pause = min(2 * pause, LOCK_POLL_S)


@contextmanager
def _build_lock(root: Path, entry: str):
    locks = root / ".locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    handle = _wait_for_lock(_lock_path(root, entry), entry)
    try:
        yield
    finally:
        handle.close()  # releases the flock


#: A staging directory of another host is removed only when its lock is free and it is this old.
FOREIGN_STAGING_AGE_S = 3600.0


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def staging_dir(root: Path, entry: str) -> Path:
    """A new private build directory for ``entry``, named so a sweep can tell when its builder is gone."""
    parent = root / ".staging"
    parent.mkdir(mode=0o700, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{entry}.{_host_tag()}.{os.getpid()}.", dir=parent))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: Marks a staging directory whose build failed (kept for the reproduce command, then swept).
FAILED_MARK = "FAILED"


def _abandoned(staging: Path, root: Path, now: float) -> bool:
    """Whether ``staging``'s builder is done with it (see the module docstring for the rule)."""
    if (staging / FAILED_MARK).exists():
        return True
    parts = staging.name.split(".")
    if len(parts) != 4 or not parts[2].isdigit():
        return now - staging.stat().st_mtime > FOREIGN_STAGING_AGE_S  # not ours to parse: only by age
    entry, host, pid = parts[0], parts[1], int(parts[2])
    if host == _host_tag():
        return not _pid_alive(pid)
    if now - staging.stat().st_mtime < FOREIGN_STAGING_AGE_S:
        return False
    handle = _open_locked(_lock_path(root, entry), blocking=False) if _lock_path(root, entry).exists() else None
    if handle is None:
        return not _lock_path(root, entry).exists()
    handle.close()
    return True


def sweep_leftovers(root: Path, *, dry_run: bool = False) -> list[Path]:
    """Remove staging directories and trash of builds that died, and lock files nobody holds.

    Returns
    -------
    list of Path
        What was (or, with ``dry_run``, would be) removed.
    """
    removed: list[Path] = []
    now = time.time()
    for sub in (".staging", ".trash"):
        parent = root / sub
        if not parent.is_dir():
            continue
        for child in sorted(parent.iterdir()):
            try:
                if sub == ".trash" or _abandoned(child, root, now):
                    removed.append(child)
                    if not dry_run:
                        shutil.rmtree(child, ignore_errors=True)
            except OSError:
                continue  # vanished under us: another cleaner got it
    locks = root / ".locks"
    if locks.is_dir():
        for lock in sorted(locks.glob("*.lock")):
            try:
                handle = _open_locked(lock, blocking=False)
                if handle is None:
                    continue
                # Unlink while holding it: a builder that opened the old inode re-opens (see _open_locked).
                removed.append(lock)
                if not dry_run:
                    lock.unlink()
                handle.close()
            except OSError:
                continue
    return removed


def _fsync_tree(path: Path) -> None:
    for child in path.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _discard(path: Path, root: Path) -> None:
    """Move a bad entry out of the way atomically, then delete it."""
    if not path.exists():
        return
    trash = root / ".trash"
    trash.mkdir(mode=0o700, exist_ok=True)
    target = trash / f"{path.name}.{uuid.uuid4().hex}"
    os.rename(path, target)
    shutil.rmtree(target, ignore_errors=True)


def build_and_publish(
    roots: CacheRoots, entry: str, key_doc: dict, build: Callable[[Path], Path], load: Callable[[Path], object]
):
    """Build ``entry`` under its lock unless another process already did, then load it.

    Parameters
    ----------
    roots : CacheRoots
        From :func:`open_roots`.
    entry : str
        Entry directory name.
    key_doc : dict
        Every key input; written as key.json with the artifact's size, mtime and sha256.
    build : callable
        ``build(staging_dir) -> path of the built .so`` inside ``staging_dir``.
    load : callable
        Loads an artifact path; an exception means the artifact is unusable.
    """
    root = roots.write
    final = root / entry
    with _build_lock(root, entry):
        so = valid_artifact(final)
        if so is not None:
            try:
                return load(so)
            except Exception:  # noqa: BLE001 - an unloadable artifact is a miss, rebuilt below
                logger.warning("JIT artifact %s does not load; rebuilding", so)
        _discard(final, root)
        sweep_leftovers(root)
        staging = staging_dir(root, entry)
        # A failed compile keeps its staging directory, so the reproduce command in the error works;
        # the next build or `sparsekv jit clean --stale` sweeps it.
        try:
            built = build(staging)
        except BaseException:
            (staging / FAILED_MARK).touch()
            raise
        if built.name != ARTIFACT:
            os.replace(built, staging / ARTIFACT)
        artifact = staging / ARTIFACT
        st = artifact.stat()
        doc = dict(key_doc, artifact={"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _sha256(artifact)})
        (staging / KEY_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True))
        _fsync_tree(staging)
        try:
            os.rename(staging, final)  # atomic publish; the lock makes us the only writer
        except OSError:
            # Another publisher won (flock does not span every NFS setup). Its entry may not be
            # visible here yet, so load our own complete copy rather than waiting for it; the copy
            # stays in .staging (our pid is alive) until a sweep after this process exits.
            logger.info("JIT entry %s was published by another process; using this process's build", entry)
            return load(staging / ARTIFACT)
    cap = env.cache_max_size()
    if cap is not None:
        prune(root, max_bytes=cap, keep=(final,))
    return load(final / ARTIFACT)


def entries(root: Path) -> list[Path]:
    """Published entry directories under ``root``."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / KEY_FILE).exists())


def mark_used(entry_dir: Path) -> None:
    """Record a load of ``entry_dir`` (its directory mtime), for least-recently-loaded pruning.

    Once per module and process; a read-only root keeps its publish time.
    """
    try:
        os.utime(entry_dir)
    except OSError:
        pass


def entry_bytes(entry_dir: Path) -> int:
    """Bytes of the files of one entry."""
    return sum(p.stat().st_size for p in entry_dir.iterdir() if p.is_file())


def verify_entry(entry_dir: Path) -> str | None:
    """Check one entry in full (unlike the warm path, the sha256 is always computed).

    Returns
    -------
    str or None
        What is wrong with the entry, or None when its artifact matches its key.json.
    """
    so = entry_dir / ARTIFACT
    try:
        recorded = json.loads((entry_dir / KEY_FILE).read_text())["artifact"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {KEY_FILE} ({exc})"
    try:
        check_private(entry_dir, "cache entry")
        check_private(so, "artifact")
    except CacheSecurityError as exc:
        return str(exc).removeprefix("sparsekv: ")
    except OSError as exc:
        return f"missing {ARTIFACT} ({exc.strerror})"
    size = so.stat().st_size
    if size != recorded.get("size"):
        return f"{ARTIFACT} has {size} bytes, key.json records {recorded.get('size')}"
    digest = _sha256(so)
    if digest != recorded.get("sha256"):
        return f"{ARTIFACT} sha256 {digest[:16]}... differs from key.json's {str(recorded.get('sha256'))[:16]}..."
    return None


def discard(entry_dir: Path) -> None:
    """Delete an entry atomically (renamed into ``.trash`` first, so no reader sees half of it)."""
    _discard(entry_dir, entry_dir.parent)


def prune(root: Path, *, older_than_s: float | None = None, max_bytes: int | None = None,
          keep: tuple[Path, ...] = (), dry_run: bool = False) -> list[Path]:
    """Remove entries not loaded for ``older_than_s``, then the least recently loaded ones until the
    root holds at most ``max_bytes``; also sweeps leftovers of dead builds.

    Returns
    -------
    list of Path
        The entries removed (or, with ``dry_run``, that would be).
    """
    now = time.time()
    found = []
    for entry_dir in entries(root):
        try:
            found.append((entry_dir.stat().st_mtime, entry_bytes(entry_dir), entry_dir))
        except OSError:
            continue
    found.sort()  # least recently loaded first
    doomed = []
    total = sum(size for _, size, _ in found)
    for used, size, entry_dir in found:
        if entry_dir in keep:
            continue
        too_old = older_than_s is not None and now - used > older_than_s
        too_big = max_bytes is not None and total > max_bytes
        if too_old or too_big:
            doomed.append(entry_dir)
            total -= size
    if not dry_run:
        for entry_dir in doomed:
            try:
                _discard(entry_dir, root)
            except OSError:
                continue  # removed by another process meanwhile
        sweep_leftovers(root)
    return doomed

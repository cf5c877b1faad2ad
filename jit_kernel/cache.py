"""The on-disk artifact cache: safe lookup, locked build, atomic publish.

Layout under a cache root::

    <root>/<entry>/module.so      the artifact
    <root>/<entry>/key.json       every key input (no absolute path) + the artifact's size, mtime and sha256
    <root>/.index/                per-request stat signatures -> entry (the warm path's shortcut)
    <root>/.locks/<entry>.lock    serializes builders of one entry (readers never lock)
    <root>/.staging/              private build directories, renamed into place when complete
    <root>/.toolchain/            compiler --version probes

Rules: a root, entry or artifact that another user owns or can write is never loaded (a library
loaded from such a place runs someone else's code). An artifact whose size or hash disagrees with
its key.json, or that fails to load, is a miss and is rebuilt. A root we cannot write is still read;
new artifacts then go to a private fallback root.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
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


def check_private(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is owned by us (or root) and not writable by group or others.

    Raises
    ------
    CacheSecurityError
        With the path, its owner and mode, and how to fix it.
    """
    st = os.stat(path)
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
    """The private per-user root used when the configured one is read-only."""
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


class CacheRoots:
    """Where artifacts are read from and written to.

    Reading never writes: the warm path only stats and loads. The write root is chosen at the
    first miss: the configured root if we can create files in it, else the private fallback.

    Attributes
    ----------
    primary : Path
        The configured root (``SPARSEKV_CACHE_DIR``).
    """

    def __init__(self, primary: Path) -> None:
        self.primary = primary
        _private_dir_or_absent(primary)  # refuse an unsafe configured root up front

    @property
    def read(self) -> tuple[Path, ...]:
        """Existing, private roots searched for an artifact, in order."""
        return tuple(root for root in (self.primary, fallback_root()) if _private_dir_or_absent(root))

    @functools.cached_property
    def write(self) -> Path:
        """The root new artifacts are published to (created, mode 0700, on first use)."""
        if _ensure_private_dir(self.primary):
            check_private(self.primary, "cache directory")
            if _writable(self.primary):
                return self.primary
        fallback = fallback_root()
        if not _ensure_private_dir(fallback):
            raise CacheSecurityError(f"sparsekv: cannot create a private JIT cache at {fallback}")
        check_private(fallback, "fallback cache directory")
        logger.info("JIT cache %s is not writable; new modules go to %s", self.primary, fallback)
        return fallback


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
    """Resolve the cache roots from ``SPARSEKV_CACHE_DIR``, checking their safety.

    Raises
    ------
    CacheSecurityError
        The configured root is owned by another user or writable by others.
    """
    return CacheRoots(env.cache_dir())


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
    """
    so = entry_dir / ARTIFACT
    try:
        recorded = json.loads((entry_dir / KEY_FILE).read_text())["artifact"]
        check_private(entry_dir, "cache entry")
        check_private(so, "artifact")
        st = so.stat()
        if st.st_size != recorded["size"]:
            return None
        if st.st_mtime_ns != recorded["mtime_ns"] and _sha256(so) != recorded["sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return so


@contextmanager
def _build_lock(root: Path, entry: str):
    locks = root / ".locks"
    locks.mkdir(mode=0o700, exist_ok=True)
    with open(locks / f"{entry}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
        staging_parent = root / ".staging"
        staging_parent.mkdir(mode=0o700, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{entry}.", dir=staging_parent))
        built = build(staging)
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
            # Another publisher won (flock does not span NFS clients). Its entry may not be visible
            # here yet, so load our own complete copy rather than waiting for it.
            logger.info("JIT entry %s was published by another process; using this process's build", entry)
            return load(staging / ARTIFACT)
        return load(final / ARTIFACT)


def entries(root: Path) -> list[Path]:
    """Published entry directories under ``root``."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / KEY_FILE).exists())

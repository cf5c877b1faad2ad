"""Bundles: built modules in one tar file, for container images and air-gapped sites.

``sparsekv jit export FILE.tar`` writes ``sparsekv-bundle.json`` (format, platform, the sha256 and
size of every artifact) followed by ``<entry>/key.json`` and ``<entry>/module.so`` of each entry.
``sparsekv jit import FILE.tar`` refuses, with the reason, a bundle whose platform or tvm-ffi
version differs from this machine's, a member it does not expect, an entry whose name is not the
hash of its key.json, and an artifact whose bytes do not match the recorded sha256, reading the
bundle as a bounded stream (see :func:`read_bundle`); the rest is published atomically into the
cache, where a ``SPARSEKV_JIT_STRICT=1`` process loads it without any compiler installed.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import json
import lzma
import os
import platform
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable
from pathlib import Path

import tvm_ffi

from sparsekv.jit_kernel.build import cache, loader

MANIFEST = "sparsekv-bundle.json"
BUNDLE_FORMAT = 1
#: What an import reads at most, decompressed (a bundle of every DSV4 module for two archs is a few
#: hundred MiB): the members' declared sizes are checked before they are read, and the stream stops
#: there whatever the headers say.
MAX_BUNDLE_BYTES = 4 << 30
MAX_BUNDLE_MEMBERS = 20_000


class BundleError(RuntimeError):
    """A bundle that cannot be written or must not be imported (the message says why)."""


def platform_tag() -> dict:
    """What a module binary depends on besides its key: OS, CPU architecture, tvm-ffi ABI, loader format."""
    return {"system": platform.system(), "machine": platform.machine(), "tvm_ffi": tvm_ffi.__version__,
            "loader_format": loader.LOADER_FORMAT}


def export_bundle(path: Path, entry_dirs: list[Path]) -> dict:
    """Write ``entry_dirs`` (each checked in full first) to the tar file ``path``; returns the manifest.

    Raises
    ------
    BundleError
        An entry fails :func:`sparsekv.jit_kernel.build.cache.verify_entry`, or there is nothing to export.
    """
    if not entry_dirs:
        raise BundleError("sparsekv: nothing to export: no matching module is built (run `sparsekv jit build`)")
    manifest = {"format": BUNDLE_FORMAT, "platform": platform_tag(), "entries": {}}
    for entry_dir in entry_dirs:
        problem = cache.verify_entry(entry_dir)
        if problem:
            raise BundleError(f"sparsekv: cannot export {entry_dir.name}: {problem}; "
                              f"run `sparsekv jit verify --repair`")
        key = json.loads((entry_dir / cache.KEY_FILE).read_text())
        manifest["entries"][entry_dir.name] = dict(key["artifact"], name=key["name"], args=key["template_args"],
                                                   backend=key["backend"], archs=key["archs"])
    tmp = Path(f"{path}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w") as tar:
        data = json.dumps(manifest, indent=2, sort_keys=True).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
        for entry_dir in entry_dirs:
            for name in (cache.KEY_FILE, cache.ARTIFACT):
                tar.add(entry_dir / name, arcname=f"{entry_dir.name}/{name}", recursive=False)
    os.replace(tmp, path)
    return manifest


#: Largest manifest and key.json an import reads.
MAX_DOCUMENT_BYTES = 16 << 20
#: The block an import reads, hashes and writes at a time (an artifact is never held whole).
CHUNK = 1 << 20
_COMPRESSED = ((b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f, mode="rb")), (b"BZh", bz2.BZ2File),
               (b"\xfd7zXZ\x00", lzma.LZMAFile))
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


class _BoundedReader:
    """A stream that refuses to deliver more than ``limit`` bytes (what a decompressor inflates)."""

    def __init__(self, stream, limit: int, path: Path) -> None:
        self.stream, self.limit, self.path, self.delivered = stream, limit, path, 0

    def read(self, size: int = -1) -> bytes:
        room = self.limit + 1 - self.delivered  # one past the limit: reaching it is the refusal
        data = self.stream.read(room if size is None or size < 0 else min(size, room))
        self.delivered += len(data)
        if self.delivered > self.limit:
            raise BundleError(f"sparsekv: refusing bundle {self.path}: it holds more than {_mib(self.limit)} "
                              f"(decompressed)")
        return data


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _open_regular(path: Path):
    """``path`` opened for reading if it is a regular file (a device, FIFO or directory is refused
    before anything is read: ``/dev/zero`` would never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait for a writer
    except OSError as exc:
        raise BundleError(f"sparsekv: {path} is not a readable bundle ({exc.strerror})") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise BundleError(f"sparsekv: refusing bundle {path}: it is {kind}, not a regular file "
                          f"(a tar file as `sparsekv jit export` writes)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _decompressed(raw, path: Path, max_bytes: int) -> _BoundedReader:
    """The tar stream of ``raw`` (plain, gzip, bzip2 or xz), bounded to ``max_bytes``."""
    head = raw.peek(6)[:6]
    for magic, opener in _COMPRESSED:
        if head.startswith(magic):
            return _BoundedReader(opener(raw), max_bytes, path)
    return _BoundedReader(raw, max_bytes, path)


def _check_manifest(path: Path, data: bytes) -> dict:
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise BundleError(f"sparsekv: refusing bundle {path}: no readable {MANIFEST}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("entries"), dict) or \
            not isinstance(manifest.get("platform", {}), dict):
        raise BundleError(f"sparsekv: refusing bundle {path}: {MANIFEST} is not a manifest object")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"sparsekv: refusing bundle {path}: format {manifest.get('format')!r}, "
                          f"this sparsekv reads format {BUNDLE_FORMAT}")
    here = platform_tag()
    for field, value in manifest.get("platform", {}).items():
        if here.get(field) != value:
            raise BundleError(f"sparsekv: refusing bundle {path}: built for {field} {value!r}, this machine has "
                              f"{here.get(field)!r}")
    for entry, recorded in manifest["entries"].items():
        if not isinstance(recorded, dict) or not isinstance(recorded.get("size"), int) or \
                isinstance(recorded.get("size"), bool) or not isinstance(recorded.get("sha256"), str):
            raise BundleError(f"sparsekv: refusing bundle {path}: entry {entry}'s manifest record is not an object "
                              f"with an integer size and a sha256")
    return manifest


def _stream_to(source, size: int, target: Path | None) -> str:
    """Copy ``size`` bytes of ``source`` to ``target`` (or nowhere) by :data:`CHUNK`; their sha256."""
    digest = hashlib.sha256()
    out = open(target, "xb") if target is not None else None
    try:
        left = size
        while left:
            block = source.read(min(CHUNK, left))
            if not block:
                break
            digest.update(block)
            if out is not None:
                out.write(block)
            left -= len(block)
    finally:
        if out is not None:
            out.close()
    return digest.hexdigest()


def read_bundle(path: Path, stage: Callable[[], Path] | None = None, *,
                max_bytes: int | None = None) -> tuple[dict, dict[str, bytes]]:
    """Read and check a bundle as a stream: the manifest first, then each entry's files.

    Nothing is held whole: each artifact is hashed (and, with ``stage``, written to
    ``stage()/<entry>/module.so``) a block at a time. Every member is checked against the manifest
    (name, declared size) before it is read, and the whole stream is bounded by ``max_bytes`` after
    decompression, so a compressed bomb or a huge member is refused having read at most that much.

    Parameters
    ----------
    path : Path
        A regular file: a tar (optionally gzip, bzip2 or xz compressed) as ``sparsekv jit export`` writes.
    stage : callable, optional
        Returns the directory to write the artifacts into (called once, at the first artifact).
    max_bytes : int, optional
        Most bytes the tar stream may hold, decompressed; default :data:`MAX_BUNDLE_BYTES`.

    Returns
    -------
    (manifest, keys) : tuple of dict
        The manifest and ``{entry: key.json bytes}``, every check of the module docstring done.

    Raises
    ------
    BundleError
        With the first reason the bundle is refused.
    """
    limit = MAX_BUNDLE_BYTES if max_bytes is None else max_bytes
    manifest: dict | None = None
    keys: dict[str, bytes] = {}
    digests: dict[str, str] = {}
    staged: Path | None = None
    with _open_regular(path) as raw:
        try:
            stream = _decompressed(raw, path, limit)
            tar = tarfile.open(fileobj=stream, mode="r|")
        except (OSError, EOFError, tarfile.TarError) as exc:
            reason = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__
            raise BundleError(f"sparsekv: {path} is not a readable bundle (a tar file as `sparsekv jit export` "
                              f"writes: {reason})") from exc
        declared = 0
        try:
            with tar:
                for count, member in enumerate(tar):
                    if not member.isfile():
                        raise BundleError(f"sparsekv: refusing bundle {path}: member {member.name!r} is not a "
                                          f"regular file")
                    declared += member.size  # checked before reading: a huge member is refused unread
                    if declared > limit or count >= MAX_BUNDLE_MEMBERS:
                        raise BundleError(f"sparsekv: refusing bundle {path}: more than {_mib(limit)} or "
                                          f"{MAX_BUNDLE_MEMBERS} members")
                    if manifest is None:
                        if member.name != MANIFEST or member.size > MAX_DOCUMENT_BYTES:
                            raise BundleError(f"sparsekv: refusing bundle {path}: no readable {MANIFEST} (it must "
                                              f"be the first member, at most {_mib(MAX_DOCUMENT_BYTES)})")
                        manifest = _check_manifest(path, tar.extractfile(member).read(member.size))
                        continue
                    entry, _, name = member.name.partition("/")
                    recorded = manifest["entries"].get(entry)
                    if recorded is None or name not in (cache.KEY_FILE, cache.ARTIFACT) or \
                            (name == cache.KEY_FILE and entry in keys) or (name == cache.ARTIFACT and entry in digests):
                        raise BundleError(f"sparsekv: refusing bundle {path}: unexpected member {member.name!r}")
                    source = tar.extractfile(member)
                    if name == cache.KEY_FILE:
                        if member.size > MAX_DOCUMENT_BYTES:
                            raise BundleError(f"sparsekv: refusing bundle {path}: {member.name} declares "
                                              f"{member.size} bytes")
                        keys[entry] = source.read(member.size)
                        continue
                    if member.size != recorded["size"]:
                        raise BundleError(f"sparsekv: refusing bundle {path}: {member.name} declares {member.size} "
                                          f"bytes, the manifest records {recorded['size']}")
                    target = None
                    if stage is not None:
                        staged = stage() if staged is None else staged
                        (staged / entry).mkdir(mode=0o700)
                        target = staged / entry / cache.ARTIFACT
                    digests[entry] = _stream_to(source, member.size, target)
        except (OSError, EOFError, tarfile.TarError, zlib.error, lzma.LZMAError) as exc:
            raise BundleError(f"sparsekv: refusing bundle {path}: damaged tar ({exc})") from exc
    if manifest is None:
        raise BundleError(f"sparsekv: refusing bundle {path}: no readable {MANIFEST}")
    here = platform_tag()
    for entry, recorded in manifest["entries"].items():
        try:
            key = json.loads(keys[entry])
            digest = digests[entry]
            if not isinstance(key, dict) or not isinstance(key.get("artifact"), dict):
                raise ValueError(f"{cache.KEY_FILE} is not an object with an artifact record")
        except (KeyError, ValueError) as exc:
            raise BundleError(f"sparsekv: refusing bundle {path}: entry {entry} is incomplete ({exc})") from exc
        try:
            named = loader.entry_name(key)
        except (KeyError, TypeError, AttributeError):
            named = None
        if named != entry:
            raise BundleError(f"sparsekv: refusing bundle {path}: entry {entry}'s key.json does not hash to its name")
        if digest != recorded["sha256"] or digest != key["artifact"].get("sha256"):
            raise BundleError(f"sparsekv: refusing bundle {path}: {entry}/{cache.ARTIFACT} has sha256 "
                              f"{digest[:16]}..., recorded {recorded['sha256'][:16]}... (corrupted or tampered with)")
        if key.get("tvm_ffi") != here["tvm_ffi"] or key.get("loader_format") != here["loader_format"]:
            raise BundleError(f"sparsekv: refusing bundle {path}: {entry} was built for tvm-ffi {key.get('tvm_ffi')}, "
                              f"this machine has {here['tvm_ffi']}")
    return manifest, keys


def import_bundle(path: Path, root: Path, *, max_bytes: int | None = None) -> tuple[list[str], list[str]]:
    """Verify ``path`` and publish its entries into the cache ``root``.

    The artifacts are streamed into a staging directory of ``root`` and published only when the whole
    bundle checks out (see :func:`read_bundle`; ``max_bytes`` bounds it).

    Returns
    -------
    (imported, present) : tuple of list of str
        Entries published, and entries already valid in ``root`` (left as they are).

    Raises
    ------
    BundleError
        The bundle is refused (nothing is published).
    """
    staging: list[Path] = []

    def stage() -> Path:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        staging.append(cache.staging_dir(root, "bundle-import"))
        return staging[0]

    try:
        _, keys = read_bundle(path, stage, max_bytes=max_bytes)
        imported, present = [], []
        for entry, key_bytes in keys.items():
            final = root / entry
            if cache.valid_artifact(final) is not None:
                present.append(entry)
                continue
            entry_dir = staging[0] / entry
            so = entry_dir / cache.ARTIFACT
            os.chmod(so, 0o755)
            key = json.loads(key_bytes)
            key["artifact"]["mtime_ns"] = so.stat().st_mtime_ns  # this copy's time: warm loads stay a stat
            (entry_dir / cache.KEY_FILE).write_text(json.dumps(key, indent=2, sort_keys=True))
            if final.exists():
                cache.discard(final)
            os.rename(entry_dir, final)
            imported.append(entry)
    finally:
        for directory in staging:
            shutil.rmtree(directory, ignore_errors=True)
    return imported, present

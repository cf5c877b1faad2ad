"""Bundles: built modules in one tar file, for container images and air-gapped sites.

``sparsekv jit export FILE.tar`` writes ``sparsekv-bundle.json`` (format, platform, the sha256 and
size of every artifact) followed by ``<entry>/key.json`` and ``<entry>/module.so`` of each entry.
``sparsekv jit import FILE.tar`` refuses, with the reason, a bundle whose platform or tvm-ffi
version differs from this machine's, a member it does not expect, an entry whose name is not the
hash of its key.json, and an artifact whose bytes do not match the recorded sha256; the rest is
published atomically into the cache, where a ``SPARSEKV_JIT_STRICT=1`` process loads it without
any compiler installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
from pathlib import Path

import tvm_ffi

from sparsekv.jit_kernel.build import cache, loader

MANIFEST = "sparsekv-bundle.json"
BUNDLE_FORMAT = 1
#: What an import reads at most, by the members' declared sizes (a bundle of every DSV4 module for
#: two archs is a few hundred MiB): a compressed bomb is refused before it is inflated.
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bundle(path: Path) -> tuple[dict, dict[str, dict[str, bytes]]]:
    """The manifest and ``{entry: {file: bytes}}`` of a bundle, every check of the module docstring done.

    Raises
    ------
    BundleError
        With the first reason the bundle is refused.
    """
    try:
        tar = tarfile.open(path, "r")
    except (OSError, tarfile.TarError) as exc:
        reason = str(exc).splitlines()[0].rstrip(":") if str(exc) else type(exc).__name__
        raise BundleError(f"sparsekv: {path} is not a readable bundle (a tar file as `sparsekv jit export` writes: "
                          f"{reason})") from exc
    files: dict[str, bytes] = {}
    total = 0
    with tar:
        try:
            for member in tar:
                if not member.isfile():
                    raise BundleError(f"sparsekv: refusing bundle {path}: member {member.name!r} is not a regular file")
                total += member.size  # declared sizes, checked before reading (a gzip bomb is refused unread)
                if total > MAX_BUNDLE_BYTES or len(files) >= MAX_BUNDLE_MEMBERS:
                    raise BundleError(f"sparsekv: refusing bundle {path}: more than {MAX_BUNDLE_BYTES >> 20} MiB or "
                                      f"{MAX_BUNDLE_MEMBERS} members")
                files[member.name] = tar.extractfile(member).read(member.size)
        except (OSError, tarfile.TarError) as exc:
            raise BundleError(f"sparsekv: refusing bundle {path}: damaged tar ({exc})") from exc
    try:
        manifest = json.loads(files.pop(MANIFEST))
    except (KeyError, ValueError) as exc:
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
    entries: dict[str, dict[str, bytes]] = {}
    expected = {f"{e}/{n}" for e in manifest["entries"] for n in (cache.KEY_FILE, cache.ARTIFACT)}
    for name in files:
        if name not in expected:
            raise BundleError(f"sparsekv: refusing bundle {path}: unexpected member {name!r}")
    for entry, recorded in manifest["entries"].items():
        try:
            key_bytes, so = files[f"{entry}/{cache.KEY_FILE}"], files[f"{entry}/{cache.ARTIFACT}"]
            key = json.loads(key_bytes)
            if not isinstance(key, dict) or not isinstance(key.get("artifact"), dict) or \
                    not isinstance(recorded, dict):
                raise ValueError(f"{cache.KEY_FILE} or its manifest record is not an object")
        except (KeyError, ValueError) as exc:
            raise BundleError(f"sparsekv: refusing bundle {path}: entry {entry} is incomplete ({exc})") from exc
        if loader.entry_name(key) != entry:
            raise BundleError(f"sparsekv: refusing bundle {path}: entry {entry}'s key.json does not hash to its name")
        digest = _sha256(so)
        if digest != recorded["sha256"] or digest != key["artifact"]["sha256"] or len(so) != recorded["size"]:
            raise BundleError(f"sparsekv: refusing bundle {path}: {entry}/{cache.ARTIFACT} has sha256 "
                              f"{digest[:16]}..., recorded {recorded['sha256'][:16]}... (corrupted or tampered with)")
        if key.get("tvm_ffi") != here["tvm_ffi"] or key.get("loader_format") != here["loader_format"]:
            raise BundleError(f"sparsekv: refusing bundle {path}: {entry} was built for tvm-ffi {key.get('tvm_ffi')}, "
                              f"this machine has {here['tvm_ffi']}")
        entries[entry] = {cache.KEY_FILE: key_bytes, cache.ARTIFACT: so}
    return manifest, entries


def import_bundle(path: Path, root: Path) -> tuple[list[str], list[str]]:
    """Verify ``path`` and publish its entries into the cache ``root``.

    Returns
    -------
    (imported, present) : tuple of list of str
        Entries published, and entries already valid in ``root`` (left as they are).

    Raises
    ------
    BundleError
        The bundle is refused (nothing is published).
    """
    _, entries = read_bundle(path)
    imported, present = [], []
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for entry, files in entries.items():
        final = root / entry
        if cache.valid_artifact(final) is not None:
            present.append(entry)
            continue
        staging = cache.staging_dir(root, entry)
        try:
            so = staging / cache.ARTIFACT
            so.write_bytes(files[cache.ARTIFACT])
            os.chmod(so, 0o755)
            key = json.loads(files[cache.KEY_FILE])
            st = so.stat()
            key["artifact"]["mtime_ns"] = st.st_mtime_ns  # this copy's time: warm loads stay a stat
            (staging / cache.KEY_FILE).write_text(json.dumps(key, indent=2, sort_keys=True))
            if final.exists():
                cache.discard(final)
            os.rename(staging, final)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        imported.append(entry)
    return imported, present

"""Bundles: export -> empty cache -> import -> a strict-mode process with no compiler loads and runs the
modules; a bundle changed by one byte, built for another platform or carrying stray members is refused."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from sparsekv.jit_kernel.build import bundle, cache

RUN_GATHER = """
import torch
from sparsekv.jit_kernel.gather_rows import gather_rows
src = torch.arange(60, dtype=torch.uint8).reshape(6, 10)
dst = torch.zeros(6, 10, dtype=torch.uint8)
gather_rows(dst, torch.tensor([0, 1, 2]), src, torch.tensor([5, 3, 1]))
assert torch.equal(dst[:3], src[[5, 3, 1]]) and not dst[3:].any()
print("OK")
"""


def jit(*args: str, cache_dir: Path, **extra_env) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPARSEKV_CACHE_DIR=str(cache_dir), **extra_env)
    return subprocess.run([sys.executable, "-m", "sparsekv", "jit", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    build_cache = tmp_path_factory.mktemp("build") / "cache"
    spec = "gather_rows:index_dtype=int64"
    assert jit("build", "--instance", spec, cache_dir=build_cache).returncode == 0
    path = tmp_path_factory.mktemp("bundle") / "kernels.tar"
    done = jit("export", str(path), "--instance", spec, cache_dir=build_cache)
    assert done.returncode == 0 and "exported 1 modules" in done.stdout, done.stderr
    return path


def test_import_then_strict_load_without_any_compiler(exported, tmp_path):
    target = tmp_path / "cache"
    done = jit("import", str(exported), cache_dir=target)
    assert done.returncode == 0 and "imported 1 modules" in done.stdout, done.stderr
    (entry,) = cache.entries(target)
    assert cache.verify_entry(entry) is None
    assert jit("import", str(exported), cache_dir=target).stdout.startswith("imported 0 modules")  # idempotent

    no_compiler = {"SPARSEKV_CACHE_DIR": str(target), "SPARSEKV_JIT_STRICT": "1", "SPARSEKV_CXX": "no-such-c++",
                   "CXX": "", "PATH": str(tmp_path / "empty-bin")}
    env = dict(os.environ, **no_compiler)
    run = subprocess.run([sys.executable, "-c", RUN_GATHER], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stderr[-3000:]
    # Nothing else is served that way: a module the bundle lacks is a strict-mode miss naming it.
    other = RUN_GATHER.replace("torch.tensor([0, 1, 2])", "torch.tensor([0, 1, 2], dtype=torch.int32)").replace(
        "torch.tensor([5, 3, 1])", "torch.tensor([5, 3, 1], dtype=torch.int32)")
    miss = subprocess.run([sys.executable, "-c", other], capture_output=True, text=True, env=env, timeout=300)
    assert miss.returncode != 0 and "gather_rows<int32_t> (cpu) is not in the cache" in miss.stderr


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy a tar member by member, letting ``edit(name, data)`` change (or drop, with None) each one."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for member in tin:
            data = edit(member.name, tin.extractfile(member).read())
            if data is not None:
                member.size = len(data)
                tout.addfile(member, io.BytesIO(data))


def _flip_artifact_byte(name: str, data: bytes) -> bytes:
    if name.endswith(cache.ARTIFACT):
        data = bytearray(data)
        data[len(data) // 2] ^= 0x01
    return bytes(data)


def test_one_changed_byte_is_refused_and_nothing_is_published(exported, tmp_path):
    raw = bytearray(exported.read_bytes())
    with tarfile.open(exported) as tar:
        member = next(m for m in tar if m.name.endswith(cache.ARTIFACT))
    raw[member.offset_data + member.size // 2] ^= 0x01  # one byte of the library, in place
    tampered = tmp_path / "tampered.tar"
    tampered.write_bytes(bytes(raw))
    target = tmp_path / "cache"
    done = jit("import", str(tampered), cache_dir=target)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "tampered" in done.stderr and "sha256" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert cache.entries(target) == []


@pytest.mark.parametrize("change", ["platform", "key", "stray member", "path traversal", "missing file"])
def test_refused_bundles_say_why(exported, tmp_path, change):
    bad = tmp_path / "bad.tar"

    def edit(name: str, data: bytes):
        if change == "platform" and name == bundle.MANIFEST:
            manifest = json.loads(data)
            manifest["platform"]["tvm_ffi"] = "0.0.1"
            return json.dumps(manifest).encode()
        if change == "key" and name.endswith(cache.KEY_FILE):
            key = json.loads(data)
            key["extra_cflags"] = ["-DOTHER"]
            return json.dumps(key).encode()
        if change == "missing file" and name.endswith(cache.KEY_FILE):
            return None
        return data

    _rewrite(exported, bad, edit)
    if change in ("stray member", "path traversal"):
        with tarfile.open(bad, "a") as tar:
            info = tarfile.TarInfo("extra.sh" if change == "stray member" else "../../escape.so")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    expected = {"platform": "built for tvm_ffi '0.0.1'", "key": "does not hash to its name",
                "stray member": "unexpected member 'extra.sh'", "path traversal": "unexpected member '../../escape.so'",
                "missing file": "incomplete"}[change]
    with pytest.raises(bundle.BundleError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        bundle.import_bundle(bad, tmp_path / "cache")
    assert not (tmp_path / "escape.so").exists() and cache.entries(tmp_path / "cache") == []


def test_export_refuses_a_corrupted_entry(tmp_path):
    cache_dir = tmp_path / "cache"
    assert jit("build", "--instance", "gather_rows:index_dtype=int32", cache_dir=cache_dir).returncode == 0
    (entry,) = cache.entries(cache_dir)
    data = bytearray((entry / cache.ARTIFACT).read_bytes())
    data[100] ^= 0xFF
    (entry / cache.ARTIFACT).write_bytes(bytes(data))
    done = jit("export", str(tmp_path / "out.tar"), "--all", cache_dir=cache_dir)
    assert done.returncode == 1 and "jit verify --repair" in done.stderr and not (tmp_path / "out.tar").exists()


def _tar(path: Path, members: dict[str, bytes], mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("members, reason", [
    ({bundle.MANIFEST: b"[1, 2]"}, "not a manifest object"),  # once: AttributeError
    ({bundle.MANIFEST: json.dumps({"format": bundle.BUNDLE_FORMAT, "platform": {},
                                   "entries": {"e": {"sha256": "0", "size": 1}}}).encode(),
      f"e/{cache.KEY_FILE}": b"[1]", f"e/{cache.ARTIFACT}": b"x"}, "is not an object"),
], ids=["manifest list", "key.json list"])
def test_json_that_is_not_an_object_is_refused_naming_it(tmp_path, members, reason):
    with pytest.raises(bundle.BundleError, match=reason):
        bundle.read_bundle(_tar(tmp_path / "b.tar", members))


def _manifest(entries: dict) -> bytes:
    return json.dumps({"format": bundle.BUNDLE_FORMAT, "platform": bundle.platform_tag(), "entries": entries}).encode()


def test_a_compressed_bomb_is_refused_before_it_is_inflated(tmp_path):
    # A member that declares 64 MiB of zeros, a few KiB on disk: refused by its declared size, unread.
    members = {bundle.MANIFEST: _manifest({"e": {"sha256": "0" * 64, "size": 64 << 20}}),
               f"e/{cache.ARTIFACT}": bytes(64 << 20)}
    path = _tar(tmp_path / "bomb.tar.gz", members, mode="w:gz")
    assert path.stat().st_size < 256 << 10
    with pytest.raises(bundle.BundleError, match="more than 1 MiB or 20000 members"):
        bundle.import_bundle(path, tmp_path / "cache", max_bytes=1 << 20)
    assert not (tmp_path / "cache").exists()


def test_a_header_bomb_is_refused_by_the_decompressed_bound(tmp_path):
    # tarfile reads a pax header whole, whatever its size: the stream itself stops at the bound.
    path = tmp_path / "pax-bomb.tar.xz"
    with tarfile.open(path, "w:xz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(bundle.MANIFEST)
        info.pax_headers = {"comment": "x" * (16 << 20)}
        tar.addfile(info, io.BytesIO(b""))
    assert path.stat().st_size < 256 << 10
    with pytest.raises(bundle.BundleError, match=r"holds more than 1 MiB \(decompressed\)"):
        bundle.import_bundle(path, tmp_path / "cache", max_bytes=1 << 20)
    assert not (tmp_path / "cache").exists()


def test_a_large_member_is_streamed_not_read_whole(tmp_path):
    """A 64 MiB artifact whose bytes do not match the manifest is read through a small buffer
    and refused (a 1 GiB one was once read whole: 2.35 GB of RSS)."""
    import tracemalloc

    members = {bundle.MANIFEST: _manifest({"e": {"sha256": "0" * 64, "size": 64 << 20}}),
               f"e/{cache.KEY_FILE}": b'{"artifact": {}}', f"e/{cache.ARTIFACT}": bytes(64 << 20)}
    path = _tar(tmp_path / "big.tar.gz", members, mode="w:gz")
    tracemalloc.start()
    try:
        with pytest.raises(bundle.BundleError, match="entry e's key.json does not hash to its name"):
            bundle.import_bundle(path, tmp_path / "cache")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # a few blocks of 1 MiB, not the member
    assert cache.entries(tmp_path / "cache") == [] and list((tmp_path / "cache" / ".staging").iterdir()) == []


@pytest.mark.parametrize("kind", ["a character device", "a FIFO", "a directory"])
def test_what_is_not_a_regular_file_is_refused_unread(tmp_path, kind):
    path = {"a character device": Path("/dev/zero"), "a FIFO": tmp_path / "fifo", "a directory": tmp_path}[kind]
    if kind == "a FIFO":
        os.mkfifo(path)  # no writer: an open that waited for one would never return
    with pytest.raises(bundle.BundleError, match=f"refusing bundle {path}: it is {kind}, not a regular file"):
        bundle.import_bundle(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_import_of_dev_zero_in_the_cli_is_one_line(tmp_path):
    done = jit("import", "/dev/zero", cache_dir=tmp_path / "cache")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "sparsekv jit import: error: BundleError: refusing bundle /dev/zero: it is a character device, not a regular "
        "file (a tar file as `sparsekv jit export` writes) (--debug shows the traceback)"]

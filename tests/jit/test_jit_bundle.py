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


def test_a_compressed_bomb_is_refused_before_it_is_inflated(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", 1 << 20)
    path = _tar(tmp_path / "bomb.tar.gz", {"big": bytes(4 << 20)}, mode="w:gz")  # 4 MiB of zeros, a few KiB on disk
    assert path.stat().st_size < 64 << 10
    with pytest.raises(bundle.BundleError, match="more than 1 MiB"):
        bundle.read_bundle(path)

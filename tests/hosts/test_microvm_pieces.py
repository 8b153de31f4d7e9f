"""Pieces of the microVM host that need no VM: requirements, refusals, the initramfs
writer, module ordering, the image digest, what an image packs, the image cache's bound
and clear-cache. They run everywhere (no QEMU needed)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.microvm import requirements
from gym_fork.hosts.microvm.building import image_cache, selection
from gym_fork.hosts.microvm.building.cpio import write_newc
from gym_fork.hosts.microvm.building.kernel import Kernel
from gym_fork.hosts.microvm.building.root import _Manifest
from gym_fork.system.isolation import SandboxLimits

NONE = selection.Selection(False, (), (), ())


def cartpole():
    return gym.make("CartPole-v1")


def test_a_machine_without_qemu_gets_an_error_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(requirements, "qemu_binary", lambda: None)
    assert any("QEMU" in line for line in requirements.missing_requirements())
    with pytest.raises(SandboxStartError, match=r"QEMU.*apt-get install qemu-system-x86"):
        ForkVectorEnv([cartpole], host="microvm")


def test_unknown_hosts_and_what_a_vm_cannot_give_are_refused():
    with pytest.raises(ValueError, match="`host` must be one of"):
        ForkVectorEnv([cartpole], host="docker")
    with pytest.raises(ValueError, match="no guest network"):
        ForkVectorEnv([cartpole], host="microvm", network=True)
    with pytest.raises(ValueError, match="does not apply SandboxLimits"):
        ForkVectorEnv([cartpole], host="microvm", limits=SandboxLimits(open_files=64))


def _read_newc(data: bytes) -> dict[str, tuple[int, bytes]]:
    entries, offset = {}, 0
    while True:
        assert data[offset : offset + 6] == b"070701"
        fields = [int(data[offset + 6 + 8 * k : offset + 14 + 8 * k], 16) for k in range(13)]
        mode, size, name_size = fields[1], fields[6], fields[11]
        name_start = offset + 110
        name = data[name_start : name_start + name_size - 1].decode()
        body_start = (name_start + name_size + 3) & ~3
        body = data[body_start : body_start + size]
        offset = (body_start + size + 3) & ~3
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, body)


def test_the_initramfs_writer_produces_newc_the_kernel_reads(tmp_path):
    path = tmp_path / "x.cpio"
    with open(path, "wb") as f:
        write_newc(
            f,
            [
                ("bin", stat.S_IFDIR | 0o755, None, None),
                ("bin/tool", stat.S_IFREG | 0o755, b"\x7fELF" + bytes(range(7)), None),
                ("bin/sh", stat.S_IFLNK | 0o777, None, "tool"),
                ("init", stat.S_IFREG | 0o755, b"#!/bin/sh\n", None),
            ],
        )
    entries = _read_newc(path.read_bytes())
    assert set(entries) == {"bin", "bin/tool", "bin/sh", "init"}
    assert stat.S_ISDIR(entries["bin"][0])
    assert entries["bin/tool"][1] == b"\x7fELF" + bytes(range(7))
    assert stat.S_ISLNK(entries["bin/sh"][0]) and entries["bin/sh"][1] == b"tool"
    assert entries["init"] == (stat.S_IFREG | 0o755, b"#!/bin/sh\n")


def test_guest_modules_come_after_what_they_depend_on(tmp_path):
    modules = tmp_path / "lib" / "modules" / "9.9"
    (modules / "kernel").mkdir(parents=True)

    def ko(name: str, depends: str) -> None:
        body = b"\x7fELF junk\x00license=GPL\x00depends=" + depends.encode() + b"\x00more"
        (modules / "kernel" / f"{name}.ko").write_bytes(body)

    for name, depends in {
        "virtio": "",
        "virtio_ring": "",
        "virtio_pci": "virtio_ring,virtio",
        "virtio_blk": "virtio,virtio_ring",
        "crc32c_generic": "",
        "libcrc32c": "",
        "erofs": "libcrc32c",
        "overlay": "",
        "virtio_console": "virtio,virtio_ring",
    }.items():
        ko(name, depends)
    (modules / "modules.builtin").write_text("kernel/fs/overlayfs/overlay.ko\n")
    order = [p.name for p in Kernel(tmp_path / "vmlinuz", modules, "9.9").module_files()]
    assert "overlay.ko" not in order  # built in: nothing to load
    for first, then in [
        ("virtio.ko", "virtio_pci.ko"),
        ("virtio_ring.ko", "virtio_blk.ko"),
        ("crc32c_generic.ko", "libcrc32c.ko"),  # asked for by name at run time
        ("libcrc32c.ko", "erofs.ko"),
    ]:
        assert order.index(first) < order.index(then)
    assert len(order) == len(set(order))


def test_the_image_digest_follows_the_files_but_not_their_byte_code(tmp_path):
    tree = tmp_path / "code"
    (tree / "pkg" / "__pycache__").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    (tree / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"old")
    os.symlink("mod.py", tree / "pkg" / "alias.py")

    def digest() -> str:
        manifest = _Manifest()
        manifest.add_tree(str(tree))
        assert str(tree / "pkg" / "alias.py") in manifest.entries
        return manifest.digest(["extra"])

    before = digest()
    (tree / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"new byte code")
    assert digest() == before
    (tree / "pkg" / "mod.py").write_text("x = 2  # changed\n")
    assert digest() != before


def _fake_image(images: Path, name: str, size: int, age_s: float) -> Path:
    path = images / name
    path.mkdir(parents=True)
    (path / "image.json").write_text("{}")
    (path / "root.erofs").write_bytes(b"x" * size)
    past = time.time() - age_s
    os.utime(path, (past, past))
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_CACHE", str(tmp_path))
    monkeypatch.delenv("GYM_FORK_VM_BOOT_CACHE", raising=False)
    monkeypatch.delenv("GYM_FORK_VM_IMAGE_CACHE_MB", raising=False)
    monkeypatch.setattr(image_cache, "_held", {})
    yield tmp_path
    image_cache.release_all()


def test_the_image_cache_evicts_the_least_recently_used_down_to_its_bound(cache, monkeypatch):
    images = cache / "images"
    mib = 1 << 20
    _fake_image(images, "a", mib, 5000)
    _fake_image(images, "b", mib, 4000)
    c = _fake_image(images, "c", mib, 3000)
    current = _fake_image(images, "current", mib, 6000)  # the one in use: oldest, kept
    (images / ".build-x").mkdir()  # a build in progress is not an image
    boot = cache / "boot-templates"
    boot.mkdir()
    (boot / "a-0123.boot").write_bytes(b"t")
    (boot / "c-0123.boot").write_bytes(b"t")
    monkeypatch.setenv("GYM_FORK_VM_IMAGE_CACHE_MB", "3")  # 4 images of 1 MiB + metadata
    removed = image_cache.evict(keep=current)
    assert [p.name for p in removed] == ["a", "b"]  # oldest first, until the rest fit
    assert sorted(p.name for p in images.iterdir()) == [".build-x", "c", "current"]
    assert sorted(p.name for p in boot.iterdir()) == ["c-0123.boot"]  # a's went with it
    assert image_cache.evict(keep=current) == []  # within the bound now
    assert image_cache.hold(c)  # used now: the most recent; another process would keep it
    monkeypatch.setenv("GYM_FORK_VM_IMAGE_CACHE_MB", "0")
    assert image_cache.hold(c)  # a second user of it in this process
    assert image_cache.evict(keep=current) == []  # held by this process: stays
    image_cache.release(c)
    assert image_cache.evict(keep=current) == [] and c.exists()  # one user left
    image_cache.release(c)
    assert image_cache.evict(keep=current) == [c]  # released: evicted
    assert current.exists()
    monkeypatch.setenv("GYM_FORK_VM_IMAGE_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="GYM_FORK_VM_IMAGE_CACHE_MB='lots'"):
        image_cache.evict(keep=current)


def test_an_image_another_process_uses_is_neither_evicted_nor_cleared(cache):
    images = cache / "images"
    used = _fake_image(images, "used", 1 << 20, 5000)
    free = _fake_image(images, "free", 1 << 20, 4000)
    (used / image_cache.LOCK_NAME).touch()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); "
            "print('held', flush=True); sys.stdin.read()",
            str(used / image_cache.LOCK_NAME),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert image_cache.evict(keep=images / "none", bound=0) == [free]
        _fake_image(images, "free2", 1 << 20, 3000)
        done = image_cache.clear()
        assert done.images == 1 and done.kept_in_use == ["used"]
        assert sorted(p.name for p in images.iterdir()) == ["used"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert image_cache.clear().images == 1  # released: now it goes
    assert list(images.iterdir()) == []


def test_clear_removes_images_and_boot_templates_and_counts_what_it_freed(cache):
    images = cache / "images"
    _fake_image(images, "one", 3 << 20, 1000)
    _fake_image(images, "two", 2 << 20, 2000)
    # no lock file (an older gym_fork's) and built a minute ago: its user may be running
    _fake_image(images, "young", 1 << 20, 60)
    boot = cache / "boot-templates"
    boot.mkdir()
    (boot / "one-abc.boot").write_bytes(b"b" * (1 << 20))
    (boot / ".one-abc.boot.123.tmp").write_bytes(b"partial")
    stale = images / ".build-old"
    stale.mkdir()
    (stale / "root.erofs").write_bytes(b"s" * 4096)
    past = time.time() - 2 * image_cache.STALE_BUILD_S
    os.utime(stale, (past, past))
    fresh = images / ".build-now"  # another process is building it
    fresh.mkdir()
    done = image_cache.clear()
    assert (done.images, done.boot_templates, done.kept_in_use) == (2, 2, ["young"])
    assert 6 << 20 <= done.freed_bytes <= 7 << 20  # 3 + 2 + 1 MiB and some metadata
    assert sorted(p.name for p in images.iterdir()) == [".build-now", "young"]
    assert list(boot.iterdir()) == []


def _dist(site: Path, name: str, files: list[str], requires: list[str] = ()) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    record = [*files, f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in record))
    for f in files:
        (site / f).parent.mkdir(parents=True, exist_ok=True)
        (site / f).write_text("")


def test_an_image_packs_the_imported_distributions_and_what_they_require(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    _dist(site, "Env_Pkg", ["envpkg/__init__.py"], ["helper-lib>=1", "plotting; extra == 'viz'"])
    _dist(site, "helper.lib", ["helper/__init__.py", "helper.libs/libh.so"])
    _dist(site, "plotting", ["plotting/__init__.py"])  # only an extra of envpkg's
    _dist(site, "bigtorch", ["bigtorch/__init__.py"])  # installed, never imported
    (site / "loose_module.py").write_text("")
    (site / "something.pth").write_text("")
    monkeypatch.setattr(selection, "site_dirs", lambda: [str(site)])
    monkeypatch.delenv("GYM_FORK_VM_PACKAGES", raising=False)
    chosen = selection.select(entries={str(site / "envpkg")})
    assert chosen.distributions == ("env-pkg", "helper-lib")
    names = {Path(e).name for e in chosen.entries}
    assert {"envpkg", "helper", "helper.libs", "loose_module.py", "something.pth"} <= names
    assert {"Env_Pkg-1.0.dist-info", "helper.lib-1.0.dist-info"} <= names
    assert not names & {"plotting", "bigtorch", "bigtorch-1.0.dist-info"}
    monkeypatch.setenv("GYM_FORK_VM_PACKAGES", "Plotting")
    assert selection.select(entries=set()).distributions == ("plotting",)
    monkeypatch.setenv("GYM_FORK_VM_PACKAGES", "plotting,no-such-thing")
    with pytest.raises(selection.UnknownPackage, match="no-such-thing, not installed"):
        selection.select(entries=set())
    monkeypatch.setenv("GYM_FORK_VM_PACKAGES", "all")
    assert selection.select(entries=set()).everything


def test_this_process_imports_are_found_in_their_site_dirs():
    import numpy

    sites = selection.site_dirs()
    found = selection.imported_entries(sites)
    assert os.path.dirname(os.path.realpath(numpy.__file__)) in found
    assert all(os.path.dirname(e) in sites for e in found)


def test_the_collection_is_reused_until_a_directory_or_elf_file_changes(tmp_path, monkeypatch):
    import os
    import time

    from gym_fork.hosts.microvm.building import root

    tree = tmp_path / "code"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    (tree / "pkg" / "ext.so").write_bytes(b"\x7fELF")
    calls = []

    def collect(python: str, chosen) -> root._Manifest:
        calls.append(python)
        manifest = root._Manifest()
        manifest.add_tree(str(tree))
        # only the tree: pytest's own directories above it change as other tests run
        manifest.entries = {k: v for k, v in manifest.entries.items() if k.startswith(str(tree))}
        return manifest

    def age(*paths) -> None:  # older than the racy window: the collection is kept
        old = time.time() - 60
        for path in paths:
            os.utime(path, (old, old))

    monkeypatch.setattr(root, "_collect", collect)
    monkeypatch.setattr(root, "_collected", {})
    age(tree, tree / "pkg", tree / "pkg" / "ext.so")
    first = root._collect_memoised("py", NONE)
    assert root._collect_memoised("py", NONE) is first and len(calls) == 1
    before = first.digest([])
    (tree / "pkg" / "mod.py").write_text("x = 2  # edited in place\n")
    assert root._collect_memoised("py", NONE) is first  # same entries; the digest sees the edit
    assert first.digest([]) != before
    (tree / "pkg" / "new.py").write_text("y = 1\n")  # a new file: its directory changed
    second = root._collect_memoised("py", NONE)
    assert second is not first and str(tree / "pkg" / "new.py") in second.entries
    assert len(calls) == 2
    assert root._collect_memoised("py", NONE) is second or len(calls) == 3  # racy: not kept
    age(tree / "pkg")
    third = root._collect_memoised("py", NONE)
    assert root._collect_memoised("py", NONE) is third
    count = len(calls)
    (tree / "pkg" / "ext.so").write_bytes(b"\x7fELF rebuilt")  # its libraries may differ
    assert root._collect_memoised("py", NONE) is not third and len(calls) == count + 1
    assert root._collect_memoised("py", NONE, force=True) and len(calls) == count + 2

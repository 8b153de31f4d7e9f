"""Pieces of the microVM host that need no VM: requirements, refusals, the initramfs
writer, module ordering, the image digest. They run everywhere (no QEMU needed)."""

from __future__ import annotations

import os
import stat

import gymnasium as gym
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.microvm import requirements
from gym_fork.hosts.microvm.cpio import write_newc
from gym_fork.hosts.microvm.image import _Manifest
from gym_fork.hosts.microvm.kernel import Kernel
from gym_fork.system.isolation import SandboxLimits


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


def test_old_guest_images_are_pruned_keeping_the_newest_and_recent_ones(tmp_path, monkeypatch):
    import os
    import time

    from gym_fork.hosts.microvm import image

    monkeypatch.setattr(image, "images_dir", lambda: tmp_path)
    now = time.time()
    ages = {"a": 5000, "b": 4000, "c": 3000, "d": 2000, "e": 1000, "fresh": 10}
    for name, age in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age, now - age))
    (tmp_path / ".build-tmp").mkdir()
    removed = image._prune_images(keep=tmp_path / "a")
    assert sorted(p.name for p in removed) == ["b", "c"]  # fresh, e, d newest; a current
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".build-tmp", "a", "d", "e", "fresh"]
    (tmp_path / "g").mkdir()  # a new image pushes d out; fresh (10 s old) stays
    os.utime(tmp_path / "fresh", (now - 10, now - 5000 + 4990))
    assert [p.name for p in image._prune_images(keep=tmp_path / "a")] == ["d"]
    (tmp_path / "h").mkdir()  # e falls beyond the newest three, but is younger than this:
    monkeypatch.setattr(image, "PRUNE_AFTER_S", 1500.0)
    assert image._prune_images(keep=tmp_path / "a") == []


def test_the_collection_is_reused_until_a_directory_or_elf_file_changes(tmp_path, monkeypatch):
    import os
    import time

    from gym_fork.hosts.microvm import image

    tree = tmp_path / "code"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("x = 1\n")
    (tree / "pkg" / "ext.so").write_bytes(b"\x7fELF")
    calls = []

    def collect(python: str) -> image._Manifest:
        calls.append(python)
        manifest = image._Manifest()
        manifest.add_tree(str(tree))
        # only the tree: pytest's own directories above it change as other tests run
        manifest.entries = {k: v for k, v in manifest.entries.items() if k.startswith(str(tree))}
        return manifest

    def age(*paths) -> None:  # older than the racy window: the collection is kept
        old = time.time() - 60
        for path in paths:
            os.utime(path, (old, old))

    monkeypatch.setattr(image, "_collect", collect)
    monkeypatch.setattr(image, "_collected", {})
    age(tree, tree / "pkg", tree / "pkg" / "ext.so")
    first = image._collect_memoised("py")
    assert image._collect_memoised("py") is first and len(calls) == 1
    before = first.digest([])
    (tree / "pkg" / "mod.py").write_text("x = 2  # edited in place\n")
    assert image._collect_memoised("py") is first  # same entries; the digest sees the edit
    assert first.digest([]) != before
    (tree / "pkg" / "new.py").write_text("y = 1\n")  # a new file: its directory changed
    second = image._collect_memoised("py")
    assert second is not first and str(tree / "pkg" / "new.py") in second.entries
    assert len(calls) == 2
    assert image._collect_memoised("py") is second or len(calls) == 3  # racy: not kept
    age(tree / "pkg")
    third = image._collect_memoised("py")
    assert image._collect_memoised("py") is third
    count = len(calls)
    (tree / "pkg" / "ext.so").write_bytes(b"\x7fELF rebuilt")  # its libraries may differ
    assert image._collect_memoised("py") is not third and len(calls) == count + 1
    assert image._collect_memoised("py", force=True) and len(calls) == count + 2

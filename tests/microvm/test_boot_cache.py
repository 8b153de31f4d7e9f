"""The boot template on disk: a new process restores it instead of booting; a corrupt or
partial entry is detected, removed and rebuilt. One real boot (in a subprocess) serves
every test of this module."""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from gym_fork.hosts.microvm import boot, template_cache, template_dir
from gym_fork.hosts.microvm.accel import choose_accel
from gym_fork.hosts.microvm.building.image import build_image
from gym_fork.hosts.microvm.machine import MachineConfig, new_memfd
from gym_fork.hosts.microvm.snapshot import BranchPoint
from gym_fork.transport.channel import DEFAULT_RING_BYTES, region_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A new controller process: its first microVM env (construction + first reset), whether
# its boot template came from disk, and how long the load took.
FIRST_ENV = textwrap.dedent(
    """
    import json, time
    from gym_fork.hosts.microvm import template_cache as tc
    loads, stores = [], []
    load, store = tc.load, tc.store
    def timed_load(config):
        t = time.perf_counter()
        point = load(config)
        loads.append((point is not None, time.perf_counter() - t))
        return point
    def recorded_store(config, point):
        path = store(config, point)
        stores.append(str(path))
        return path
    tc.load, tc.store = timed_load, recorded_store
    from gym_fork import ForkVectorEnv
    from tests.microvm.envs import GuestProbeEnv
    t = time.perf_counter()
    envs = ForkVectorEnv([GuestProbeEnv], host="microvm")
    envs.reset(seed=0)
    seconds = time.perf_counter() - t
    digest = envs.isolation["image"]
    envs.close()
    print(json.dumps({"seconds": seconds, "loads": loads, "stores": stores, "image": digest}))
    """
)


def first_env(cache: str) -> dict:
    """Run FIRST_ENV in a new process whose boot templates live in ``cache``."""
    env = {**os.environ, "GYM_FORK_VM_BOOT_CACHE": cache}
    done = subprocess.run(
        [sys.executable, "-c", FIRST_ENV],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def default_config() -> MachineConfig:
    """The MachineConfig a default microVM host of this process uses."""
    image = build_image(quiet=True)
    accel, _ = choose_accel(image)
    return MachineConfig(
        image,
        accel,
        256,
        region_bytes(DEFAULT_RING_BYTES),
        16 << 20,
        DEFAULT_RING_BYTES,
        doorbell=os.environ.get("GYM_FORK_VM_DOORBELL", "1") != "0",
    )


@pytest.fixture(scope="module")
def booted(tmp_path_factory) -> dict:
    """A boot template written to a fresh cache dir by a new process (a full boot)."""
    cache = str(tmp_path_factory.mktemp("boot-cache"))
    result = first_env(cache)
    assert [used for used, _seconds in result["loads"]] == [False]
    assert len(result["stores"]) == 1 and result["stores"][0].startswith(cache)
    _share_with_later_processes(result["stores"][0])
    return {**result, "cache": cache, "entry": result["stores"][0]}


def _share_with_later_processes(entry: str) -> None:
    """Copy the fresh entry into the default cache (if it has none for this image), so
    that later microVM tests' processes load it instead of booting again (13-40 s under
    TCG). A copy, not a link: the corruption tests below flip bytes in ``entry``."""
    if not template_dir.enabled():
        return
    target = template_dir.cache_dir() / os.path.basename(entry)
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.copyfile(entry, partial)
    os.replace(partial, target)


def test_a_second_process_restores_the_boot_template_from_disk(booted):
    entry = booted["entry"]
    assert os.path.getsize(entry) < 256 << 20  # sparse: only the RAM's data extents
    second = first_env(booted["cache"])
    if second["image"] != booted["image"]:
        pytest.skip("the working tree changed between the two processes: a new guest image")
    (used, load_seconds), *_ = second["loads"]
    assert used, "the second process booted instead of loading the disk entry"
    assert second["stores"] == []
    assert load_seconds < 5.0
    # The boot alone is 13-40 s under TCG here; a load is well under a second.
    assert second["seconds"] < booted["seconds"] / 3, (second["seconds"], booted["seconds"])


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        f.seek(len(template_cache.MAGIC))
        length = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(length))


def _truncate(path: str, header: dict) -> None:
    os.truncate(path, header["data_offset"] + 4096)


CORRUPTIONS = {
    "magic": (lambda p, h: _flip(p, 0), "bad magic"),
    "partial file": (_truncate, "size"),
    "state": (lambda p, h: _flip(p, h["state_offset"] + 2), "device state"),
    "ram": (lambda p, h: _flip(p, h["total_size"] - 1), "RAM data"),
    "header key": (lambda p, h: _flip(p, len(template_cache.MAGIC) + 8 + 10), ""),
}


def stand_in_point(config: MachineConfig, marker: bytes) -> BranchPoint:
    """A boot template made without booting: sparse RAM with one page of data."""
    ram = new_memfd("gym_fork-vm-boot-ram", config.memory_mb << 20)
    os.pwrite(ram, marker, 1 << 20)
    os.pwrite(ram, marker, (config.memory_mb << 20) - 4096)
    state = os.memfd_create("gym_fork-vm-boot-state", os.MFD_CLOEXEC)
    os.write(state, b"device state " + marker)
    return BranchPoint(ram, state, b"positions " + marker)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupt_entry_is_detected_removed_and_rebuilt(kind, tmp_path, monkeypatch, caplog):
    config = default_config()
    monkeypatch.setenv("GYM_FORK_VM_BOOT_CACHE", str(tmp_path))
    written = stand_in_point(config, b"old")
    try:
        entry = template_cache.store(config, written)
    finally:
        written.close()
    assert entry == template_cache.entry_path(config) and entry.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    corrupt, reason = CORRUPTIONS[kind]
    corrupt(str(entry), _header(str(entry)))

    boots = []

    def stand_in_boot(config: MachineConfig, timeout: float) -> BranchPoint:
        boots.append(1)
        return stand_in_point(config, b"new")

    monkeypatch.setattr(boot, "boot_guest", stand_in_boot)
    monkeypatch.setattr(boot, "_TEMPLATES", {})
    with caplog.at_level(logging.WARNING, logger="gym_fork.microvm"):
        point, _seconds = boot.boot_template(config, 10.0)
    try:
        assert boots == [1], "the corrupt entry was used"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("unusable" in w and reason in w for w in warnings), warnings
        assert point.positions == b"positions new"
        # Rebuilt: the next load reads the new entry back, byte for byte.
        again = template_cache.load(config)
        assert again is not None
        try:
            assert again.positions == b"positions new"
            assert os.pread(again.ram_fd, 3, 1 << 20) == b"new"
            assert os.pread(again.ram_fd, 3, (config.memory_mb << 20) - 4096) == b"new"
            assert os.pread(again.ram_fd, 3, 0) == b"\0\0\0"
            assert os.pread(again.state_fd, 100, 0) == b"device state new"
            assert os.fstat(again.ram_fd).st_size == config.memory_mb << 20
        finally:
            again.close()
        assert os.path.getsize(entry) < 1 << 20  # two pages of RAM data: holes skipped
    finally:
        point.close()


def test_an_intact_entry_is_used(tmp_path, monkeypatch):
    config = default_config()
    monkeypatch.setenv("GYM_FORK_VM_BOOT_CACHE", str(tmp_path))
    written = stand_in_point(config, b"old")
    try:
        template_cache.store(config, written)
    finally:
        written.close()
    monkeypatch.setattr(boot, "boot_guest", lambda *a: pytest.fail("booted despite an entry"))
    monkeypatch.setattr(boot, "_TEMPLATES", {})
    point, _seconds = boot.boot_template(config, 10.0)
    try:
        assert point.positions == b"positions old"
        assert boot.boot_template(config, 10.0) == (point, 0.0)  # then from memory
    finally:
        point.close()


def test_release_boot_templates_with_disk_clears_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_VM_BOOT_CACHE", str(tmp_path))
    config = default_config()
    written = stand_in_point(config, b"old")
    try:
        template_cache.store(config, written)
    finally:
        written.close()
    (tmp_path / ".left-over.123.tmp").write_bytes(b"partial")
    monkeypatch.setattr(boot, "_TEMPLATES", {})
    boot.release_boot_templates(disk=True)
    assert list(tmp_path.iterdir()) == []


def test_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GYM_FORK_VM_BOOT_CACHE", "0")
    config = default_config()
    ram = new_memfd("gym_fork-vm-boot-ram", 1 << 20)
    state = os.memfd_create("gym_fork-vm-boot-state", os.MFD_CLOEXEC)
    point = BranchPoint(ram, state, b"")
    try:
        assert template_cache.store(config, point) is None
        assert template_cache.load(config) is None
    finally:
        point.close()

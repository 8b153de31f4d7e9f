"""The cache of guest images: where they live, how big it may grow, what removes them.

Every image is a directory ``<cache root>/images/<digest>`` (its root file system, its
initramfs, ``image.json``). The cache is bounded by size: after a build, the least
recently used images go until the rest fit in ``GYM_FORK_VM_IMAGE_CACHE_MB`` (default
:data:`DEFAULT_BOUND_MB`). The image just built or used always stays, even alone over the
bound. An image a live microVM host uses is never removed: the host holds a shared
``flock`` on its ``.lock`` file until it closes (every clone's QEMU opens the image's
files again, so they must stay), and removal takes the lock exclusively or leaves the
image. The boot templates made from an image go with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gym_fork import knobs
from gym_fork.hosts.microvm import template_dir
from gym_fork.hosts.microvm.paths import cache_root

DEFAULT_BOUND_MB = 4096
LOCK_NAME = ".lock"

# digest -> (the fd of its lock file, held shared; how many users in this process)
_held: dict[str, tuple[int, int]] = {}
_held_lock = threading.Lock()


def images_dir() -> Path:
    """``<cache root>/images``."""
    return cache_root() / "images"


def bound_bytes() -> int:
    """``GYM_FORK_VM_IMAGE_CACHE_MB`` in bytes (a clear error for a bad value)."""
    given = knobs.read("GYM_FORK_VM_IMAGE_CACHE_MB").strip()
    if not given:
        return DEFAULT_BOUND_MB << 20
    try:
        value = int(given)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"GYM_FORK_VM_IMAGE_CACHE_MB={given!r}: a whole number of MiB >= 0")
    return value << 20


def disk_bytes(path: Path) -> int:
    """Bytes ``path`` occupies on disk (allocated blocks, as ``du`` counts them)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not path.is_dir() or path.is_symlink():
        return st.st_blocks * 512
    total = st.st_blocks * 512
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def hold(target: Path) -> bool:
    """Take a shared lock on the image ``target`` for a user of it (a microVM host), to
    be given back with :func:`release`; False if the image was removed meanwhile (then
    it must be built again)."""
    with _held_lock:
        if target.name in _held:
            fd, users = _held[target.name]
            _held[target.name] = (fd, users + 1)
            return True
        try:
            fd = os.open(target / LOCK_NAME, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_SH)
        if not (target / "image.json").exists():  # removed between the look and the lock
            os.close(fd)
            return False
        _held[target.name] = (fd, 1)
    touch(target)
    return True


def release(target: Path) -> None:
    """One user of ``target`` is done; the last one gives the lock back."""
    with _held_lock:
        fd, users = _held.get(target.name, (-1, 0))
        if users > 1:
            _held[target.name] = (fd, users - 1)
        elif users == 1:
            del _held[target.name]
            os.close(fd)


def release_all() -> None:
    """Give up every hold of this process (for tests: its VMs must be gone)."""
    with _held_lock:
        for fd, _ in _held.values():
            os.close(fd)
        _held.clear()


def touch(target: Path) -> None:
    """Mark ``target`` as just used: the last to be evicted."""
    with contextlib.suppress(OSError):
        os.utime(target)


def _remove_if_unused(path: Path) -> bool:
    """Remove the image ``path`` and its boot templates unless a process holds it."""
    with _held_lock:
        if path.name in _held:
            return False
    try:
        fd = os.open(path / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        # Made before locks existed (or half-removed): nobody can hold it, but a process
        # of an older gym_fork may still use it: not within LOCKLESS_GRACE_S of its build.
        if _age_s(path) < LOCKLESS_GRACE_S:
            return False
        fd = None
    except OSError:
        return False
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
        shutil.rmtree(path, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
    _remove_boot_templates(path.name)
    return True


def _remove_boot_templates(digest: str) -> None:
    directory = template_dir.cache_dir()
    if directory.is_dir():
        for entry in directory.glob(f"{digest}-*{template_dir.SUFFIX}"):
            with contextlib.suppress(OSError):
                entry.unlink()


def images_by_use() -> list[Path]:
    """Image directories, least recently used first (builds in progress left out)."""
    try:
        found = [p for p in images_dir().iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    stamped = []
    for path in found:
        with contextlib.suppress(OSError):
            stamped.append((path.stat().st_mtime, path))
    return [path for _, path in sorted(stamped)]


def evict(keep: Path, bound: int | None = None) -> list[Path]:
    """Remove least recently used images until the cache fits ``bound`` bytes
    (default :func:`bound_bytes`); ``keep`` and images in use stay. What was removed."""
    limit = bound_bytes() if bound is None else bound
    sizes = {path: disk_bytes(path) for path in images_by_use()}
    total = sum(sizes.values())
    removed = []
    for path, size in sizes.items():
        if total <= limit:
            break
        if path != keep and _remove_if_unused(path):
            removed.append(path)
            total -= size
    return removed


@dataclass
class Cleared:
    """What :func:`clear` did."""

    images: int = 0
    boot_templates: int = 0
    freed_bytes: int = 0
    kept_in_use: list[str] = field(default_factory=list)


def clear() -> Cleared:
    """Remove every image no live process uses, and every boot template."""
    done = Cleared()
    boot_dir = template_dir.cache_dir()
    before = disk_bytes(boot_dir)
    done.boot_templates = template_dir.clear()
    done.freed_bytes += max(0, before - disk_bytes(boot_dir))
    for path in images_by_use():
        size = disk_bytes(path)
        if _remove_if_unused(path):
            done.images += 1
            done.freed_bytes += size
        else:
            done.kept_in_use.append(path.name)
    with contextlib.suppress(OSError):
        for leftover in images_dir().glob(".build-*"):  # a build killed half-way
            if leftover.is_dir() and _stale_build(leftover):
                done.freed_bytes += disk_bytes(leftover)
                shutil.rmtree(leftover, ignore_errors=True)
    return done


STALE_BUILD_S = 3600.0
LOCKLESS_GRACE_S = 600.0


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


def _stale_build(path: Path) -> bool:
    """A build directory untouched for an hour: its builder is gone."""
    return _age_s(path) > STALE_BUILD_S

"""The erofs root of a guest image: which of the host's files it holds, and staging them.

:func:`_collect` walks what the guest needs, at the same absolute paths as on the host:
the interpreter, its standard library, the installed packages a :class:`.selection.Selection`
names (not the whole virtual env), gym_fork, the other directories on ``sys.path``, and
the shared libraries all of them load. :func:`_collect_memoised` reuses a walk while
nothing it read changed; :meth:`_Manifest.digest` hashes every entry's path, size, mtime
and link target (byte code in __pycache__ is packed but not hashed, since Python checks
it against its source anyway); :func:`_stage` lays the entries out for mkfs.erofs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

import gym_fork
from gym_fork import progress
from gym_fork.hosts.microvm.building.selection import Selection
from gym_fork.hosts.microvm.paths import cache_root

PACKAGE_ROOT = str(Path(gym_fork.__file__).resolve().parent.parent)

# Directory names never packed: VCS data, caches, and the standard library's own tests
# and GUI parts, which no env needs and which would double the image.
SKIP_DIRS = {
    ".git",
    ".hg",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    ".benchmarks",
    ".mypy_cache",
    "node_modules",
}
SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3"}


class _Manifest:
    """Absolute path -> ("file", src) | ("link", target) | ("dir", None), as on the host."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, str | None]] = {}

    def add(self, path: str) -> None:
        """Add ``path`` and every symlink on the way to it (the guest resolves the same)."""
        path = os.path.abspath(path)
        if path in self.entries:
            return
        current = "/"
        parts = Path(path).parts[1:]
        for k, part in enumerate(parts):
            nxt = os.path.join(current, part)
            if os.path.islink(nxt):
                if nxt not in self.entries:
                    target = os.readlink(nxt)
                    self.entries[nxt] = ("link", target)
                    self.add(os.path.join(os.path.dirname(nxt), target))
                current = os.path.realpath(nxt)
            else:
                current = nxt
            if k < len(parts) - 1:
                self.entries.setdefault(current, ("dir", None))
        if os.path.isdir(current):
            self.entries.setdefault(current, ("dir", None))
        elif os.path.exists(current):
            self.entries[current] = ("file", current)

    def add_tree(
        self, root: str, skip: AbstractSet[str] = frozenset(), prune: AbstractSet[str] = frozenset()
    ):
        """Add every file under ``root`` except SKIP_DIRS, ``skip`` names and ``prune`` paths."""
        if not os.path.isdir(root):
            return
        self.add(root)
        real_root = os.path.realpath(root)
        for dirpath, dirnames, filenames in os.walk(real_root):
            dirnames[:] = [
                d
                for d in dirnames
                if d not in SKIP_DIRS
                and d not in skip
                and os.path.join(dirpath, d) not in prune
                and not os.path.islink(os.path.join(dirpath, d))
            ]
            self.entries.setdefault(dirpath, ("dir", None))
            for name in filenames:
                full = os.path.join(dirpath, name)
                if os.path.islink(full):
                    self.add(full)
                else:
                    self.entries[full] = ("file", full)
            for name in os.listdir(dirpath):
                full = os.path.join(dirpath, name)
                if os.path.islink(full) and os.path.isdir(full):
                    self.add(full)

    def elf_files(self) -> list[str]:
        return [
            path
            for path, (kind, _) in self.entries.items()
            if kind == "file" and (".so" in os.path.basename(path) or os.access(path, os.X_OK))
        ]

    def digest(self, extra: list[str]) -> str:
        h = hashlib.sha256()
        for item in extra:
            h.update(item.encode() + b"\0")
        for path in sorted(self.entries):
            kind, value = self.entries[path]
            if "/__pycache__" in path:
                # Byte code is packed (guest code under TCG should not compile) but not
                # hashed: Python writes it as it goes, and checks it against the source.
                continue
            if kind == "file":
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # removed since the walk (a temp file)
                    h.update(f"- {path}\n".encode())
                    continue
                h.update(f"f {path} {st.st_size} {st.st_mtime_ns} {st.st_mode}\n".encode())
            else:
                h.update(f"{kind[0]} {path} {value or ''}\n".encode())
        return h.hexdigest()[:20]


def _shared_libraries(files: list[str]) -> set[str]:
    """What the dynamic loader resolves for ``files`` (one ``ldd`` per batch)."""
    libs: set[str] = set()
    for start in range(0, len(files), 200):
        batch = files[start : start + 200]
        out = subprocess.run(
            ["ldd", *batch], capture_output=True, text=True, env={"LC_ALL": "C"}
        ).stdout
        for line in out.splitlines():
            line = line.strip()
            if "=>" in line:
                target = line.split("=>", 1)[1].strip().split(" (")[0]
                if target.startswith("/"):
                    libs.add(target)
            elif line.startswith("/") and " (0x" in line:
                libs.add(line.split(" (")[0])
    return libs


@dataclass
class _Collected:
    """A manifest with what it was made from: the mtime of each directory in it (an
    entry added, removed or renamed anywhere changes its directory's mtime) and the
    identity of each ELF file ldd read (their libraries are in the manifest too)."""

    manifest: _Manifest
    dirs: dict[str, int]
    elf: dict[str, tuple[int, int, int]]

    def still_valid(self) -> bool:
        """True while no directory of the manifest and no ELF file changed. Edits to a
        file in place are not looked for here: the digest stats every file anyway."""
        try:
            for path, mtime in self.dirs.items():
                if os.stat(path).st_mtime_ns != mtime:
                    return False
            for path, ident in self.elf.items():
                if _identity(os.stat(path)) != ident:
                    return False
        except OSError:
            return False
        return True


# Collections made by this process, by what they depend on (the interpreter, sys.path,
# the working directory). build_image runs more than once in a process that makes
# microVM envs; walking ~58,000 files and running ldd on their ELF files takes seconds.
_collected: dict[tuple, _Collected] = {}
_collected_lock = threading.Lock()
# A directory modified this close to the walk may change again within the same tick of
# the file system's clock without its mtime changing: such a collection is not kept.
RACY_NS = 2_000_000_000


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _collect_key(python: str, selection: Selection) -> tuple:
    # Which sys.path entries exist too: one that appears is walked by a new collection.
    paths = tuple((entry, os.path.isdir(entry)) for entry in sys.path if entry)
    return (python, paths, os.getcwd(), sys.prefix, sys.base_prefix, PACKAGE_ROOT, selection)


def _collect_memoised(python: str, selection: Selection, force: bool = False) -> _Manifest:
    """:func:`_collect`, reused while :meth:`_Collected.still_valid` (never with
    ``force``)."""
    key = _collect_key(python, selection)
    with _collected_lock:
        known = _collected.get(key)
    if known is not None and not force and known.still_valid():
        return known.manifest
    started = time.time_ns()
    manifest = _collect(python, selection)
    dirs, elf = {}, {}
    try:
        for path, (kind, _) in manifest.entries.items():
            if kind == "dir":
                dirs[path] = os.stat(path).st_mtime_ns
        for path in manifest.elf_files():
            elf[path] = _identity(os.stat(path))
    except OSError:
        return manifest  # changing under our feet: not kept
    newest = max([*dirs.values(), *(ident[1] for ident in elf.values())], default=0)
    if newest < started - RACY_NS:
        with _collected_lock:
            _collected[key] = _Collected(manifest, dirs, elf)
    return manifest


def _collect(python: str, selection: Selection) -> _Manifest:
    manifest = _Manifest()
    manifest.add(python)
    prefix = sys.prefix
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = os.path.join(sys.base_prefix, "lib", version)
    # The static library and build files in config-3.X-<arch> (~45 MiB) link extensions;
    # nothing at run time reads them.
    config_dirs = {str(p) for p in Path(stdlib).glob("config-*")}
    manifest.add_tree(
        stdlib, skip=SKIP_STDLIB | {"site-packages", "dist-packages"}, prune=config_dirs
    )
    # Never the cache itself (a script run from a directory that holds it would pack the
    # images it made), nor the venv again.
    pruned = {os.path.realpath(prefix), os.path.realpath(cache_root())}
    if selection.everything and prefix != sys.base_prefix:
        manifest.add_tree(prefix)
    elif prefix != sys.base_prefix:
        manifest.add(os.path.join(prefix, "pyvenv.cfg"))  # how the guest finds its venv
    for site in selection.site_dirs:
        if selection.everything:
            manifest.add_tree(site)
            continue
        manifest.add(site)
        for entry in selection.entries:
            if os.path.dirname(entry) == site:
                manifest.add_tree(entry) if os.path.isdir(entry) else manifest.add(entry)
    manifest.add_tree(PACKAGE_ROOT, prune=pruned)
    sites = tuple(selection.site_dirs)
    for entry in [*sys.path, os.getcwd()]:
        if entry and os.path.realpath(entry) in sites:
            continue
        if entry and os.path.isdir(entry) and not entry.startswith(stdlib):
            if any(entry.startswith(p) for p in (prefix, PACKAGE_ROOT)):
                continue
            manifest.add_tree(entry, prune=pruned)
    for lib in _shared_libraries(manifest.elf_files()):
        manifest.add(lib)
    for extra in ("/etc/ld.so.cache", "/etc/localtime", "/etc/passwd", "/etc/group"):
        if os.path.exists(extra):
            manifest.add(extra)
    return manifest


def _stage(manifest: _Manifest, staging: Path, bar: progress.Task | None = None) -> None:
    """Recreate the manifest under ``staging`` with hard links (copies across devices)."""
    for path in bar.track(sorted(manifest.entries)) if bar else sorted(manifest.entries):
        kind, value = manifest.entries[path]
        dest = staging / path.lstrip("/")
        if kind == "dir" or value is None:  # only a directory has no source
            dest.mkdir(parents=True, exist_ok=True)
        elif kind == "link":
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.is_symlink():
                os.symlink(value, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(value, dest)
            except FileNotFoundError:
                continue  # removed since the walk: not packed
            except OSError:
                with contextlib.suppress(FileNotFoundError):
                    shutil.copy2(value, dest)

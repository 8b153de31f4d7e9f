"""Guest images: the host's Python environment packed read-only for a microVM.

``build_image()`` collects the interpreter, its standard library, the virtual env
gym_fork runs in (so the user's env code and packages are there), the directories on
``sys.path``, and the shared libraries all of them load, at the same absolute paths
as on the host. They become an erofs image (read-only, uncompressed: guest code under
TCG should not spend time decompressing) plus an initramfs holding a static busybox,
the kernel modules that mount the image, and ``/init``. Both are cached under a hash of
what went in (every file's path, size, mtime and link target, the kernel, the init
script; byte code in __pycache__ is packed but not hashed, since Python checks it
against its source anyway), and that hash is part of the lineage baseline id.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gym_fork
from gym_fork import progress
from gym_fork.hosts.microvm.cpio import write_newc
from gym_fork.hosts.microvm.kernel import Kernel, find_kernel
from gym_fork.hosts.microvm.paths import cache_root

FORMAT = 1  # bump when the layout of an image changes
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

INIT_SCRIPT = r"""#!/bin/busybox sh
# gym_fork guest init: mount the image under a writable layer, run the agent, power off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules/order); do
    insmod "/modules/$m" || echo "gym_fork init: insmod $m failed"
done
mount -t erofs -o ro /dev/vda /image || echo "gym_fork init: cannot mount the image"
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
if ! mount -t overlay root -o lowerdir=/image,upperdir=/rw/upper,workdir=/rw/work /newroot; then
    echo "gym_fork init: no overlay; the image stays read-only"
    mount --bind /image /newroot
fi
for d in proc sys dev tmp; do mkdir -p "/newroot/$d" 2>/dev/null; done
stty -F /dev/ttyS0 raw -echo 2>/dev/null
stty -F /dev/ttyS1 raw -echo 2>/dev/null
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
# /tmp is not a separate tmpfs: the image may hold code under /tmp (a checkout in
# /tmp/...), and the overlay's upper layer is in guest RAM already.
chmod 1777 /newroot/tmp 2>/dev/null || mount -t tmpfs -o mode=1777 tmp /newroot/tmp
export HOME=/tmp PYTHONPATH=@PACKAGE_ROOT@ PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
chroot /newroot @PYTHON@ -m gym_fork.hosts.microvm.agent >/newroot/dev/ttyS0 2>/newroot/dev/ttyS1
echo "gym_fork-guest-exit $?" >/newroot/dev/ttyS1
poweroff -f
"""


class ImageError(RuntimeError):
    """A guest image cannot be built; the message names the missing piece."""


@dataclass(frozen=True)
class GuestImage:
    """A built guest: root image, initramfs and kernel, and the interpreter to run."""

    digest: str
    root: Path
    initramfs: Path
    kernel: Kernel
    python: str
    files: int
    root_bytes: int


def images_dir() -> Path:
    return cache_root() / "images"


def _busybox() -> str:
    path = shutil.which("busybox")
    if path is None:
        raise ImageError("a guest image needs a static busybox: apt-get install busybox-static")
    with open(path, "rb") as f:
        dynamic = b"/lib64/ld-linux" in f.read(1 << 16)  # an ELF interpreter path: dynamic
    if dynamic:
        raise ImageError(f"{path} is dynamically linked: apt-get install busybox-static")
    return path


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

    def add_tree(self, root: str, skip: set[str] = frozenset(), prune: set[str] = frozenset()):
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
                st = os.stat(path)
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


def _collect_key(python: str) -> tuple:
    # Which sys.path entries exist too: one that appears is walked by a new collection.
    paths = tuple((entry, os.path.isdir(entry)) for entry in sys.path if entry)
    return (python, paths, os.getcwd(), sys.prefix, sys.base_prefix, PACKAGE_ROOT)


def _collect_memoised(python: str, force: bool = False) -> _Manifest:
    """:func:`_collect`, reused while :meth:`_Collected.still_valid` (never with
    ``force``)."""
    key = _collect_key(python)
    with _collected_lock:
        known = _collected.get(key)
    if known is not None and not force and known.still_valid():
        return known.manifest
    started = time.time_ns()
    manifest = _collect(python)
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


def _collect(python: str) -> _Manifest:
    manifest = _Manifest()
    manifest.add(python)
    prefix = sys.prefix
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stdlib = os.path.join(sys.base_prefix, "lib", version)
    manifest.add_tree(stdlib, skip=SKIP_STDLIB | {"site-packages", "dist-packages"})
    if prefix != sys.base_prefix:
        manifest.add_tree(prefix)
    else:
        for entry in sys.path:
            if entry.endswith(("site-packages", "dist-packages")):
                manifest.add_tree(entry)
    manifest.add_tree(PACKAGE_ROOT, prune={os.path.realpath(prefix)})
    for entry in [*sys.path, os.getcwd()]:
        if entry and os.path.isdir(entry) and not entry.startswith(stdlib):
            if any(entry.startswith(p) for p in (prefix, PACKAGE_ROOT)):
                continue
            manifest.add_tree(entry, prune={os.path.realpath(prefix)})
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
        if kind == "dir":
            dest.mkdir(parents=True, exist_ok=True)
        elif kind == "link":
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.is_symlink():
                os.symlink(value, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(value, dest)
            except OSError:
                shutil.copy2(value, dest)


def _initramfs(kernel: Kernel, python: str, out: Path) -> None:
    busybox = _busybox()
    modules = kernel.module_files()
    init = INIT_SCRIPT.replace("@PYTHON@", python).replace("@PACKAGE_ROOT@", PACKAGE_ROOT)
    entries: list[tuple[str, int, bytes | None, str | None]] = []
    for d in ("bin", "proc", "sys", "dev", "image", "rw", "newroot", "modules"):
        entries.append((d, stat.S_IFDIR | 0o755, None, None))
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes(), None))
    entries.append(("bin/sh", stat.S_IFLNK | 0o777, None, "busybox"))
    entries.append(("init", stat.S_IFREG | 0o755, init.encode(), None))
    for ko in modules:
        entries.append((f"modules/{ko.name}", stat.S_IFREG | 0o644, ko.read_bytes(), None))
    order = "".join(ko.name + "\n" for ko in modules).encode()
    entries.append(("modules/order", stat.S_IFREG | 0o644, order, None))
    with open(out, "wb") as f:
        write_newc(f, entries)


def build_image(*, force: bool = False, log=None, quiet: bool = False) -> GuestImage:
    """The guest image for this interpreter and ``sys.path``, built once and cached
    (with progress bars on a terminal unless ``quiet``)."""
    say = log or (lambda _msg: None)
    kernel = find_kernel()
    python = sys.executable
    if not shutil.which("mkfs.erofs"):
        raise ImageError("building a guest image needs mkfs.erofs: apt-get install erofs-utils")
    with progress.task("collecting the Python environment", quiet=quiet, delay=1.0):
        manifest = _collect_memoised(python, force)
    digest = manifest.digest(
        [
            f"format {FORMAT}",
            str(kernel.vmlinuz),
            str(os.stat(kernel.vmlinuz).st_mtime_ns),
            INIT_SCRIPT,
            python,
            PACKAGE_ROOT,
        ]
    )
    target = images_dir() / digest
    meta_path = target / "image.json"
    if meta_path.exists() and not force:
        meta = json.loads(meta_path.read_text())
        return _image(digest, target, kernel, python, meta)
    images_dir().mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=images_dir(), prefix=".build-") as tmp:
        staging = Path(tmp) / "root"
        with progress.task("guest image: staging files", len(manifest.entries), quiet=quiet) as bar:
            _stage(manifest, staging, bar)
        root = Path(tmp) / "root.erofs"
        with progress.task("guest image: mkfs.erofs", quiet=quiet):
            made = subprocess.run(
                ["mkfs.erofs", "--quiet", "-T0", "-x-1", str(root), str(staging)],
                capture_output=True,
                text=True,
            )
        if made.returncode != 0:
            raise ImageError(f"mkfs.erofs failed: {made.stderr.strip()}")
        _initramfs(kernel, python, Path(tmp) / "initramfs.cpio")
        files = sum(1 for kind, _ in manifest.entries.values() if kind == "file")
        meta = {"files": files, "root_bytes": root.stat().st_size, "kernel": kernel.version}
        (Path(tmp) / "image.json").write_text(json.dumps(meta))
        shutil.rmtree(staging)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(target)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
        os.mkdir(tmp)  # TemporaryDirectory removes it again
    say(
        f"built guest image {digest}: {files} files, {meta['root_bytes'] >> 20} MiB "
        f"in {time.perf_counter() - started:.1f} s"
    )
    _prune_images(keep=target)
    return _image(digest, target, kernel, python, meta)


# Guest images kept in the cache (each ~1.5 GB; a new one is built whenever the code or
# environment it packs changes). Older ones go, but never one touched in the last minutes
# (another process may be about to start a VM from it; a running QEMU holds its files open).
KEEP_IMAGES = 3
PRUNE_AFTER_S = 600.0


def _prune_images(keep: Path) -> list[Path]:
    """Remove all but the KEEP_IMAGES newest images (``keep`` always stays)."""
    try:
        found = [p for p in images_dir().iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    removed = []
    now = time.time()
    for path in found[KEEP_IMAGES:]:
        if path == keep or now - path.stat().st_mtime < PRUNE_AFTER_S:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _image(digest: str, target: Path, kernel: Kernel, python: str, meta: dict) -> GuestImage:
    return GuestImage(
        digest,
        target / "root.erofs",
        target / "initramfs.cpio",
        kernel,
        python,
        meta["files"],
        meta["root_bytes"],
    )

"""Guest images: the host's Python environment packed read-only for a microVM.

``build_image()`` collects the interpreter, its standard library, the installed
packages this process imports and what they require (:mod:`.selection`: not the whole
virtual env), gym_fork, the other directories on ``sys.path``, and the shared libraries
all of them load, at the same absolute paths as on the host. They become an erofs
image (read-only, uncompressed: guest code under TCG should not spend time
decompressing) plus an initramfs holding a static busybox, the kernel modules that
mount the image, and ``/init``. Both are cached under a hash of
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
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import gym_fork
from gym_fork import progress
from gym_fork.hosts.microvm import image_cache
from gym_fork.hosts.microvm.cpio import write_newc
from gym_fork.hosts.microvm.image_cache import images_dir
from gym_fork.hosts.microvm.kernel import Kernel, find_kernel
from gym_fork.hosts.microvm.paths import cache_root
from gym_fork.hosts.microvm.selection import Selection, select

FORMAT = 2  # bump when the layout of an image changes
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
    distributions: tuple[str, ...] = ()  # what it packs of the installed packages


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


# Packing rate of the last builds here when none is recorded yet (staging by hard links
# plus an uncompressed mkfs.erofs; measured on the project's 2-core machine).
DEFAULT_PACK_MIB_S = 60.0


@dataclass(frozen=True)
class ImagePlan:
    """What :func:`build_image` would pack now, found without writing anything."""

    digest: str
    selection: Selection
    files: int
    packed_bytes: int  # the files' sizes: about the root image's size
    kernel: Kernel
    python: str
    manifest: _Manifest = field(repr=False, compare=False)

    @property
    def target(self) -> Path:
        return images_dir() / self.digest

    @property
    def cached(self) -> bool:
        return (self.target / "image.json").exists()

    def guest_image(self, meta: dict | None = None) -> GuestImage:
        """The image at this plan's paths (``meta``: its image.json once built)."""
        meta = meta or {}
        return GuestImage(
            self.digest,
            self.target / "root.erofs",
            self.target / "initramfs.cpio",
            self.kernel,
            self.python,
            meta.get("files", self.files),
            meta.get("root_bytes", self.packed_bytes),
            tuple(meta.get("distributions", self.selection.distributions)),
        )

    def estimate_s(self) -> float:
        """Seconds a build would take, at the rate the cached images were built at."""
        rates = []
        for path in image_cache.images_by_use():
            with contextlib.suppress(OSError, ValueError, KeyError, ZeroDivisionError):
                meta = json.loads((path / "image.json").read_text())
                rates.append(meta["packed_bytes"] / meta["build_s"] / 2**20)
        rate = sorted(rates)[len(rates) // 2] if rates else DEFAULT_PACK_MIB_S
        return self.packed_bytes / 2**20 / max(rate, 1e-3)


def plan_image(selection: Selection | None = None, *, force: bool = False) -> ImagePlan:
    """The image this process would use (the packages it imports, :mod:`.selection`),
    its digest and size; reads the environment and the cache, writes nothing."""
    kernel = find_kernel()
    python = sys.executable
    selection = select() if selection is None else selection
    manifest = _collect_memoised(python, selection, force)
    digest = manifest.digest(
        [
            f"format {FORMAT}",
            str(kernel.vmlinuz),
            str(os.stat(kernel.vmlinuz).st_mtime_ns),
            INIT_SCRIPT,
            python,
            PACKAGE_ROOT,
            f"everything {selection.everything}",
            *selection.distributions,
        ]
    )
    files = 0
    packed = 0
    for path, (kind, _) in manifest.entries.items():
        if kind == "file":
            files += 1
            with contextlib.suppress(OSError):
                packed += os.stat(path).st_size
    return ImagePlan(digest, selection, files, packed, kernel, python, manifest)


def _covering(plan: ImagePlan, tries: int = 2) -> list[ImagePlan]:
    """Cached images (most recently used first) that pack everything ``plan`` does and
    are still current: a process that imports less reuses a bigger image, instead of
    building (and booting) one more."""
    found: list[ImagePlan] = []
    for path in reversed(image_cache.images_by_use()):
        if len(found) >= tries or path.name == plan.digest:
            continue
        try:
            meta = json.loads((path / "image.json").read_text())
            theirs = Selection(
                bool(meta["everything"]),
                tuple(meta["site_dirs"]),
                tuple(meta["distributions"]),
                tuple(meta["entries"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        ours = plan.selection
        if (
            meta.get("format") != FORMAT
            or theirs.site_dirs != ours.site_dirs
            or theirs.everything != ours.everything
            or not set(ours.entries) <= set(theirs.entries)
        ):
            continue
        candidate = plan_image(theirs)
        if candidate.digest == path.name:
            found.append(candidate)
    return found


def build_image(
    *, force: bool = False, log=None, quiet: bool = False, selection: Selection | None = None
) -> GuestImage:
    """The guest image for this interpreter, ``sys.path`` and the packages this process
    imports (or ``selection``), built once and cached (with progress bars on a terminal
    unless ``quiet``); the cache is then evicted down to its bound. A user of the image
    holds it (:func:`.image_cache.hold`) so that no other process evicts it meanwhile."""
    say = log or (lambda _msg: None)
    if not shutil.which("mkfs.erofs"):
        raise ImageError("building a guest image needs mkfs.erofs: apt-get install erofs-utils")
    with progress.task("collecting the Python environment", quiet=quiet, delay=1.0):
        plan = plan_image(selection, force=force)
        candidates = [] if force else [plan] if plan.cached else [plan, *_covering(plan)]
    for candidate in candidates:
        with contextlib.suppress(OSError, ValueError):  # evicted meanwhile: build it
            meta = json.loads((candidate.target / "image.json").read_text())
            image_cache.touch(candidate.target)
            return candidate.guest_image(meta)
    target = plan.target
    manifest = plan.manifest
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
        _initramfs(plan.kernel, plan.python, Path(tmp) / "initramfs.cpio")
        meta = {
            "format": FORMAT,
            "files": plan.files,
            "root_bytes": root.stat().st_size,
            "packed_bytes": plan.packed_bytes,
            "build_s": round(time.perf_counter() - started, 3),
            "kernel": plan.kernel.version,
            "everything": plan.selection.everything,
            "site_dirs": list(plan.selection.site_dirs),
            "distributions": list(plan.selection.distributions),
            "entries": list(plan.selection.entries),
        }
        (Path(tmp) / "image.json").write_text(json.dumps(meta))
        shutil.rmtree(staging)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(target)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
        os.mkdir(tmp)  # TemporaryDirectory removes it again
    image_cache.touch(target)
    say(
        f"built guest image {plan.digest}: {plan.files} files, {meta['root_bytes'] >> 20} MiB "
        f"in {time.perf_counter() - started:.1f} s ({plan.selection.describe()})"
    )
    image_cache.evict(keep=target)
    return plan.guest_image(meta)

"""Guest images: the host's Python environment packed read-only for a microVM.

``build_image()`` packs the erofs root (:mod:`.root`: what this process imports and
needs, chosen by :mod:`.selection`) uncompressed (guest code under TCG should not spend
time decompressing), plus the initramfs (:mod:`.initramfs`). Both are cached
(:mod:`.image_cache`) under a hash of what went in (every file's path, size, mtime and
link target, the kernel, the init script), and that hash is part of the lineage
baseline id. ``plan_image()`` says what a build would pack, writing nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gym_fork import progress
from gym_fork.hosts.microvm.building import image_cache
from gym_fork.hosts.microvm.building.image_cache import images_dir
from gym_fork.hosts.microvm.building.initramfs import INIT_SCRIPT, ImageError, _initramfs
from gym_fork.hosts.microvm.building.kernel import Kernel, find_kernel
from gym_fork.hosts.microvm.building.root import PACKAGE_ROOT, _collect_memoised, _Manifest, _stage
from gym_fork.hosts.microvm.building.selection import Selection, select

FORMAT = 2  # bump when the layout of an image changes


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

"""The guest kernel: a distro kernel and the few modules the guest needs from it.

Looked up, in order: ``GYM_FORK_VM_KERNEL`` (a vmlinuz; its modules are found under
``GYM_FORK_VM_MODULES`` or next to it as ``../lib/modules/VERSION``), a Debian kernel
unpacked into the cache by :func:`fetch_debian_kernel` (``gym-fork image kernel``), then
the host's own ``/boot/vmlinuz-$(uname -r)`` where it is readable.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gym_fork import knobs, progress
from gym_fork.hosts.microvm.paths import cache_root

# What the guest loads from the kernel's modules, in dependency order (resolved from
# each .ko's own "depends=" at build time): virtio PCI and block for the root image,
# erofs to read it, overlay for a writable layer over it; virtio_console for the
# doorbell measurement (benchmarks/doorbell_probe.py). Built-in ones are skipped.
GUEST_MODULES = ("virtio_pci", "virtio_blk", "erofs", "overlay", "virtio_console")
# Dependencies the kernel asks for by name at run time, not in "depends=".
SOFT_DEPENDENCIES = {"libcrc32c": ["crc32c_generic"]}


class KernelNotFound(RuntimeError):
    """No guest kernel is available; the message says how to get one."""


@dataclass(frozen=True)
class Kernel:
    """A bootable kernel image and the modules directory that matches it."""

    vmlinuz: Path
    modules: Path  # .../lib/modules/VERSION
    version: str

    def module_files(self) -> list[Path]:
        """The .ko files of GUEST_MODULES and their dependencies, dependencies first."""
        builtin = self._builtin()
        index = {p.name.removesuffix(".ko"): p for p in self.modules.rglob("*.ko")}
        ordered: list[Path] = []
        seen: set[str] = set()

        def visit(name: str) -> None:
            name = name.replace("-", "_")
            if name in seen or name in builtin:
                return
            seen.add(name)
            path = index.get(name)
            if path is None:
                raise KernelNotFound(
                    f"kernel {self.version}: module {name!r} is neither built in nor in "
                    f"{self.modules}"
                )
            for dep in _depends(path) + SOFT_DEPENDENCIES.get(name, []):
                visit(dep)
            ordered.append(path)

        for name in GUEST_MODULES:
            visit(name)
        return ordered

    def _builtin(self) -> set[str]:
        listing = self.modules / "modules.builtin"
        if not listing.exists():
            return set()
        return {Path(line.strip()).name.removesuffix(".ko") for line in listing.open()}


def _depends(ko: Path) -> list[str]:
    match = re.search(rb"depends=([A-Za-z0-9_,-]*)\x00", ko.read_bytes())
    if not match or not match.group(1):
        return []
    return match.group(1).decode().split(",")


def kernels_dir() -> Path:
    return cache_root() / "kernels"


def find_kernel() -> Kernel:
    """The guest kernel to use (see the module docstring), or KernelNotFound."""
    given = knobs.given("GYM_FORK_VM_KERNEL")
    if given:
        vmlinuz = Path(given)
        version = _version_of(vmlinuz)
        modules = Path(
            knobs.given("GYM_FORK_VM_MODULES")
            or vmlinuz.parent.parent / "lib" / "modules" / version
        )
        if not vmlinuz.is_file() or not modules.is_dir():
            raise KernelNotFound(
                f"GYM_FORK_VM_KERNEL={given}: needs a readable vmlinuz and its modules at "
                f"{modules} (or set GYM_FORK_VM_MODULES)"
            )
        return Kernel(vmlinuz, modules, version)
    unpacked = sorted(kernels_dir().glob("*/boot/vmlinuz-*"))
    if unpacked:
        vmlinuz = unpacked[-1]
        version = _version_of(vmlinuz)
        return Kernel(vmlinuz, vmlinuz.parent.parent / "lib" / "modules" / version, version)
    release = os.uname().release
    host = Path(f"/boot/vmlinuz-{release}")
    if os.access(host, os.R_OK) and Path(f"/lib/modules/{release}").is_dir():
        return Kernel(host, Path(f"/lib/modules/{release}"), release)
    raise KernelNotFound(
        "no guest kernel: run `gym-fork image kernel` (downloads Debian's linux-image "
        "with apt-get and unpacks it into the cache), or set GYM_FORK_VM_KERNEL to a "
        "vmlinuz whose modules are in ../lib/modules/VERSION"
    )


def _version_of(vmlinuz: Path) -> str:
    return vmlinuz.name.removeprefix("vmlinuz-")


def fetch_debian_kernel(*, quiet: bool = False) -> Kernel:
    """``apt-get download`` Debian's current linux-image and unpack it into the cache
    (with a progress bar on a terminal unless ``quiet``)."""
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        raise KernelNotFound("fetching a kernel needs apt-get and dpkg (a Debian host)")
    depends = subprocess.run(
        ["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True, check=True
    ).stdout
    names = re.findall(r"Depends: (linux-image-[0-9][^\s]*-amd64)\b", depends)
    if not names:
        raise KernelNotFound(f"apt-cache names no kernel for linux-image-amd64:\n{depends}")
    package = names[0]
    target = kernels_dir() / package
    if not list(target.glob("boot/vmlinuz-*")):
        kernels_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=kernels_dir()) as tmp:
            _download(package, tmp, quiet)
            (deb,) = Path(tmp).glob("*.deb")
            unpacked = Path(tmp) / "root"
            with progress.task(f"unpacking {package}", quiet=quiet):
                subprocess.run(["dpkg", "-x", str(deb), str(unpacked)], check=True)
            if target.exists():
                shutil.rmtree(target)
            unpacked.rename(target)
    return find_kernel()


def _download(package: str, directory: str, quiet: bool) -> None:
    """``apt-get download package`` into ``directory``; the bar follows the bytes that
    arrive there against the size apt-cache announces."""
    shown = subprocess.run(["apt-cache", "show", package], capture_output=True, text=True)
    size = re.search(r"^Size: (\d+)", shown.stdout, re.MULTILINE)
    total = (int(size.group(1)) >> 20 or None) if size else None
    with (
        progress.task(f"downloading {package} (MiB)", total, quiet=quiet) as bar,
        tempfile.TemporaryFile() as output,  # a file, not a pipe: apt-get never blocks on it
    ):
        proc = subprocess.Popen(
            ["apt-get", "download", "-q", package],
            cwd=directory,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        while True:
            try:
                proc.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                bar.update(completed=_bytes_under(Path(directory)) >> 20)
        if proc.returncode != 0:
            output.seek(0)
            raise subprocess.CalledProcessError(proc.returncode, proc.args, output.read())


def _bytes_under(directory: Path) -> int:
    total = 0
    for path in directory.rglob("*"):
        with contextlib.suppress(OSError):  # renamed or removed by apt-get meanwhile
            total += path.stat().st_size if path.is_file() else 0
    return total

"""What the microVM host needs from this machine, and what is missing."""

from __future__ import annotations

import shutil

from gym_fork.hosts.microvm.building.kernel import KernelNotFound, find_kernel
from gym_fork.hosts.microvm.machine import qemu_binary

INSTALL_HINT = (
    "apt-get install qemu-system-x86 busybox-static erofs-utils, then `gym-fork image "
    "kernel` (or run tools/install-microvm-deps.sh)"
)


def missing_requirements() -> list[str]:
    """One line per missing piece (empty: the microVM host can run here)."""
    missing = []
    if qemu_binary() is None:
        missing.append("QEMU (qemu-system-x86_64)")
    if shutil.which("busybox") is None:
        missing.append("a static busybox (busybox-static)")
    if shutil.which("mkfs.erofs") is None:
        missing.append("mkfs.erofs (erofs-utils)")
    try:
        find_kernel()
    except KernelNotFound as exc:
        missing.append(f"a guest kernel ({exc})")
    return missing

"""The initramfs of a guest image: a static busybox, the kernel modules that mount the
erofs root, and ``/init``, which mounts it under a writable layer and runs the agent."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

from gym_fork.hosts.microvm.building.cpio import write_newc
from gym_fork.hosts.microvm.building.kernel import Kernel
from gym_fork.hosts.microvm.building.root import PACKAGE_ROOT

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


def _busybox() -> str:
    path = shutil.which("busybox")
    if path is None:
        raise ImageError("a guest image needs a static busybox: apt-get install busybox-static")
    with open(path, "rb") as f:
        dynamic = b"/lib64/ld-linux" in f.read(1 << 16)  # an ELF interpreter path: dynamic
    if dynamic:
        raise ImageError(f"{path} is dynamically linked: apt-get install busybox-static")
    return path


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

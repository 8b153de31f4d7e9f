"""Linux namespaces and mounts through libc (unshare, mount, sethostname)."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    """unshare(2) the namespaces in ``flags`` for this process."""
    _check(_libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None):
    """mount(2)."""
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            flags,
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def mount_own_proc() -> None:
    """Cover /proc with a procfs of the caller's pid namespace (call from its pid 1, in
    a private mount namespace): processes outside the namespace disappear from view."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def make_mounts_private() -> None:
    """Stop mount events propagating between this namespace and the host's."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")


_SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_MOVE_MOUNT = 430, 431, 432, 429  # x86_64/arm64
_FSCONFIG_CMD_CREATE = 6
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_AT_FDCWD = -100


def new_tmpfs() -> int:
    """A fresh, detached tmpfs (new mount API): an fd to fill, then :func:`attach_mount`."""
    fs = _libc.syscall(_SYS_FSOPEN, b"tmpfs", 0)
    if fs < 0:
        _check(-1, "fsopen tmpfs")
    try:
        _check(_libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig")
        mount_fd = _libc.syscall(_SYS_FSMOUNT, fs, 0, 0)
        if mount_fd < 0:
            _check(-1, "fsmount")
        return mount_fd
    finally:
        os.close(fs)


def attach_mount(mount_fd: int, target: str) -> None:
    """Put a detached mount (from :func:`new_tmpfs`) on ``target`` and close its fd."""
    try:
        _check(
            _libc.syscall(
                _SYS_MOVE_MOUNT,
                mount_fd,
                b"",
                _AT_FDCWD,
                target.encode(),
                _MOVE_MOUNT_F_EMPTY_PATH,
            ),
            f"move_mount {target}",
        )
    finally:
        os.close(mount_fd)


def overlay_private_layer(target: str) -> int:
    """Cover ``target`` with an overlay whose lower layer is what ``target`` shows now and
    whose upper layer (the only place writes go) is a fresh, detached tmpfs. Returns an fd
    of that tmpfs (its ``upper`` directory holds exactly the private writes); the caller
    keeps it open to read them, or closes it."""
    mount_fd = new_tmpfs()
    try:
        layer = f"/proc/self/fd/{mount_fd}"
        os.mkdir(f"{layer}/upper", 0o1777)
        os.mkdir(f"{layer}/work", 0o700)
        os.chmod(f"{layer}/upper", 0o1777)  # /tmp's mode, whatever the umask
        mount(
            "overlay",
            target,
            "overlay",
            MS_NOSUID | MS_NODEV,
            f"lowerdir={target},upperdir={layer}/upper,workdir={layer}/work",
        )
    except BaseException:
        os.close(mount_fd)
        raise
    return mount_fd

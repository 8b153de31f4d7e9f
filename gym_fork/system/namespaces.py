"""Linux namespaces and mounts through libc (unshare, mount, sethostname)."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000

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


# x86_64 and arm64 share these numbers (the new mount API is in the generic table).
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 428, 429, 430, 431, 432
_SYS_MOUNT_SETATTR = 442
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOVE_MOUNT_T_EMPTY_PATH = 0x40
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def set_mount_attributes(
    target: str | int, *, recursive: bool, set_: int = 0, clear: int = 0
) -> None:
    """mount_setattr(2) on the mount at path ``target`` (or a detached mount's fd)."""
    attr = _MountAttr(set_, clear, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    if isinstance(target, int):
        dfd, path, flags = target, b"", flags | _AT_EMPTY_PATH
    else:
        dfd, path = _AT_FDCWD, target.encode()
    rc = _libc.syscall(_SYS_MOUNT_SETATTR, dfd, path, flags, ctypes.byref(attr), 32)
    _check(0 if rc == 0 else -1, f"mount_setattr {target}")


def clone_mount(path: str, recursive: bool = True) -> int:
    """A detached copy of the mount(s) at ``path`` (open_tree(OPEN_TREE_CLONE)): an fd
    to change with :func:`set_mount_attributes` and put somewhere with
    :func:`attach_mount`."""
    flags = OPEN_TREE_CLONE | (_AT_RECURSIVE if recursive else 0) | os.O_CLOEXEC
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, path.encode(), flags)
    if fd < 0:
        _check(-1, f"open_tree {path}")
    return fd


def clone_mount_of(dir_fd: int) -> int:
    """:func:`clone_mount` (recursive) of the directory an fd holds: what the fd was
    opened on, however its path has changed since."""
    flags = OPEN_TREE_CLONE | _AT_EMPTY_PATH | _AT_RECURSIVE | os.O_CLOEXEC
    fd = _libc.syscall(_SYS_OPEN_TREE, dir_fd, b"", flags)
    if fd < 0:
        _check(-1, f"open_tree fd {dir_fd}")
    return fd


def bind_read_only(path: str) -> None:
    """Cover ``path`` with a read-only copy of the mount that shows it now."""
    fd = clone_mount(path, recursive=True)
    try:
        set_mount_attributes(fd, recursive=True, set_=MOUNT_ATTR_RDONLY)
    except BaseException:
        os.close(fd)
        raise
    attach_mount(fd, path)


def new_tmpfs(size_bytes: int | None = None) -> int:
    """A fresh, detached tmpfs (new mount API), at most ``size_bytes`` big (None: the
    kernel's default, half the RAM): an fd to fill, then :func:`attach_mount`."""
    fs = _libc.syscall(_SYS_FSOPEN, b"tmpfs", 0)
    if fs < 0:
        _check(-1, "fsopen tmpfs")
    try:
        if size_bytes is not None:
            rc = _libc.syscall(
                _SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, b"size", str(size_bytes).encode(), 0
            )
            _check(0 if rc == 0 else -1, "fsconfig size")
        _check(_libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig")
        # nosuid, nodev: nothing in a private layer is a device or gains privileges.
        mount_fd = _libc.syscall(_SYS_FSMOUNT, fs, 0, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
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


def detach_mount(target: str) -> None:
    """umount2(``target``, MNT_DETACH): the mount leaves the tree now, and goes once
    nothing uses it any more."""
    _check(_libc.umount2(target.encode(), 2), f"umount {target}")


def attach_mount_on(mount_fd: int, target_fd: int, what: str) -> None:
    """:func:`attach_mount` on the directory an fd holds (``what`` names it in errors)."""
    flags = _MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH
    try:
        rc = _libc.syscall(_SYS_MOVE_MOUNT, mount_fd, b"", target_fd, b"", flags)
        _check(rc, f"move_mount {what}")
    finally:
        os.close(mount_fd)


def overlay_private_layer(
    target: str,
    size_bytes: int | None = None,
    lower: str | None = None,
    fill=None,
    in_user_namespace: bool = False,
) -> int:
    """Cover ``target`` with an overlay whose lower layer is ``lower`` (default: what
    ``target`` shows now) and whose upper layer (the only place writes go) is a fresh,
    detached tmpfs of at most ``size_bytes``; ``fill(upper)`` may put files in the upper
    layer first (a clone's copy of its source's writes). Returns an fd of that tmpfs (its
    ``upper`` directory holds exactly the private writes); the caller keeps it open to
    read them, or closes it."""
    mount_fd = new_tmpfs(size_bytes)
    try:
        layer = f"/proc/self/fd/{mount_fd}"
        os.mkdir(f"{layer}/upper", 0o1777)
        os.mkdir(f"{layer}/work", 0o700)
        os.chmod(f"{layer}/upper", 0o1777)  # /tmp's mode, whatever the umask
        if fill is not None:
            fill(f"{layer}/upper")
        options = f"lowerdir={lower or target},upperdir={layer}/upper,workdir={layer}/work"
        if in_user_namespace:
            options += ",userxattr"  # trusted.* xattrs need root of the host's namespace
        mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, options)
    except BaseException:
        os.close(mount_fd)
        raise
    return mount_fd

"""Directories reached through no symlink: how the host binds ``writable_paths`` (and
finds the caller's working directory in a sandbox) without following a link that a
sandbox may have planted where it could write."""

from __future__ import annotations

import ctypes
import errno
import os
import stat

_SYS_OPENAT2 = 437  # x86_64 and arm64 (the generic table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_AT_FDCWD = -100
_DIRECTORY_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC

_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class SymlinkInPath(ValueError):
    """A path that goes through a symlink, refused: names the link and the real path."""

    def __init__(self, path: str, link: str) -> None:
        try:
            points_to = f" (-> {os.readlink(link)!r})"
        except OSError:
            points_to = ""
        super().__init__(
            f"{path!r} goes through the symlink {link!r}{points_to}, and no symlink is "
            f"followed here (a sandbox may have planted it): pass the real path, "
            f"{os.path.realpath(path)!r}, if that is the directory you mean"
        )
        self.path, self.link = path, link


def absolute(path: str | os.PathLike) -> str:
    """``path`` made absolute against the working directory, lexically (no symlink is
    resolved: ``..`` removes the component before it, as the caller wrote it)."""
    return os.path.abspath(os.fspath(path))


def open_directory(path: str) -> int:
    """An O_PATH fd of the directory at absolute ``path``, reached through no symlink
    (openat2 with RESOLVE_NO_SYMLINKS, or a walk from "/" where the kernel lacks it).
    Raises :class:`SymlinkInPath` naming the first symlink, NotADirectoryError or
    FileNotFoundError."""
    if not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")
    how = _OpenHow(_DIRECTORY_FLAGS, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, _AT_FDCWD, path.encode(), ctypes.byref(how), 24)
    if fd >= 0:
        return fd
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.ELOOP, errno.EPERM):
        # No openat2 (or a filter refusing it), or a symlink: the walk finds which.
        return _walk(path)
    raise OSError(code, os.strerror(code))


def _walk(path: str) -> int:
    """:func:`open_directory` one component at a time (O_PATH|O_NOFOLLOW from "/")."""
    fd = os.open("/", _DIRECTORY_FLAGS)
    walked = ""
    try:
        for name in os.path.normpath(path).split("/"):
            if not name:
                continue
            walked += "/" + name
            child = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                raise SymlinkInPath(path, walked)
            if not stat.S_ISDIR(mode):
                raise NotADirectoryError(errno.ENOTDIR, f"not a directory: {walked!r}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def enter(path: str) -> bool:
    """chdir to the directory at ``path`` as :func:`open_directory` reaches it (the top
    mount there, one bound after the process entered it included); False, staying where
    it is, if there is none."""
    try:
        fd = open_directory(path)
    except (OSError, ValueError):
        return False
    try:
        os.fchdir(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True

"""Copying a sandbox's private files into a new one (a clone's /tmp and /dev/shm).

What it copies was written by an env, possibly a hostile one: the walk is iterative (no
recursion limit for a deep tree), stays on one file system (other mounts are not its
files), never follows a symlink (it is recreated as a link), skips devices, fifos and
sockets (a fifo would block the copy), keeps holes (a 1 GiB sparse file costs what it
holds, not 1 GiB of the clone's layer) and hard links (one file stays one file). Copying
an overlay's upper layer (a source's writes over frozen layers or the tree's /tmp), it
keeps what hides the layers below: whiteouts (a file removed) and opaque directories (a
directory removed and made again), or the copy would show what its source removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable

from gym_fork.system import procmaps
from gym_fork.system.linux import data_extents

_CHUNK = 1 << 20


# An overlay marks a directory opaque with one of these (trusted.* by the host's root;
# user.* with ``userxattr``, what a clone's overlay in its user namespace reads).
_OPAQUE_READ = ("user.overlay.opaque", "trusted.overlay.opaque")
_OPAQUE_WRITTEN = "user.overlay.opaque"


def copy_tree(source: str, target: str, skip: Iterable[str] = (), layer: bool = False) -> None:
    """Copy the entries of directory ``source`` into the existing directory ``target``,
    but the top-level names in ``skip``. ``layer``: ``source`` is an overlay's upper
    layer, copied for an overlay with ``userxattr``: its whiteouts and opaque
    directories too. Raises OSError (ENOSPC when ``target`` is full; a directory that
    cannot be marked opaque here)."""
    try:
        device = os.lstat(source).st_dev
    except OSError:
        return  # missing: nothing to copy
    skipped = set(skip)
    links: dict[int, str] = {}  # inode -> the copy made of it
    directories: list[tuple[str, os.stat_result]] = []  # their modes: set last
    pending = [(source, target, True)]
    while pending:
        src_dir, dst_dir, top = pending.pop()
        try:
            entries = list(os.scandir(src_dir))
        except OSError:
            continue
        for entry in entries:
            if top and entry.name in skipped:
                continue
            src, dst = entry.path, os.path.join(dst_dir, entry.name)
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if info.st_dev != device:
                continue  # another mount
            mode = info.st_mode
            if stat.S_ISDIR(mode):
                os.makedirs(dst, exist_ok=True)
                if layer:
                    _copy_opaque(src, dst)
                pending.append((src, dst, False))
                directories.append((dst, info))
            elif stat.S_ISLNK(mode):
                # FileNotFoundError: removed since it was listed (a thread of the source's
                # went on): not copied, as if listed a moment later.
                with contextlib.suppress(FileExistsError, FileNotFoundError):
                    os.symlink(os.readlink(src), dst)
            elif stat.S_ISREG(mode):
                if info.st_nlink > 1 and info.st_ino in links:
                    os.link(links[info.st_ino], dst)
                    continue
                try:
                    _copy_file(src, dst, info)
                except OSError:
                    if _changed_since(src, info):
                        continue  # removed or replaced since it was listed (a whiteout...)
                    raise
                if info.st_nlink > 1:
                    links[info.st_ino] = dst
            elif layer and stat.S_ISCHR(mode) and info.st_rdev == 0:  # a whiteout
                with contextlib.suppress(FileExistsError):
                    os.mknod(dst, stat.S_IFCHR, 0)  # any user may make one (Linux 5.8+)
            # other devices, fifos, sockets: not copied
    for path, info in reversed(directories):  # a read-only directory is filled first
        _copy_metadata(path, info)


def _copy_opaque(src: str, dst: str) -> None:
    """Mark ``dst`` opaque where the overlay marked ``src`` so (its lower layers' entries
    hidden: a directory removed and made again)."""
    for name in _OPAQUE_READ:
        try:
            value = os.getxattr(src, name, follow_symlinks=False)
        except OSError:
            continue  # not marked, or not ours to read (trusted.*)
        try:
            os.setxattr(dst, _OPAQUE_WRITTEN, value, follow_symlinks=False)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"{src} hides what the layers below it hold (an overlay's opaque directory) "
                f"and its copy cannot be marked so ({exc.strerror}; tmpfs keeps user.* "
                "xattrs from Linux 6.6)",
            ) from exc
        return


def _changed_since(path: str, info: os.stat_result) -> bool:
    """Is ``path`` gone, or another file than the one ``info`` describes (a thread of the
    source's removed it, or replaced it: an overlay shows a removed file of a lower layer
    as a whiteout, a device that cannot be opened)?"""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return True
    same = (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode))
    return same != (info.st_dev, info.st_ino, stat.S_IFMT(info.st_mode))


def _copy_file(src: str, dst: str, info: os.stat_result) -> None:
    """Copy the regular file ``src`` listed as ``info`` (OSError if what opens is not it:
    the caller skips what changed since it was listed)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    src_fd = os.open(src, flags)
    try:
        now = os.fstat(src_fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            raise FileNotFoundError(errno.ENOENT, "replaced since it was listed", src)
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _copy_data(src_fd, dst_fd, info.st_size)
            os.ftruncate(dst_fd, info.st_size)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    _copy_metadata(dst, info)


def _copy_data(src_fd: int, dst_fd: int, size: int) -> None:
    """The data segments of ``src_fd`` at the same offsets (holes stay holes)."""
    for start, end in data_extents(src_fd, size):
        offset = start
        while offset < end:
            data = os.pread(src_fd, min(_CHUNK, end - offset), offset)
            if not data:
                return  # shrunk while being copied
            os.pwrite(dst_fd, data, offset)
            offset += len(data)


def _copy_metadata(dst: str, info: os.stat_result) -> None:
    with contextlib.suppress(OSError):
        os.chmod(dst, stat.S_IMODE(info.st_mode), follow_symlinks=False)
    with contextlib.suppress(OSError):
        os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns), follow_symlinks=False)
    with contextlib.suppress(OSError):  # an owner this namespace cannot map stays ours
        os.chown(dst, info.st_uid, info.st_gid, follow_symlinks=False)


PRIVATE_PREFIXES = ("/tmp/", "/dev/shm/")
OWN_MEMFDS = "/memfd:gym_fork-"  # a sandbox's channel and slab: each clone gets its own
_KEPT_FLAGS = os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_DSYNC | os.O_SYNC | os.O_DIRECT


def private_files(
    prefixes: tuple[str, ...] = PRIVATE_PREFIXES, skip: frozenset[int] = frozenset()
) -> tuple[list, list[str]]:
    """The fds of this process open on files in /tmp or /dev/shm, as [(fd, path)], and
    those no clone can reopen (deleted, O_TMPFILE). Listed once by a source before it
    forks clones (they inherit the same fds), not once in every clone. ``skip``: fds
    known to be none of those (the clones' channels and sockets a FORK brought, five a
    clone: one readlink each otherwise)."""
    files, stuck = [], []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in skip:
            continue
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd, or closed meanwhile
        if not path.startswith(prefixes):
            continue
        if path.endswith(" (deleted)"):
            stuck.append(path)
        else:
            files.append((fd, path))
    return files, stuck


def reopen_copied_files(files: list) -> tuple[int, list[str]]:
    """In a clone whose /tmp and /dev/shm are now copies (or a source whose /tmp is now a
    new layer over its frozen writes): point each of ``files`` (from
    :func:`private_files`) at the file the path shows now, same flags and offset, so
    that writing through it changes this process's file, not another's. Directories
    too: a file created through an fd of one lands where the fd points. Returns (fds
    reopened, paths that could not be)."""
    reopened, stuck = 0, []
    for fd, path in files:
        try:
            before = os.fstat(fd)
            directory = stat.S_ISDIR(before.st_mode)
            if not (directory or stat.S_ISREG(before.st_mode)):
                continue
            flags, position = _fd_flags_and_position(fd)
            keep = os.O_RDONLY | os.O_DIRECTORY if directory else flags & _KEPT_FLAGS
            new = os.open(path, keep | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            stuck.append(path)
            continue
        try:
            if new == fd:  # closed meanwhile (a thread of its): its number was free again
                continue
            after = os.fstat(new)
            if (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino):
                continue  # the same file (a read-only one of the host's, below the layers)
            if position and not directory:
                os.lseek(new, position, os.SEEK_SET)
            os.dup2(new, fd, inheritable=not flags & os.O_CLOEXEC)
            reopened += 1
        finally:
            os.close(new)
    return reopened, stuck


def opened_for_writing(fd: int) -> bool:
    """Whether this process's ``fd`` was opened for writing (True where it cannot tell)."""
    try:
        flags, _position = _fd_flags_and_position(fd)
    except (OSError, ValueError):
        return True
    return flags & os.O_ACCMODE != os.O_RDONLY


def _fd_flags_and_position(fd: int) -> tuple[int, int]:
    flags = position = 0
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key == "flags":
                flags = int(value.strip(), 8)
            elif key == "pos":
                position = int(value.strip())
    return flags, position


# A line of /proc/self/maps whose mapping is shared ("s" in its permissions): whether it
# is writable, and its path.
def shared_mappings(prefixes: tuple[str, ...] = PRIVATE_PREFIXES) -> list[str]:
    """The shared (MAP_SHARED) mappings of this process that a fork does not copy, so
    that a clone keeps sharing them with it (their writes reach each other): anonymous
    shared memory (``mmap.mmap(-1, n)``, shown as ``/dev/zero (deleted)``), SysV shared
    memory, memfds that are not gym_fork's own (its channel and slab: a clone gets its
    own), any mapping of a file in /tmp or /dev/shm (multiprocessing's RawArray and
    Value live in a deleted one), and writable mappings of any other file. Read-only
    mappings of the host's files (which no sandbox writes) and of devices are not."""
    found = []
    vmas = procmaps.shared_vmas()
    for writable, path in vmas:
        if path.startswith(OWN_MEMFDS):
            continue
        if not path or path.startswith((*prefixes, "/memfd:", "/dev/zero", "/SYSV")):
            found.append(path or "[anonymous shared]")
        elif writable and not path.startswith(("/dev/", "[")):
            found.append(path)
    return found

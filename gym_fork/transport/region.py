"""Anonymous shared-memory regions (memfd): nothing is ever left in /dev/shm.

Every memfd gym_fork shares with a sandbox is sealed against shrinking and growing
(F_SEAL_SHRINK, F_SEAL_GROW, then F_SEAL_SEAL): a sandbox holding the fd cannot truncate
it under the controller's mapping, which would kill the controller with SIGBUS.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat

from gym_fork.errors import TransportError

# What a memfd must carry before a mapping of it is trusted.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def seal_memfd(fd: int) -> None:
    """Freeze the size of ``fd`` (a memfd made with ``MFD_ALLOW_SEALING``, already
    sized): nobody holding it can shrink or grow it, or change its seals, afterwards."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    except OSError as exc:
        raise TransportError(
            f"cannot seal shared memory fd {fd} ({exc.strerror}); it must be a memfd "
            "created with MFD_ALLOW_SEALING whose seals are not yet fixed",
            reason="unsealed",
        ) from exc


def sealed_memfd(name: str, size: int) -> int:
    """A new memfd of ``size`` bytes, close-on-exec and sealed (see :func:`seal_memfd`).

    Use it for every memfd a sandbox may hold, instead of memfd_create + ftruncate.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        seal_memfd(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_shared_fd(fd: int, size: int, offset: int = 0, *, name: str = "region") -> None:
    """Refuse to map ``fd`` if its peer could pull the memory out from under a mapping.

    A regular file (a memfd) must carry :data:`REQUIRED_SEALS` and hold at least
    ``offset + size`` bytes. A character device (``/dev/mem`` inside a microVM guest,
    mapped at an offset) has no size to shrink and is accepted as it is.
    """
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        return
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # a file system without seals: anyone may truncate it
    missing = REQUIRED_SEALS & ~seals
    if missing:
        raise TransportError(
            f"{name}: the shared memory fd is not sealed against resizing (seals "
            f"{seals:#x}, need {REQUIRED_SEALS:#x}); whoever holds it could shrink it "
            "under this mapping. Create it with gym_fork.transport.region.sealed_memfd "
            "(or size it, then seal_memfd).",
            worker=name,
            reason="unsealed",
        )
    if info.st_size < offset + size:
        raise TransportError(
            f"{name}: the shared memory fd holds {info.st_size} bytes, {offset + size} expected",
            worker=name,
            reason="short",
        )


class Region:
    """A memfd-backed MAP_SHARED mapping, shareable with other processes by its fd.

    The creator and every process that receives ``fd`` (fork or SCM_RIGHTS) see the
    same bytes. The kernel frees the memory when the last fd and mapping are gone.
    A region made here is sealed (:func:`sealed_memfd`); :meth:`attach` refuses a memfd
    that is not, or that is smaller than the mapping.
    """

    def __init__(
        self, size: int, *, name: str = "gym_fork", fd: int | None = None, offset: int = 0
    ) -> None:
        self.size = size
        self.inherited = True  # mapped by a process forked from this one (keep_from_forks)
        self.identity: tuple[int, int] | None = None  # (device, inode) of its memfd
        self._held: list[int] | None = None  # held_fds(), once looked for
        own = fd is None
        if fd is None:
            fd = sealed_memfd(name, size)
        self.fd = fd
        try:
            self.map = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
            )
        except BaseException:
            if own:
                os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, size: int, offset: int = 0, *, name: str = "region") -> Region:
        """Map an existing region received as ``fd`` (from ``offset``: /dev/mem in a VM).

        Raises :class:`TransportError` (reason ``unsealed`` or ``short``) for a memfd
        that its other holders could resize; ``fd`` stays open then (the caller's).
        """
        check_shared_fd(fd, size, offset, name=name)
        return cls(size, fd=fd, offset=offset)

    def keep_from_forks(self) -> bool:
        """MADV_DONTFORK: a process forked from this one does not map the region at all
        (a clone gets a channel and a slab of its own: it has nothing to unmap, and its
        env code never sees its source's), but inherits its fds: :meth:`held_fds` lists
        them for a fork to close. Returns whether the kernel took it."""
        if self.fd < 0:
            return False
        try:
            self.map.madvise(mmap.MADV_DONTFORK)
        except (AttributeError, OSError, ValueError):
            return False
        self.inherited = False
        return True

    def held_fds(self, skip: frozenset[int] = frozenset()) -> list[int]:
        """The fds of this region this process holds (its own and the mmap object's copy,
        which only the mmap's close closes), looked for once (``skip``: fds known to be
        others) and remembered: what a process forked from this one closes."""
        if self._held is None:
            info = os.fstat(self.fd)
            self.identity = (info.st_dev, info.st_ino)
            mine = [fd for fd in _open_fds() if fd not in skip]
            self._held = [fd for fd in mine if _identity(fd) == self.identity]
        return self._held

    def close_inherited_fds(self) -> None:
        """In a process forked from one that kept this region from its forks: close the
        fds of it inherited (:meth:`held_fds`), each checked to be the region's still."""
        for fd in self.held_fds():
            if _identity(fd) == self.identity:
                os.close(fd)
        self.fd = -1

    def forget_fd(self) -> None:
        """Close the fd but keep the mapping (once the region has been handed over)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap and close the fd. Views into the mapping must be dropped first."""
        if self.map is not None:
            # A view still exported (a numpy array) keeps the mapping until the GC frees it.
            with contextlib.suppress(BufferError):
                self.map.close()
            self.map = None  # type: ignore[assignment]  # closed: nothing maps through it
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_fds() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _identity(fd: int) -> tuple[int, int] | None:
    """(device, inode) of what ``fd`` is open on; None where it is not open."""
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino

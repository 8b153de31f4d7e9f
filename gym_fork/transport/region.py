"""Anonymous shared-memory regions (memfd): nothing is ever left in /dev/shm."""

from __future__ import annotations

import contextlib
import mmap
import os


class Region:
    """A memfd-backed MAP_SHARED mapping, shareable with other processes by its fd.

    The creator and every process that receives ``fd`` (fork or SCM_RIGHTS) see the
    same bytes. The kernel frees the memory when the last fd and mapping are gone.
    """

    def __init__(
        self, size: int, *, name: str = "gym_fork", fd: int | None = None, offset: int = 0
    ) -> None:
        self.size = size
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd = fd
        self.map = mmap.mmap(
            fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset
        )

    @classmethod
    def attach(cls, fd: int, size: int, offset: int = 0) -> Region:
        """Map an existing region received as ``fd`` (from ``offset``: /dev/mem in a VM)."""
        return cls(size, fd=fd, offset=offset)

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
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

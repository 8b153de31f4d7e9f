"""The shared (MAP_SHARED) mappings of a process, as the kernel lists them.

Asked one mapping at a time with PROCMAP_QUERY (Linux 6.11+: ~40 us for a Python process
with numpy), else read from the text of /proc/<pid>/maps (~1 ms there). Stdlib only: the
layer helper (layer_helper.py) runs it without the package.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re

_SHARED_MAPPING = re.compile(rb"^[0-9a-f]+-[0-9a-f]+ [-r]([-w])[-x]s \S+ \S+ \d+ *(.*)$", re.M)


class _ProcmapQuery(ctypes.Structure):
    """struct procmap_query (linux/fs.h, Linux 6.11+)."""

    _fields_ = [
        ("size", ctypes.c_uint64),
        ("query_flags", ctypes.c_uint64),
        ("query_addr", ctypes.c_uint64),
        ("vma_start", ctypes.c_uint64),
        ("vma_end", ctypes.c_uint64),
        ("vma_flags", ctypes.c_uint64),
        ("vma_page_size", ctypes.c_uint64),
        ("vma_offset", ctypes.c_uint64),
        ("inode", ctypes.c_uint64),
        ("dev_major", ctypes.c_uint32),
        ("dev_minor", ctypes.c_uint32),
        ("vma_name_size", ctypes.c_uint32),
        ("build_id_size", ctypes.c_uint32),
        ("vma_name_addr", ctypes.c_uint64),
        ("build_id_addr", ctypes.c_uint64),
    ]


_PROCMAP_QUERY = (3 << 30) | (ctypes.sizeof(_ProcmapQuery) << 16) | (ord("f") << 8) | 17
_VMA_WRITABLE, _VMA_SHARED, _COVERING_OR_NEXT = 0x02, 0x08, 0x10
_NAME_BYTES = 4096  # PATH_MAX: a longer name fails the query (E2BIG), then the text is read
_procmap_query_works = True  # until the kernel says it has no PROCMAP_QUERY


def shared_vmas(pid: int | str = "self") -> list[tuple[bool, str]]:
    """(writable, name) of each shared mapping of process ``pid``; "" names anonymous
    shared memory."""
    vmas = _shared_vmas_queried(pid)
    return _shared_vmas_read(pid) if vmas is None else vmas


def _shared_vmas_queried(pid: int | str) -> list[tuple[bool, str]] | None:
    """(writable, name) of each shared mapping, asked of the kernel one shared mapping at
    a time; None where it cannot be asked."""
    global _procmap_query_works
    if not _procmap_query_works:
        return None
    name = ctypes.create_string_buffer(_NAME_BYTES)
    query = _ProcmapQuery()
    found: list[tuple[bool, str]] = []
    fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC)
    try:
        while True:
            query.size = ctypes.sizeof(query)
            query.query_flags = _COVERING_OR_NEXT | _VMA_SHARED
            query.query_addr = query.vma_end
            query.vma_name_size, query.vma_name_addr = _NAME_BYTES, ctypes.addressof(name)
            try:
                fcntl.ioctl(fd, _PROCMAP_QUERY, query)
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # no shared mapping above the last one
                    return found
                if exc.errno in (errno.ENOTTY, errno.EINVAL):
                    _procmap_query_works = False  # an older kernel: not asked again
                return None
            text = name.value.decode(errors="replace") if query.vma_name_size else ""
            found.append((bool(query.vma_flags & _VMA_WRITABLE), text))
    finally:
        os.close(fd)


def _shared_vmas_read(pid: int | str) -> list[tuple[bool, str]]:
    with open(f"/proc/{pid}/maps", "rb") as maps:
        lines = _SHARED_MAPPING.findall(maps.read())
    return [(w == b"w", raw.decode(errors="replace").strip()) for w, raw in lines]

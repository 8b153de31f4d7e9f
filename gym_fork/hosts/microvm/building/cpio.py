"""A writer for the "newc" cpio format, the one the Linux kernel unpacks as initramfs."""

from __future__ import annotations

import stat
from typing import BinaryIO


def _pad4(f: BinaryIO, n: int) -> None:
    f.write(b"\0" * (-n % 4))


def write_newc(f: BinaryIO, entries: list[tuple[str, int, bytes | None, str | None]]) -> None:
    """Write ``(name, mode, data, link_target)`` entries (mode includes the file type),
    then the trailer. Names are relative paths; parents must come before children."""
    for ino, (name, mode, data, target) in enumerate([*entries, ("TRAILER!!!", 0, None, None)]):
        body = (target or "").encode() if stat.S_ISLNK(mode) else data or b""
        encoded = name.encode() + b"\0"
        fields = [
            ino + 1,  # inode
            mode,
            0,  # uid
            0,  # gid
            2 if stat.S_ISDIR(mode) else 1,  # nlink
            0,  # mtime: fixed, so the same inputs give the same bytes
            len(body),
            0,
            0,  # dev major/minor
            0,
            0,  # rdev major/minor
            len(encoded),
            0,  # checksum
        ]
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        f.write(header + encoded)
        _pad4(f, len(header) + len(encoded))
        f.write(body)
        _pad4(f, len(body))

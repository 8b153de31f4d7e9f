"""Rotation of the lineage log: when it outgrows its bound, ``lineage.jsonl`` becomes
``lineage.jsonl.1`` (and ``.1`` becomes ``.2``, ...), so one log never grows without end
and the records of the last few files are still read back.

Several controllers may append to one log. The one that rotates holds an exclusive
``flock`` on the full file and rotates only while that file is still the one at the
log's name; a writer that finds it moved reopens the new one. A lock it cannot take
within :data:`LOCK_WAIT` seconds (a stuck or hostile holder) costs the rotation, never
the write.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import warnings
from pathlib import Path

from gym_fork import knobs

MAX_BYTES_VAR = "GYM_FORK_LINEAGE_LOG_MAX_BYTES"
DEFAULT_MAX_BYTES = int(knobs.BY_NAME[MAX_BYTES_VAR].default)
# Rotated files kept beside the log (lineage.jsonl.1 .. .KEEP): the whole log stays
# under (KEEP + 1) * max_bytes plus one line.
KEEP = 2
LOCK_WAIT = 2.0


def max_bytes() -> int:
    """The size a log may reach before it is rotated: $GYM_FORK_LINEAGE_LOG_MAX_BYTES
    (a positive integer), else :data:`DEFAULT_MAX_BYTES`."""
    configured = knobs.given(MAX_BYTES_VAR)
    if configured is None:
        return DEFAULT_MAX_BYTES
    try:
        value = int(configured)
        if value <= 0:
            raise ValueError
    except ValueError:
        warnings.warn(
            f"${MAX_BYTES_VAR}={configured!r} is not a positive number of bytes; "
            f"the lineage log rotates at {DEFAULT_MAX_BYTES} bytes",
            stacklevel=3,
        )
        return DEFAULT_MAX_BYTES
    return value


def rotated_paths(path: str | os.PathLike) -> list[Path]:
    """The rotated files of a log, oldest first (``.KEEP`` .. ``.1``), present or not."""
    path = Path(path)
    return [path.with_name(f"{path.name}.{n}") for n in range(KEEP, 0, -1)]


def _lock(fd: int, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def rotate(fd: int, directory: int, name: str) -> bool:
    """Rotate the full log ``name`` (open as ``fd``) in the directory open as
    ``directory``. Returns whether the caller should reopen the log: True when this
    call or a concurrent writer moved the file away, False when it stays (the lock was
    not taken in time). Raises OSError when a rename fails (a directory planted at a
    rotated name, ...)."""
    if not _lock(fd, time.monotonic() + LOCK_WAIT):
        return False
    try:
        try:
            current = os.stat(name, dir_fd=directory, follow_symlinks=False)
        except FileNotFoundError:
            return True  # moved away by another writer, not yet replaced
        mine = os.fstat(fd)
        if (current.st_dev, current.st_ino) != (mine.st_dev, mine.st_ino):
            return True  # another writer rotated it first
        # Renames move names only: a symlink planted at a rotated name is moved (or
        # replaced), never followed.
        for n in range(KEEP - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.rename(
                    f"{name}.{n}", f"{name}.{n + 1}", src_dir_fd=directory, dst_dir_fd=directory
                )
        os.rename(name, f"{name}.1", src_dir_fd=directory, dst_dir_fd=directory)
        return True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)

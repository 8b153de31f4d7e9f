"""Our own child processes: forked with Python's buffers flushed, their state and
their end, and what one writes on a pipe to us.

A child not reaped yet keeps its pid, so its pid names it and no other process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from gym_fork.system.linux import wait_readable


def fork() -> int:
    """``os.fork()``, Python's stdout and stderr flushed first (what they buffer would
    be written twice, by the parent and by the child)."""
    sys.stdout.flush()
    sys.stderr.flush()
    return os.fork()


def live_children(parent: int) -> set[int]:
    """Live (not yet reaped, not zombie) children of ``parent``, from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent and fields[0] != "Z":
                    found.add(int(entry))
    return found


def kill_child(pid: int) -> None:
    """SIGKILL our child ``pid`` (not reaped yet, so the pid is still its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU: a stop signal sent but not yet acted on (the
# target has not run since) is pending; it stops the process once it runs.
_STOP_SIGNALS = sum(1 << (sig - 1) for sig in (19, 20, 21, 22))


def child_state(pid: int) -> str:
    """The state letter of our child ``pid`` (``/proc/<pid>/status``: not reaped, so
    the pid is still its own), ``"T"`` also while a stop signal is pending for it, ``""``
    when unreadable (reaped)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return ""
    state, pending = "", 0
    for line in status.splitlines():
        key, _, value = line.partition(b":")
        if key == b"State":
            state = value.strip()[:1].decode("ascii", "replace")
        elif key in (b"SigPnd", b"ShdPnd"):
            with contextlib.suppress(ValueError):
                pending |= int(value.strip(), 16)
    if state and state not in ("T", "t", "Z", "X", "x") and pending & _STOP_SIGNALS:
        return "T"
    return state


def read_until_closed(fd: int, limit: int, deadline: float) -> bytes:
    """What comes on ``fd`` until the writer closes its end or more than ``limit`` bytes
    came; b"" when ``deadline`` (``time.monotonic()``) passes first."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not wait_readable(fd, left):
            return b""
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)

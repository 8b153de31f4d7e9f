"""Our own child processes: forked with Python's buffers flushed, their state and
their end, what one writes on a pipe to us, and our parent's.

A child not reaped yet keeps its pid, so its pid names it and no other process.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable

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


def kill_namespace(exit_codes: dict[int, int], seconds: float = 2.0) -> None:
    """As pid 1 of a pid namespace: kill every other process of it, however it got
    there (kill(-1) reaches them all), and reap until none is left; their exit codes
    go into ``exit_codes``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        exit_codes[pid] = os.waitstatus_to_exitcode(status)


def kill_every_child(known: Callable[[], set[int]], reap: Callable[[], None]) -> None:
    """As a child subreaper: kill all our children (``known()`` and those /proc lists)
    and ``reap()`` them, round after round while killed children's orphans are
    reparented to us, until none is left (at most 50 rounds, 10 ms apart)."""
    for _ in range(50):
        targets = known() | live_children(os.getpid())
        for pid in targets:
            kill_child(pid)
        reap()
        if not targets:
            return
        select.select([], [], [], 0.01)


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` as /proc says (in our pid namespace), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def watch_parent(pid: int) -> int:
    """A pidfd of our parent ``pid``; exits (70) now if it is gone already or died
    before we watched it (then we have another parent)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(70)
    if os.getppid() != pid:
        os._exit(70)
    return fd


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

"""A forked peer for the hostile-sandbox tests: runs a function in a child process and
always reaps it (killing it first if it is still running)."""

from __future__ import annotations

import os
import signal
import struct
import traceback
from collections.abc import Callable

# Offsets in a ring's control block (ext/gf_ring.h: the producer's cache line, then the
# consumer's).
WRITE_POS = 0
READ_POS = 64


def counters(view, ring_offset: int = 0) -> tuple[int, int]:
    """(write_pos, read_pos) of the ring at ``ring_offset`` in a shared mapping."""
    return (
        struct.unpack_from("<Q", view, ring_offset + WRITE_POS)[0],
        struct.unpack_from("<Q", view, ring_offset + READ_POS)[0],
    )


def poke(view, offset: int, value: int) -> None:
    """Write one u64 into the shared mapping, as a hostile peer would."""
    struct.pack_into("<Q", view, offset, value)


class Peer:
    """``fn()`` in a forked child; the child's exit code is 0 when ``fn`` returns."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.status: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                fn()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)

    def alive(self) -> bool:
        """True while the child runs (reaps it once it has exited)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is None

    def wait(self) -> int:
        """Reap the child; its exit code (negative: killed by that signal)."""
        if self.status is None:
            _, self.status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(self.status)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.wait()

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

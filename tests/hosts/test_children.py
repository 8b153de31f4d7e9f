"""Our own children (gym_fork/system/children.py): their state as /proc says, and what
one writes on a pipe, read with a size bound and a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from gym_fork.system.children import (
    child_state,
    fork,
    kill_child,
    live_children,
    read_until_closed,
)


@contextlib.contextmanager
def sleeping_child() -> Iterator[int]:
    """A child of ours that sleeps until killed; killed and reaped at the end."""
    pid = fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        yield pid
    finally:
        kill_child(pid)
        os.waitpid(pid, 0)


def _killed_until(pid: int, dead) -> None:
    kill_child(pid)
    deadline = time.monotonic() + 10
    while not dead() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_childs_state_stopped_dead_and_reaped():
    with sleeping_child() as pid:
        os.kill(pid, signal.SIGSTOP)
        os.waitpid(pid, os.WUNTRACED)  # it has stopped
        assert child_state(pid) == "T"
        _killed_until(pid, lambda: child_state(pid) == "Z")
        assert child_state(pid) == "Z"  # dead, not reaped: still its pid
    assert child_state(pid) == ""


def test_live_children_are_ours_and_not_yet_dead():
    with sleeping_child() as pid:
        assert pid in live_children(os.getpid())
        assert pid not in live_children(os.getppid())  # our child, not our parent's
        _killed_until(pid, lambda: pid not in live_children(os.getpid()))
        assert pid not in live_children(os.getpid())  # a zombie is not live


def read(data: bytes, close: bool, limit: int = 100, seconds: float = 5.0) -> bytes:
    """``read_until_closed`` of a pipe holding ``data``, its writer closed or not."""
    r, w = os.pipe()
    try:
        os.write(w, data)
        if close:
            os.close(w)
            w = -1
        return read_until_closed(r, limit, time.monotonic() + seconds)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_what_a_writer_sends_until_it_closes_within_the_deadline():
    assert read(b"abc", close=True) == b"abc"
    assert read(b"abc", close=False, seconds=0.05) == b""  # too slow: nothing
    assert read(b"x" * 10, close=False, limit=4) == b"x" * 10  # past the bound: no wait

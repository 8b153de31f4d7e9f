"""Our own children (gym_fork/system/children.py): their state as /proc says, what
one writes on a pipe, read with a size bound and a deadline, killing them all, and our
parent."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

from gym_fork.system import linux
from gym_fork.system.children import (
    child_state,
    fork,
    kill_child,
    kill_every_child,
    live_children,
    parent_of,
    read_until_closed,
    watch_parent,
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


def test_the_parent_of_a_process_and_of_none():
    with sleeping_child() as pid:
        assert parent_of(pid) == os.getpid()
    assert parent_of(pid) is None  # reaped: gone from /proc
    assert parent_of(os.getpid()) == os.getppid()


def test_a_watch_of_our_parent_reads_ready_when_it_dies():
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # the parent of a grandchild that watches it
        os.close(read_end)
        watching, watched = os.pipe()
        grandchild = os.fork()
        if grandchild == 0:
            fd = watch_parent(os.getppid())
            os.write(watched, b"w")
            code = 0 if linux.wait_readable(fd, 10.0) else 1
            os.write(write_end, bytes([code]))
            os._exit(0)
        os.close(watched)
        os.read(watching, 1)  # the grandchild watches us (or died: EOF)
        os._exit(0)  # its watch becomes readable
    os.close(write_end)
    try:
        assert read_until_closed(read_end, 16, time.monotonic() + 20) == b"\x00"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def test_a_subreaper_kills_its_children_and_their_orphans():
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:  # a subreaper with a child whose own child outlives it
        os.close(read_end)
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
        middle = os.fork()
        if middle == 0:
            if os.fork() == 0:
                time.sleep(5)  # bounded: a leak if kill_every_child misses it
                os._exit(0)
            os._exit(0)  # its child is reparented to the subreaper
        os.waitpid(middle, 0)
        orphans = live_children(os.getpid())

        def reap() -> None:
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass

        kill_every_child(set, reap)
        left = live_children(os.getpid())
        os.write(write_end, bytes([len(orphans), len(left)]))
        os._exit(0)
    os.close(write_end)
    try:
        assert read_until_closed(read_end, 16, time.monotonic() + 20) == bytes([1, 0])
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


NAMED_CHILDREN = """
import ctypes, os, signal, time
from gym_fork.system.linux import live_children

libc = ctypes.CDLL(None, use_errno=True)
made = []
try:
    assert live_children() == [], live_children()  # none at all: the one-call answer
    pid = os.fork()
    if pid == 0:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with this script
        signal.pause()
        os._exit(0)
    made.append(pid)
    assert [p for p, _name in live_children()] == [pid]
    os.kill(pid, signal.SIGKILL)

    def state():
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    deadline = time.monotonic() + 5
    while state() != "Z" and time.monotonic() < deadline:
        time.sleep(0.001)
    assert state() == "Z"
    assert live_children() == []  # a zombie is no live child
    assert os.waitpid(pid, os.WNOHANG)[0] == pid  # and was not reaped by the look
    made.remove(pid)
    # clone(2) with exit signal 0: waitid sees such a child only with __WALL
    raw = libc.syscall(56, 0, 0, 0, 0, 0)
    if raw == 0:
        libc.syscall(157, 1, signal.SIGKILL, 0, 0, 0)  # prctl(PR_SET_PDEATHSIG)
        libc.syscall(34)  # pause()
        libc.syscall(60, 0)
    made.append(raw)
    assert [p for p, _name in live_children()] == [raw], live_children()
    print("ok")
finally:
    for child in made:
        os.kill(child, signal.SIGKILL)
        os.waitid(os.P_PID, child, os.WEXITED | 0x40000000)
"""


def test_the_named_live_children_of_this_process():
    """linux.live_children (a FORK's refusal names them): none at all answered by one
    waitid; a running child named, one whose exit signal is not SIGCHLD too; a zombie
    left out and left unreaped."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", NAMED_CHILDREN], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "ok", done.stderr

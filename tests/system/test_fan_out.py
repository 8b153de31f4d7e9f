"""Forking many processes at once (gym_fork/system/fan_out.py): each held by its pidfd,
none left behind when one cannot be made."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import time

import pytest

from gym_fork.system import fan_out


def _sleeper(report: int):
    """``become`` for the tests: close what it was told to, say its place, sleep."""

    def become(k: int, close: list[tuple[int, int]]):
        for lo, hi in close:
            if not lo <= report < hi:
                os.closerange(lo, hi)
        os.write(report, bytes([k]))
        os.close(report)
        time.sleep(5)  # bounded: a leak if the test fails to kill it
        os._exit(0)

    return become


def _fork_sleepers(count: int, read_end: int, write_end: int, **how) -> fan_out.Forked:
    return fan_out.fork_all(
        count,
        _sleeper(write_end),
        close=(read_end,),
        deadline=time.monotonic() + 20,
        seconds=20,
        **how,
    )


def test_a_double_fork_by_helpers_holds_every_process_by_its_pidfd():
    read_end, write_end = os.pipe()
    made = _fork_sleepers(6, read_end, write_end, sibling=False, helpers=2)
    os.close(write_end)
    try:
        assert sorted(made.watches) == list(range(6))
        assert all(watch.alive() for watch in made.watches.values())
        places = b""
        while len(places) < 6:  # each writes its place, then holds the pipe open
            places += os.read(read_end, 6)
        assert sorted(places) == list(range(6))
        pids = [watch.pid for watch in made.watches.values()]
        made.kill()  # by pidfd: they are orphans, not our children
        assert not [pid for pid in pids if _running(pid)]  # dead when kill() returns
    finally:
        made.kill()
        os.close(read_end)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_process_the_kernel_refuses_midway_gets_every_one_made_killed(monkeypatch):
    real = fan_out.fork_process
    made: list[int] = []

    def refuse_the_third(sibling: bool) -> tuple[int, int]:
        if len(made) == 2:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        pid, pidfd = real(False)  # our children, so that the test can reap them
        if pid:
            made.append(pid)
        return pid, pidfd

    monkeypatch.setattr(fan_out, "fork_process", refuse_the_third)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(RuntimeError, match=r"clone 3 of 5 could not be made .*2 clones made"):
            _fork_sleepers(5, read_end, write_end, sibling=True, helpers=1)
        # Dead when fork_all returns (killed, not sleeping out their 5 s): reaped at once.
        for pid in made:
            reaped, status = os.waitpid(pid, os.WNOHANG)
            assert reaped == pid and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        os.close(read_end)
        os.close(write_end)
        for pid in made:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def test_a_helpers_report_must_carry_a_pidfd():
    """A report naming a pipe (env code forging one in a helper) is refused, not held as
    a process to kill later."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    read_end, write_end = os.pipe()
    try:
        socket.send_fds(theirs, [fan_out._REPORT.pack(0, os.getpid())], [read_end])
        theirs.close()
        made, helpers = fan_out.Forked(), fan_out.Forked()
        problems = fan_out._take_reports(ours, 1, 1, made, helpers, time.monotonic() + 5, 5)
        assert not made.watches
        assert any("malformed report" in problem for problem in problems), problems
    finally:
        ours.close()
        theirs.close()
        os.close(read_end)
        os.close(write_end)

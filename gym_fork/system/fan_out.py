"""Forking many processes at once, each held by its pidfd from its birth, with none left
behind when one cannot be made.

:func:`fork_all` forks ``count`` processes, each running ``become(k, close)``: as
siblings of ours (:func:`gym_fork.system.linux.fork_sibling`, born children of our
parent), or by a double fork (helpers that are our children fork them, report them and
exit, so that the orphans are adopted by the nearest subreaper). A large fan-out is
split over several helpers: forking copies the caller's page tables, and two cores copy
them twice as fast. Whoever forks a process keeps its pidfd; if any process or helper
cannot be made, or the helpers' reports are not in by the deadline, every process made
is killed by pidfd (no reaping can make a pidfd name another process) and RuntimeError
says why.

Code of the caller's may run in a helper (at-fork hooks) and in the new processes: a
helper's report is checked before it counts, and at most one per process and helper is
read.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from gym_fork.system.children import kill_child
from gym_fork.system.linux import ProcessWatch, fork_sibling, pidfd_pids, wait_readable

# Seconds the processes of a failed fan-out are given to be gone once killed.
KILL_TIMEOUT = 2.0

# ``become(k, close)``: the life of process ``k``, which first closes the [lo, hi) runs
# of fds ``close`` (the fan-out's fds and the pidfds of the processes forked before it).
Become = Callable[[int, list[tuple[int, int]]], NoReturn]


class Forked:
    """Processes forked so far, each held by its pidfd, keyed by its place. The pidfds
    are mostly consecutive fds: a process forked later closes its copies with a few
    close_range calls (``runs``). ``ours``: os.fork()ed children of ours, reaped here."""

    def __init__(self, ours: bool = False) -> None:
        self.ours = ours
        self.watches: dict[int, ProcessWatch] = {}
        self.runs: list[tuple[int, int]] = []  # [lo, hi) runs of the pidfds

    def add(self, key: int, watch: ProcessWatch) -> None:
        self.watches[key] = watch
        if self.runs and self.runs[-1][1] == watch.fd:
            self.runs[-1] = (self.runs[-1][0], watch.fd + 1)
        else:
            self.runs.append((watch.fd, watch.fd + 1))

    def kill(self) -> None:
        """SIGKILL every one, wait (KILL_TIMEOUT in all) until they are gone, let go of
        them."""
        for watch in self.watches.values():
            watch.kill()
        deadline = time.monotonic() + KILL_TIMEOUT
        for watch in self.watches.values():
            watch.wait_dead(max(0.0, deadline - time.monotonic()))
        self.close()

    def close(self) -> None:
        """Let go of them (children of ours: once they have exited, or been killed
        at KILL_TIMEOUT, and reaped)."""
        deadline = time.monotonic() + KILL_TIMEOUT
        for watch in self.watches.values():
            if self.ours:
                if not watch.wait_dead(max(0.0, deadline - time.monotonic())):
                    watch.kill()
                    watch.wait_dead(KILL_TIMEOUT)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(watch.pid, os.WNOHANG)
            watch.close()
        self.watches.clear()
        self.runs.clear()


def fork_process(sibling: bool) -> tuple[int, int]:
    """Fork a sibling (fork_sibling) or a child of ours (``os.fork()``): ``(0, -1)`` in
    it, ``(pid, pidfd)`` here."""
    if sibling:
        return fork_sibling()
    pid = os.fork()
    if pid == 0:
        return 0, -1
    try:
        return pid, os.pidfd_open(pid)  # our child, not reaped: the pid is its own
    except BaseException:
        kill_child(pid)
        os.waitpid(pid, 0)
        raise


def fork_all(
    count: int,
    become: Become,
    *,
    sibling: bool,
    helpers: int,
    close: Sequence[int],
    deadline: float,
    seconds: float,
) -> Forked:
    """Fork ``count`` processes running ``become`` (module docstring): siblings, forked
    here when ``helpers`` is 1, else by ``helpers`` helpers; a double fork (``sibling``
    false) always by helpers. Each new process closes ``close`` (fds it must not keep)
    first. ``deadline`` (``time.monotonic()``) bounds the helpers' reports, ``seconds``
    is what errors call it."""
    made = Forked()
    runs = [(fd, fd + 1) for fd in close if fd >= 0]
    try:
        if helpers == 1 and sibling:
            for k in range(count):
                try:
                    _fork_one(k, sibling, become, runs, made)
                except OSError as exc:
                    raise RuntimeError(
                        f"fork: clone {k + 1} of {count} could not be made ({exc}); "
                        f"the {k} clones made of {count} are killed"
                    ) from exc
        else:
            _fork_by_helpers(count, become, sibling, helpers, runs, made, deadline, seconds)
    except BaseException:
        made.kill()
        raise
    return made


def _fork_one(
    k: int, sibling: bool, become: Become, runs: list[tuple[int, int]], made: Forked
) -> ProcessWatch:
    pid, pidfd = fork_process(sibling)
    if pid == 0:
        become(k, [*runs, *made.runs])
    watch = ProcessWatch(pid, pidfd)
    made.add(k, watch)
    return watch


# A helper's report of one process: its place and its pid (its pidfd attached).
_REPORT = struct.Struct("<qq")
_FAILED = b"!"  # a helper's report that a process could not be made: b"!" + why


def _fork_by_helpers(
    count: int,
    become: Become,
    sibling: bool,
    parts: int,
    runs: list[tuple[int, int]],
    made: Forked,
    deadline: float,
    seconds: float,
) -> None:
    """Fork the processes by ``parts`` helpers, each its share (siblings; children of
    ours for the double fork), which report each process with its pidfd on a socket;
    they go into ``made``. RuntimeError if a helper failed, a report is wrong or
    missing, or the reports are not all in by ``deadline``."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    helpers = Forked(ours=not sibling)
    problems = []
    try:
        report_to = theirs.fileno()
        closed_by_all = [*runs, (ours.fileno(), ours.fileno() + 1), (report_to, report_to + 1)]
        for part in range(parts):
            try:
                pid, pidfd = fork_process(sibling)
            except OSError as exc:  # the helpers made still report what they make
                problems.append(f"helper {part + 1} of {parts} could not be made ({exc})")
                break
            if pid == 0:
                share = range(part, count, parts)
                _helper(count, share, become, sibling, [*closed_by_all, *helpers.runs], report_to)
            helpers.add(part, ProcessWatch(pid, pidfd))
        theirs.close()
        problems += _take_reports(ours, count, parts, made, helpers, deadline, seconds)
        if problems:
            raise RuntimeError(
                f"fork: {'; '.join(problems[:3])}; the {len(made.watches)} clones made of "
                f"{count} are killed"
            )
    except BaseException:
        helpers.kill()
        raise
    finally:
        theirs.close()
        ours.close()
        helpers.close()


def _helper(
    count: int,
    share: range,
    become: Become,
    sibling: bool,
    runs: list[tuple[int, int]],
    report_to: int,
) -> NoReturn:
    """A helper's life: fork the processes ``share``, report each on ``report_to`` as
    it is made; if one cannot be made, kill those made and report why. Never returns."""
    made = Forked()
    k = share.start
    try:
        for k in share:
            watch = _fork_one(k, sibling, become, runs, made)
            _send_report(report_to, _REPORT.pack(k, watch.pid), [watch.fd])
    except BaseException as exc:
        made.kill()
        with contextlib.suppress(OSError):
            why = f"clone {k + 1} of {count} could not be made ({exc})"
            _send_report(report_to, _FAILED + why.encode(errors="replace")[:200], [])
    finally:
        os._exit(0)


def _send_report(fd: int, data: bytes, fds: list[int]) -> None:
    sock = socket.socket(fileno=fd)  # no new fd; detached again, never closed here
    try:
        socket.send_fds(sock, [data], fds)
    finally:
        sock.detach()


def _take_reports(
    sock: socket.socket,
    count: int,
    parts: int,
    made: Forked,
    helpers: Forked,
    deadline: float,
    seconds: float,
) -> list[str]:
    """The helpers' reports until every process is reported or all are gone (EOF), each
    process's watch into ``made``; returns what went wrong. Past ``deadline`` the
    helpers are killed and only what they sent before is taken. A forged report at
    most makes the fan-out fail (a process is reported twice) and names nothing its
    sender could not signal itself (same pid namespace and uid as we)."""
    problems: list[str] = []
    late = False
    reports = 0
    while len(made.watches) < count:
        if reports > count + parts:
            problems.append("more reports than clones and helpers")
            break
        if not wait_readable(sock.fileno(), 0 if late else deadline - time.monotonic()):
            if late:
                break
            problems.append(f"the helpers did not report every clone within {seconds:g} s")
            helpers.kill()
            late = True
            continue
        data, fds, flags, _ = socket.recv_fds(sock, 256, 1)
        reports += 1
        if not data and not fds:
            break  # every helper is gone, every process has closed its copy
        if len(data) == _REPORT.size and len(fds) == 1 and not flags:
            k, pid = _REPORT.unpack(data)
            if 0 <= k < count and k not in made.watches and pid > 0 and pidfd_pids(fds[0]):
                made.add(k, ProcessWatch(pid, fds[0]))
                continue
        for fd in fds:
            os.close(fd)
        if data.startswith(_FAILED) and not fds:
            problems.append(data[1:].decode(errors="replace"))
        else:
            problems.append(f"a malformed report of {len(data)} bytes with {len(fds)} fds")
    if not problems and len(made.watches) < count:
        problems.append(f"{count - len(made.watches)} of {count} clones were not reported")
    return problems

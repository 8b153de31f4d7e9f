"""A process a peer reports reaped carries no pid of ours (gym_fork/transport/
typed_messages.py ``adopt_pidfds``): the pid the peer named may be another process's
here, and a handle's pid is what /proc is read by (isolation, memory, GPU evidence, stop
state). Also: a sender's own pidfds go out as they are (``send_with_pidfds``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from gym_fork.hosts.base import process_state
from gym_fork.system.linux import NO_PID, pidfd_pids
from gym_fork.transport import typed_messages as T


@dataclass(frozen=True)
class Forked(T.Message):
    OP = "forked"
    pids: list[int]
    pidfds: list[bool] = field(default_factory=list)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def bystander() -> Iterator[int]:
    """A live process that is none of the peer's: the pid a hostile peer names."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield process.pid
    process.kill()
    process.wait()


def test_a_process_reported_reaped_gets_a_dead_watch_without_the_named_pid(pair, bystander):
    ours, theirs = pair
    T.send(ours, Forked([bystander], [False]))  # "reaped already", naming a live process
    got, fds = T.receive(theirs, Forked)
    (watch,) = T.adopt_pidfds(got.pids, got.pidfds, fds)
    assert watch.pid == NO_PID and process_state(watch.pid) == ""
    assert watch.alive() is False and watch.wait_dead(0) is True
    watch.kill()
    assert process_state(bystander) not in ("", "Z")  # untouched
    watch.close()


def test_a_pidfd_of_a_process_reaped_since_gives_no_pid_either(pair):
    ours, theirs = pair
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(child.pid)
    child.wait()  # reaped: the pidfd stays, its pid may be anyone's now
    try:
        T.send_with_pidfds(ours, Forked([child.pid]), [child.pid], [pidfd])
    finally:
        os.close(pidfd)
    got, fds = T.receive(theirs, Forked)
    assert got.pidfds == [True] and pidfd_pids(fds[0]) == [-1]
    (watch,) = T.adopt_pidfds(got.pids, got.pidfds, fds)
    assert (watch.pid, watch.alive()) == (NO_PID, False)
    watch.close()


def test_the_senders_own_pidfds_are_sent_and_left_open(pair):
    ours, theirs = pair
    pidfd = os.pidfd_open(os.getpid())
    try:
        T.send_with_pidfds(ours, Forked([os.getpid()]), [os.getpid()], [pidfd])
        os.fstat(pidfd)  # still ours
    finally:
        os.close(pidfd)
    got, fds = T.receive(theirs, Forked)
    (watch,) = T.adopt_pidfds(got.pids, got.pidfds, fds)
    assert (watch.pid, watch.alive()) == (os.getpid(), True)
    watch.close()

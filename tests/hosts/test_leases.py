"""Leased idle sandboxes (gym_fork/hosts/process/leases.py, idle.py): the warm parent
hands its idle sandboxes to the controller, which assigns them without a round trip;
what comes on the lease channel is checked as the word of a process that runs env code."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.process import leases
from gym_fork.hosts.process import messages as M
from gym_fork.transport import control
from gym_fork.transport.typed_messages import adopt_pidfds
from tests.helpers import alive, wait_until

pytestmark = pytest.mark.process_only
ONE = np.zeros(1, dtype=np.int64)


def cartpole():
    return gym.make("CartPole-v1")


def leased_pids(envs: ForkVectorEnv) -> set[int]:
    return {lease.watch.pid for lease in envs.sandboxes.host._leases.ready}


def drain(envs: ForkVectorEnv) -> set[int]:
    """Read the leases the warm parent sent (as a spawn would) and return their pids."""
    host = envs.sandboxes.host
    with host._lock:
        host._leases._drain(host._new_members)
    return leased_pids(envs)


def test_a_reset_by_clone_takes_a_leased_idle_sandbox(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "2")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 1)) as envs:
        envs.reset(seed=0)
        envs.reset(seed=1)  # the second spawn request opens the lease channel
        assert envs.sandboxes.host._leases.channel is not None
        assert wait_until(lambda: len(drain(envs)) == 2, 5.0)
        for seed in range(2, 6):
            assert wait_until(lambda: drain(envs), 5.0)  # one taken is replaced soon after
            offered = leased_pids(envs)
            envs.reset(seed=seed)
            (pid,) = envs.worker_pids
            assert pid in offered, "the clone did not come from a lease"
            envs.step(ONE)
        report = envs.isolation  # assigned by the controller, isolated like any other
        assert report["capabilities"].startswith("dropped") and report["seccomp"].startswith("on (")
        assert report["namespaces"]["pid"] and report["private_tmp"]
        held = drain(envs)
    assert wait_until(lambda: not alive(held), 5.0), "leased idle sandboxes outlived close()"


def test_leases_off_every_reset_by_clone_asks_the_warm_parent(monkeypatch):
    # GYM_FORK_LEASES=0 (benchmarks/lease_ab.py's other contender): the channel the warm
    # parent sends is closed at once, its idle sandboxes wait in its pool and still serve.
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "2")
    monkeypatch.setenv("GYM_FORK_LEASES", "0")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 1)) as envs:
        seen = set()
        for seed in range(5):
            envs.reset(seed=seed)
            envs.step(ONE)
            seen.update(envs.worker_pids)
            held = envs.sandboxes.host._leases
            assert held.channel is None and not held.ready, "a lease was taken"
        assert len(seen) == 5  # a fresh clone at every reset all the same


@pytest.fixture
def one_lease(monkeypatch):
    """A vector env whose warm parent has leased its one idle sandbox, and that pid."""
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "1")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 1)) as envs:
        envs.reset(seed=0)
        envs.reset(seed=1)
        assert wait_until(lambda: len(drain(envs)) == 1, 5.0)
        (pid,) = drain(envs)
        yield envs, pid


def test_a_leased_sandbox_killed_before_use_is_skipped(one_lease):
    envs, victim = one_lease
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: not alive({victim}), 3.0)
    envs.reset(seed=2)
    assert victim not in envs.worker_pids
    _, reward, *_ = envs.step(ONE)
    assert reward[0] == 1.0


def test_a_stopped_leased_sandbox_is_killed_and_named(one_lease):
    envs, stopped = one_lease
    os.kill(stopped, signal.SIGSTOP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs.reset(seed=2)
    assert any("stopped" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert stopped not in envs.worker_pids
    assert wait_until(lambda: not alive({stopped}), 3.0)
    envs.step(ONE)


@pytest.fixture
def channel():
    """Our end of a lease channel (IdleLeases) and the other end, the warm parent's."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    held = leases.IdleLeases()
    held.open(ours.detach())
    yield held, theirs
    held.close()
    theirs.close()


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])


def admit_all(watches, what):
    return watches


def offer(warm_parent: socket.socket, pid: int, local_pid: int, sock_fd: int | None = None) -> None:
    """Send a lease of ``pid`` (called ``local_pid``) with ``sock_fd`` as its socket (a
    new socket when None), as a warm parent would."""
    a, b = socket.socketpair()
    pidfd = os.pidfd_open(pid)
    try:
        M.send(
            warm_parent,
            M.Leased(local_pid, [True]),
            [pidfd, a.fileno() if sock_fd is None else sock_fd],
        )
    finally:
        os.close(pidfd)
        a.close()
        b.close()


def refuse(watches, what):
    for watch in watches:
        watch.close()
    raise SandboxStartError(f"{what}: process is not a new sandbox")


def test_a_lease_of_a_process_outside_the_tree_closes_the_channel(channel):
    held, warm_parent = channel
    victim = sleeper()
    try:
        offer(warm_parent, victim.pid, victim.pid)
        assert held.take(refuse) is None
        assert held.channel is None  # the warm parent said what it must not: no more leases
        assert victim.poll() is None, "a process the controller was merely told of was signalled"
    finally:
        victim.kill()
        victim.wait()


def test_a_lease_whose_socket_is_no_socket_closes_the_channel(channel):
    held, warm_parent = channel
    victim = sleeper()
    r, w = os.pipe()
    try:
        offer(warm_parent, victim.pid, victim.pid, sock_fd=r)
        assert held.take(admit_all) is None
        assert held.channel is None
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
        os.close(r)
        os.close(w)


def test_a_lease_with_a_pid_that_is_not_its_pidfds_closes_the_channel(channel):
    held, warm_parent = channel
    victim = sleeper()
    try:
        offer(warm_parent, victim.pid, os.getpid())
        assert held.take(admit_all) is None
        assert held.channel is None
    finally:
        victim.kill()
        victim.wait()


def test_a_good_lease_is_taken_and_a_dead_one_discarded(channel):
    held, warm_parent = channel
    first, second = sleeper(), sleeper()
    pairs = [socket.socketpair(), socket.socketpair()]
    try:
        for proc, (a, _) in zip((first, second), pairs, strict=True):
            pidfd = os.pidfd_open(proc.pid)
            M.send(warm_parent, M.Leased(proc.pid, [True]), [pidfd, a.fileno()])
            os.close(pidfd)
        first.kill()
        first.wait()
        lease = held.take(admit_all)
        assert lease is not None and lease.watch.pid == second.pid
        assert held.ready == [] and held.channel is not None
        lease.close()
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()
        for a, b in pairs:
            a.close()
            b.close()


def test_a_spawn_waits_for_a_lease_owed_and_only_then(channel):
    held, warm_parent = channel
    first, second = sleeper(), sleeper()
    try:
        offer(warm_parent, first.pid, first.pid)
        lease = held.take(admit_all, 5.0)
        assert lease is not None and lease.watch.pid == first.pid
        lease.close()
        # One owed (the one taken), but no wait asked (a spawn of several): at once.
        start = time.monotonic()
        assert held.take(admit_all) is None
        assert time.monotonic() - start < 0.5
        # One owed: the replacement the warm parent sends 0.2 s later is waited for.
        timer = threading.Timer(0.2, offer, (warm_parent, second.pid, second.pid))
        timer.start()
        try:
            start = time.monotonic()
            lease = held.take(admit_all, 10.0)
            waited = time.monotonic() - start
        finally:
            timer.join()
        assert lease is not None and lease.watch.pid == second.pid
        assert 0.15 < waited < 9.0, waited
        lease.close()
        # One owed again (the second taken), none coming: the wait ends at its deadline.
        assert held.owed == 1
        start = time.monotonic()
        assert held.take(admit_all, 0.3) is None
        assert 0.25 < time.monotonic() - start < 5.0
        # Nothing owed: no wait, whatever wait_s says.
        held.owed = 0
        start = time.monotonic()
        assert held.take(admit_all, 10.0) is None
        assert time.monotonic() - start < 0.5
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_a_channel_that_closes_means_no_leases(channel):
    held, warm_parent = channel
    warm_parent.close()
    assert held.take(admit_all) is None
    assert held.channel is None


def test_a_lease_without_a_pidfd_closes_the_channel(channel):
    held, warm_parent = channel
    a, b = socket.socketpair()
    try:
        M.send(warm_parent, M.Leased(12345, [False]), [a.fileno()])
        assert held.take(admit_all) is None
        assert held.channel is None
    finally:
        a.close()
        b.close()


def test_a_flood_of_leases_is_read_a_bounded_number_at_a_time(channel):
    held, warm_parent = channel
    proc = sleeper()
    pairs = []
    try:
        for _ in range(leases.MAX_LEASES + 5):
            a, b = socket.socketpair()
            pairs.append((a, b))
            pidfd = os.pidfd_open(proc.pid)
            M.send(warm_parent, M.Leased(proc.pid, [True]), [pidfd, a.fileno()])
            os.close(pidfd)
        held._drain(admit_all)
        assert len(held.ready) == leases.MAX_LEASES  # the rest waits on the channel
    finally:
        proc.kill()
        proc.wait()
        for a, b in pairs:
            a.close()
            b.close()


def nspid(pid: int) -> int:
    """``pid``'s pid in its innermost pid namespace (what its warm parent calls it)."""
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("NSpid:")).split()[-1])


def play_warm_parent(envs: ForkVectorEnv) -> socket.socket:
    """Replace the host's lease channel by one whose other end the test holds."""
    held = envs.sandboxes.host._leases
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if held.channel is not None:
        held.channel.close()
    ours.settimeout(leases.CHANNEL_TIMEOUT_S)
    held.channel = ours
    return theirs


@pytest.mark.parametrize("whom", ["a held worker", "a lease held already", "a stranger"])
def test_the_host_refuses_a_lease_of_what_is_no_new_sandbox(one_lease, whom):
    envs, leased = one_lease
    host = envs.sandboxes.host
    stranger = sleeper()
    try:
        pid = {
            "a held worker": envs.worker_pids[0],
            "a lease held already": leased,
            "a stranger": stranger.pid,
        }[whom]
        warm_parent = play_warm_parent(envs)
        offer(warm_parent, pid, nspid(pid))
        with host._lock:
            host._leases._drain(host._new_members)
        assert host._leases.channel is None, f"{whom} was taken as a lease"
        assert [lease.watch.pid for lease in host._leases.ready] == [leased]
        assert stranger.poll() is None
        _, reward, *_ = envs.step(ONE)  # the worker was not touched
        assert reward[0] == 1.0
        warm_parent.close()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_trickled_lease_stalls_no_spawn(one_lease):
    envs, leased = one_lease
    host = envs.sandboxes.host
    warm_parent = play_warm_parent(envs)
    warm_parent.send(b"\x64\x00\x00\x00\x02\x00\x00\x00" + b"\x80")  # 100 bytes announced
    started = time.monotonic()
    with host._lock:
        lease = host._leases.take(host._new_members)
    assert time.monotonic() - started < 0.5
    assert lease is not None and lease.watch.pid == leased  # the one queued before
    assert host._leases.channel is not None  # not an error (yet): not read either
    lease.close()
    warm_parent.close()


def test_a_lease_channel_that_is_no_socket_is_refused():
    held = leases.IdleLeases()
    r, w = os.pipe()
    held.open(r)
    assert held.channel is None
    with pytest.raises(OSError):
        os.fstat(r)  # closed
    os.close(w)


def test_a_replacement_of_two_sandboxes_takes_two_leases(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "2")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 2, envs_per_worker=1)) as envs:
        envs.reset(seed=0)
        envs.reset(seed=1)
        assert wait_until(lambda: len(drain(envs)) == 2, 5.0)
        offered = leased_pids(envs)
        envs.reset(seed=2)
        assert set(envs.worker_pids) == offered
        envs.step(np.zeros(2, dtype=np.int64))


def test_a_lease_being_assigned_is_held(one_lease):
    envs, leased = one_lease
    host = envs.sandboxes.host
    with host._lock:
        lease = host._leases.take(host._new_members)
    assert lease is not None and lease.watch.pid == leased
    try:
        again = adopt_pidfds([nspid(leased)], [True], [os.pidfd_open(leased)])
        with pytest.raises(SandboxStartError):
            host._new_members(again, "a spawn naming a lease in flight")
    finally:
        host._leases.settle(lease)
        lease.close()


def test_a_frame_that_can_never_complete_is_read_and_refused():
    a, b = socket.socketpair()
    a.send(b"\x64\x00\x00\x00\x00\x00\x00\x00" + b"\x80")  # 100 bytes announced, 1 sent
    assert not control.frame_queued(b)
    a.close()  # ... and then the peer hung up: the receive says so, it waits for nothing
    assert control.frame_queued(b)
    with pytest.raises(EOFError):
        control.recv_message(b)
    c, d = socket.socketpair()
    c.send(b"\x00\x00\x10\x00\x00\x00\x00\x00")  # 1 MiB announced to a 4 KiB reader
    assert control.frame_queued(d, 4096)
    for s in (b, c, d):
        s.close()

"""IdlePool (gym_fork/hosts/process/idle.py) on its own: when it fills, what it hands
over, and which idle sandboxes it refuses to use (children that only wait)."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from gym_fork.hosts.process import idle, leases
from gym_fork.hosts.process import messages as M
from gym_fork.system.children import kill_child
from tests.helpers import reap_child, tracked_idle_pool

pytestmark = pytest.mark.process_only
SPEC = M.SandboxSpec("w0", [0], [0], 4096)


def wait_for_assignment(sock: socket.socket, close: list[int], taken: int) -> None:
    """An idle child for the tests: report what it was handed on fd 1's pipe, exit."""
    for fd in close:
        os.close(fd)
    assignment, fds = idle.await_assignment(sock, taken)
    os.write(REPORT_W, f"{assignment.spec.name} {len(fds)}".encode())
    os._exit(0)


REPORT_R, REPORT_W = -1, -1


@pytest.fixture
def pool():
    global REPORT_R, REPORT_W
    REPORT_R, REPORT_W = os.pipe()
    yield from tracked_idle_pool(2, wait_for_assignment)
    os.close(REPORT_R)
    os.close(REPORT_W)


@pytest.fixture
def leasing(pool):
    """The pool with a lease channel open, and the controller's end of it."""
    pool.requests = 2
    controller = socket.socket(fileno=pool.open_lease_channel())
    yield pool, controller
    controller.close()


def made_pids(pool: idle.IdlePool) -> set[int]:
    return {i.pid for i in pool.waiting}


def fds() -> list[int]:
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(M.FDS_PER_SANDBOX)]


def test_the_pool_fills_only_from_the_second_request(pool):
    assert pool.fill() == []
    pool.note_request()
    assert pool.fill() == []
    pool.note_request()
    new = pool.fill()
    assert len(new) == 2 and made_pids(pool) == set(new)
    assert pool.fill() == []  # full


def test_an_idle_sandbox_gets_its_spec_and_fds(pool):
    pool.requests = 2
    first, _ = pool.fill()
    handed = fds()
    assert pool.assign(M.Assign(SPEC, None), handed) == first
    M.close_fds(handed)
    assert reap_child(first) == 0
    assert os.read(REPORT_R, 100) == f"w0 {M.FDS_PER_SANDBOX}".encode()
    assert first not in made_pids(pool)


def test_a_stopped_idle_sandbox_is_killed_listed_and_skipped(pool):
    pool.requests = 2
    stopped, other = pool.fill()
    os.kill(stopped, signal.SIGSTOP)
    handed = fds()
    try:
        assert pool.assign(M.Assign(SPEC, None), handed) == other
    finally:
        M.close_fds(handed)
    assert reap_child(stopped) == -signal.SIGKILL
    assert [pid for pid, _ in pool.take_discarded()] == [stopped]
    assert pool.take_discarded() == []
    assert reap_child(other) == 0


def test_no_usable_idle_sandbox_means_a_fresh_fork(pool):
    handed = fds()
    try:
        assert pool.assign(M.Assign(SPEC, None), handed) == 0  # empty
    finally:
        M.close_fds(handed)


def test_a_reaped_idle_sandbox_leaves_the_pool(pool):
    pool.requests = 2
    gone, kept = pool.fill()
    kill_child(gone)
    reap_child(gone)
    pool.forget(gone)
    assert made_pids(pool) == {kept}


def test_the_pool_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "5")
    assert idle.pool_size() == 5
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "99")
    assert idle.pool_size() == 16
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "lots")
    assert idle.pool_size() == idle.DEFAULT_SIZE


def test_with_a_lease_channel_each_new_idle_sandbox_is_leased(leasing):
    pool, controller = leasing
    assert pool.open_lease_channel() is None  # once
    new = pool.fill()
    assert len(new) == 2 and made_pids(pool) == set() and set(pool.leases.leased) == set(new)
    offered = receive_leases(controller, 2)
    assert set(offered) == set(new)
    assign_leased(pool, offered, new[0])  # the controller assigns it
    assert set(pool.leases.leased) == {new[1]}
    refill = pool.fill()  # back to the pool's size, leased too
    assert len(refill) == 1 and set(pool.leases.leased) == {new[1], *refill}
    for sock in offered.values():
        sock.close()


def test_a_closed_lease_channel_kills_the_sandbox_it_could_not_lease(pool):
    pool.requests = 2
    controller = socket.socket(fileno=pool.open_lease_channel())
    controller.close()
    (first, *_) = pool.fill()
    assert reap_child(first) == -signal.SIGKILL
    assert pool.leases.channel is None and first not in pool.leases.leased


def wait_readable_fd(fd: int, timeout: float = 5.0) -> bool:
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def test_a_new_idle_sandbox_closes_the_channel_and_the_others_pipes(leasing):
    pool, _controller = leasing
    pool.fill()
    internal = set(pool._internal_fds())
    assert pool.leases.channel is not None and pool.leases.channel.fileno() in internal
    assert set(pool.leases.leased.values()) <= internal  # what the next one forked closes


def test_a_leased_sandbox_that_dies_unassigned_counts_and_one_assigned_does_not(leasing):
    pool, controller = leasing
    first, second = pool.fill()
    offered = receive_leases(controller, 2)
    kill_child(first)
    reap_child(first)
    pool.forget(first)  # reaped before its taken pipe was seen: still a death
    assert pool.leases.deaths == 1
    assign_leased(pool, offered, second)
    assert pool.leases.deaths == 0  # a sandbox assigned: the count starts again
    for sock in offered.values():
        sock.close()


def test_after_max_lease_deaths_the_warm_parent_stops_leasing(leasing):
    pool, controller = leasing
    pool.leases.deaths = leases.MAX_LEASE_DEATHS - 1
    (first, *_) = pool.fill()
    M.close_fds(M.receive(controller, M.Leased)[1])
    kill_child(first)
    reap_child(first)
    pool.forget(first)
    assert pool.leases.channel is None and not pool.leases.leasing
    assert pool.open_lease_channel() is None  # for good
    new = pool.fill()
    assert new and made_pids(pool) >= set(new)  # new idle sandboxes wait in the pool


def receive_leases(controller: socket.socket, n: int) -> dict[int, socket.socket]:
    """Read ``n`` leases as the controller would: pid -> the sandbox's socket."""
    offered = {}
    for _ in range(n):
        lease, (pidfd, sock_fd) = M.receive(controller, M.Leased)
        os.close(pidfd)
        offered[lease.pid] = socket.socket(fileno=sock_fd)
    return offered


def assign_leased(pool: idle.IdlePool, offered: dict[int, socket.socket], pid: int) -> None:
    """Assign leased sandbox ``pid`` as the controller would; it reports and exits."""
    handed = fds()
    M.send(offered[pid], M.Assign(SPEC, None), handed)
    M.close_fds(handed)
    taken = pool.leases.leased[pid]
    assert wait_readable_fd(taken), "the assigned sandbox did not say it was taken"
    pool.leases.taken(taken)
    assert reap_child(pid) == 0
    assert os.read(REPORT_R, 100) == f"w0 {M.FDS_PER_SANDBOX}".encode()

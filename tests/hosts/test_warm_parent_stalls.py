"""A warm parent (it runs env code) that stalls mid-message, or whose refill fork fails:
what it may cost the controller (gym_fork/hosts/process/leases.py take(), idle.py fill(),
gym_fork/transport/control.py deadlines)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.process import idle, leases, parent
from gym_fork.hosts.process import messages as M
from tests.helpers import watchdog

pytestmark = pytest.mark.process_only


def admit_all(watches, what):
    return watches


def test_a_stalled_lease_frame_is_not_waited_for_at_full_cpu():
    """A warm parent owes a lease and writes one byte of its frame, then nothing: the
    frame is never whole (frame_queued says no), yet the channel polls readable, so
    take() looped poll/peek at once until its deadline. Every spawn of a last sandbox
    would then burn OWED_WAIT_S of a core, under the host's lock, for the env's whole
    life (the stalled frame never completes, so no lease ever arrives and nothing is
    owed less). The wait must sleep, or give up, not spin."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    held = leases.IdleLeases()
    held.open(ours.detach())
    try:
        held.owed = 1  # one taken, not replaced yet
        theirs.send(b"\x01")  # the first byte of a header, and no more
        with watchdog(10.0):
            cpu, start = time.thread_time(), time.monotonic()
            assert held.take(admit_all, 0.5) is None
            wall, cpu = time.monotonic() - start, time.thread_time() - cpu
        # It may give up at once (the spawn asks the warm parent) or sleep; never spin.
        assert cpu < max(0.25 * wall, 0.02), f"take() spun: {cpu:.3f} s of CPU in {wall:.3f} s"
    finally:
        held.close()
        theirs.close()


def _pipes() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if stat.S_ISFIFO(os.fstat(int(name)).st_mode):
                found.add(int(name))
    return found


def test_a_refill_whose_fork_fails_does_not_end_the_warm_parent(monkeypatch):
    """The warm parent refills its idle pool after a reply (serve()); a fork there that
    fails (EAGAIN at a pids limit the controller's own cgroup sets, ENOMEM) was not
    caught: serve() raised, run() killed every sandbox of the tree and the warm parent
    exited. A fork failing in a Spawn is a Refused; in a background refill it must cost
    at most that refill (and leak nothing: fill() makes the lease's taken pipe and the
    idle sandbox's socketpair before its fork)."""

    def no_fork() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(idle, "fork", no_fork)
    controller, warm_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    warm = parent.WarmParent.__new__(parent.WarmParent)
    warm.sock = warm_end
    warm.controller = -1
    warm.exit_codes = {}
    warm.spawned = set()
    warm.idle = idle.IdlePool(2, lambda sock, close, taken: None)
    warm.spawn = lambda request, fds: []  # type: ignore[method-assign]
    warm.reap = lambda: None  # type: ignore[method-assign]  # (waitpid(-1): pytest's children)
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            warm.serve()
        except BaseException as exc:
            failed.append(exc)

    pipes_before = _pipes()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with watchdog(20.0):
            for _ in range(2):  # the second request opens the lease channel and fills
                M.send(controller, M.Spawn([], None))
                reply, fds = M.receive_reply(controller, 5.0, "spawn", M.Spawned, M.Refused)
                M.close_fds(fds)
                assert isinstance(reply, M.Spawned)
            time.sleep(0.3)  # the refill runs (and its fork fails)
            try:
                M.send(controller, M.WorkerStatus(12345))
                reply, _ = M.receive_reply(controller, 3.0, "status", M.WorkerExit)
            except (OSError, SandboxStartError) as exc:
                pytest.fail(f"the warm parent stopped serving after a failed refill: {exc!r}")
            assert not failed, f"serve() raised: {failed!r}"
            assert _pipes() <= pipes_before, "a failed refill leaked its taken pipe"
    finally:
        controller.close()  # serve() returns at EOF
        thread.join(5.0)
        warm.idle.close()
        warm_end.close()
        failed.clear()  # (its traceback holds fill()'s socketpair)
        for fd in _pipes() - pipes_before:  # what a failed fill() leaked
            os.close(fd)
    assert not thread.is_alive()


@pytest.mark.slow  # 1.0 s here
def test_a_reply_trickled_by_the_warm_parent_cannot_hold_the_controller_past_its_timeout():
    """receive_reply waited ``timeout`` for the first byte only; the control socket has
    no timeout, so a warm parent that wrote one byte of its Spawned and stopped held the
    controller in recvmsg for good, with the host's lock held (every other spawn,
    exit_code() and close() of the tree wait behind it). The whole reply must come by
    the deadline."""
    controller, warm_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        warm_end.send(b"\x01")
        with watchdog(5.0), pytest.raises(SandboxStartError):
            M.receive_reply(controller, 1.0, "spawn", M.Spawned, M.Refused)
    finally:
        controller.close()
        warm_end.close()


def test_a_warm_parent_that_takes_no_request_is_replaced_at_the_next_reset(monkeypatch):
    """A send to the warm parent that fails (it shut down its reading end, or is dying)
    fails that spawn naming it, and the next health check replaces it, even while its
    pidfd says it runs: it must not fail every later spawn the same way."""
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "0")  # every spawn asks the warm parent
    envs = ForkVectorEnv.from_parent(lambda: gym.make("CartPole-v1"), 1, lineage_log=False)
    try:
        envs.reset(seed=0)
        host = envs.sandboxes.host
        send = M.send

        def refuse_spawns(sock, message, fds=()):
            if isinstance(message, M.Spawn):
                raise BrokenPipeError(errno.EPIPE, "Broken pipe")
            return send(sock, message, fds)

        monkeypatch.setattr(M, "send", refuse_spawns)
        with watchdog(30.0), pytest.raises(SandboxStartError, match="warm parent"):
            envs.reset(seed=1)
        monkeypatch.setattr(M, "send", send)
        assert host.watch is not None and host.watch.alive()  # it runs, yet is of no use
        assert not host.alive()
        with watchdog(30.0):
            envs.reset(seed=2)
            envs.step(np.zeros(1, dtype=np.int64))
        assert envs.sandboxes.host is not host
    finally:
        envs.close()

"""Deadlines and dead ends around leases and the warm parent: the warm parent's lease
send timeout (gym_fork/hosts/process/idle.py), fd numbers above 1023 in the loops that
wait on several fds (gym_fork/system/linux.py ``readable``, the warm parent's serve
loop), and replace() once the warm parent died (gym_fork/vector/lifecycle.py)."""

from __future__ import annotations

import gc
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.process import idle, leases
from gym_fork.system.children import kill_child, parent_of
from gym_fork.system.linux import readable, wait_readable
from gym_fork.vector import lifecycle
from tests.helpers import (
    alive,
    descendants,
    gym_fork_scratch_dirs,
    gym_fork_shm_files,
    marked_processes,
    open_fds,
    reap_child,
    tracked_idle_pool,
    wait_until,
    watchdog,
)

pytestmark = pytest.mark.process_only
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TWO = np.zeros(2, dtype=np.int64)


def cartpole():
    return gym.make("CartPole-v1")


class Leaks:
    """What this process holds now; :meth:`check` says what it holds more later."""

    def __init__(self) -> None:
        gc.collect()
        self.procs, self.marked, self.fds = descendants(), marked_processes(), open_fds()
        self.shm, self.scratch = gym_fork_shm_files(), gym_fork_scratch_dirs()

    def check(self, timeout: float = 5.0) -> None:
        gc.collect()
        assert wait_until(lambda: descendants() <= self.procs, timeout), (
            f"leaked processes: {descendants() - self.procs}"
        )
        assert wait_until(lambda: marked_processes() <= self.marked, timeout), (
            f"leaked sandbox processes (found by marker): {marked_processes() - self.marked}"
        )
        assert wait_until(lambda: open_fds() <= self.fds, timeout), (
            f"leaked fds: {open_fds() - self.fds}"
        )
        assert gym_fork_shm_files() <= self.shm, f"leaked shm: {gym_fork_shm_files() - self.shm}"
        assert wait_until(lambda: gym_fork_scratch_dirs() <= self.scratch, timeout), (
            f"leaked scratch dirs: {gym_fork_scratch_dirs() - self.scratch}"
        )


# -- 1. the warm parent's lease send timeout ----------------------------------------------


def wait_for_eof(sock: socket.socket, close: list[int], taken: int) -> None:
    """An idle child for the tests: holds its socket until the other end closes it,
    then exits 0 (a SIGKILL is the only other way out)."""
    try:
        for fd in close:
            os.close(fd)
        while sock.recv(4096):
            pass
    finally:
        os._exit(0)


@pytest.fixture
def pool():
    """An IdlePool of one whose children only wait (each killed and reaped after)."""
    yield from tracked_idle_pool(1, wait_for_eof)


def stuff(channel: socket.socket, deadline_s: float = 5.0) -> int:
    """Fill ``channel``'s send buffer (its peer never reads) until nothing more fits;
    the bytes it took. Sent through a copy of the fd: the channel's own timeout stays."""
    channel.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    filler = socket.socket(fileno=os.dup(channel.fileno()))
    filler.setblocking(False)
    sent = 0
    deadline = time.monotonic() + deadline_s
    try:
        for chunk in (b"\0" * 4096, b"\0" * 256, b"\0"):
            while time.monotonic() < deadline:
                try:
                    sent += filler.send(chunk)
                except BlockingIOError:
                    break
        assert time.monotonic() < deadline, "the lease channel never filled up"
    finally:
        filler.close()
    return sent


def test_the_lease_channel_send_timeout_is_read_when_the_channel_opens(monkeypatch):
    made = idle.IdlePool(1, wait_for_eof)
    made.requests = 2
    theirs = socket.socket(fileno=made.open_lease_channel())
    try:
        assert made.leases.channel is not None
        timeout = made.leases.channel.gettimeout()
        assert timeout is not None and 0 < timeout == leases.LEASE_SEND_TIMEOUT_S
    finally:
        made.close()
        theirs.close()
    monkeypatch.setattr(leases, "LEASE_SEND_TIMEOUT_S", 0.25)
    made = idle.IdlePool(1, wait_for_eof)
    made.requests = 2
    theirs = socket.socket(fileno=made.open_lease_channel())
    try:
        assert made.leases.channel is not None and made.leases.channel.gettimeout() == 0.25
    finally:
        made.close()
        theirs.close()


def test_a_lease_the_controller_does_not_read_kills_the_sandbox_and_stops_leasing(
    pool, monkeypatch
):
    timeout = 0.2
    monkeypatch.setattr(leases, "LEASE_SEND_TIMEOUT_S", timeout)  # read by open_lease_channel
    pool.requests = 2
    controller = socket.socket(fileno=pool.open_lease_channel())
    try:
        assert pool.leases.channel is not None and pool.leases.channel.gettimeout() == timeout
        channel_fd = pool.leases.channel.fileno()
        controller.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuffed = stuff(pool.leases.channel)  # a controller that stopped reading
        assert stuffed > 0
        fds_before = open_fds()

        started = time.monotonic()
        with watchdog(timeout + 5.0):
            victim, *rest = pool.fill()
        took = time.monotonic() - started
        assert took >= timeout * 0.9, f"the lease send gave up after {took:.3f} s, not on time"
        assert took < timeout + 3.0, f"the lease send blocked {took:.3f} s"
        # The sandbox it could not lease is killed (not left to exit at its socket's EOF).
        assert reap_child(victim) == -signal.SIGKILL
        assert pool.leases.channel is None and not pool.leases.leasing and pool.leases.leased == {}
        # The same fill goes on without leases: its next sandbox waits in the pool.
        assert [i.pid for i in pool.waiting] == rest and len(rest) == 1
        # The victim's taken pipe, pidfd and socket are closed, and our end of the
        # channel; only the waiting sandbox's socket is new.
        expected = (fds_before - {channel_fd}) | {pool.waiting[0].sock.fileno()}
        assert wait_until(lambda: open_fds() == expected, 2.0), f"fds: {open_fds() ^ expected}"
        # The controller sees the channel closed after what was queued: nothing of the
        # lease (no byte, no fd) got through.
        controller.settimeout(5.0)
        received = 0
        while True:
            chunk, ancillary, _flags, _ = controller.recvmsg(65536, socket.CMSG_SPACE(64))
            assert ancillary == [], "fds came on a lease channel given up"
            if not chunk:
                break
            received += len(chunk)
        assert received == stuffed

        # For good: a later request opens no channel, a later fill keeps its sandbox.
        (first,) = rest
        kill_child(first)
        assert reap_child(first) == -signal.SIGKILL
        pool.forget(first)
        pool.note_request()
        assert pool.open_lease_channel() is None
        with watchdog(5.0):
            (waiting,) = pool.fill()
        assert [i.pid for i in pool.waiting] == [waiting] and pool.leases.leased == {}
        assert pool.leases.channel is None
        pool.close()  # its socket closed: it exits by itself (it was no lease)
        assert reap_child(waiting) == 0
    finally:
        controller.close()


# -- 2. fd numbers above 1023 --------------------------------------------------------------


@pytest.fixture
def fd_room():
    """A soft RLIMIT_NOFILE that allows fd 2100 (restored afterwards)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def moved(sock: socket.socket, number: int) -> socket.socket:
    """``sock`` as fd ``number`` (which must be free), the old fd closed."""
    with pytest.raises(OSError):
        os.fstat(number)
    os.dup2(sock.fileno(), number, inheritable=False)
    sock.close()
    return socket.socket(fileno=number)


def test_readable_watches_fd_numbers_above_1023(fd_room):
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    high, other = moved(a, 1500), moved(c, 2100)
    try:
        with pytest.raises(ValueError):
            select.select([other], [], [], 0)  # why poll: select cannot watch this fd
        assert readable([1500, 2100], 0) == []
        b.send(b"x")
        assert readable([1500, 2100], 0) == [1500]
        assert readable([2100, 1500], 1.0) == [1500]  # ready: no wait
        assert wait_readable(1500, 0) and not wait_readable(2100, 0)

        started = time.monotonic()
        assert readable([2100], 0.3) == []
        waited = time.monotonic() - started
        assert 0.29 <= waited < 3.0, f"readable(timeout=0.3) returned after {waited:.3f} s"

        late = threading.Timer(0.1, d.send, args=(b"y",))
        late.start()
        started = time.monotonic()
        try:
            assert readable([2100], 10.0) == [2100]
        finally:
            late.join(5.0)
        assert time.monotonic() - started < 5.0

        high.recv(1)
        other.recv(1)
        d.close()  # hung up: readable too
        assert readable([1500, 2100], 1.0) == [2100]
        assert wait_readable(2100, 1.0)
    finally:
        for s in (high, other, b, d):
            s.close()


FD_SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys, time
    import gymnasium as gym
    import numpy as np

    def push_fds_above(n):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < n + 512:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n + 512, hard))
        held = [os.open(os.devnull, os.O_RDONLY)]
        while held[-1] < n:
            held.append(os.open(os.devnull, os.O_RDONLY))
        return held

    # The controller's fds: the socket it hands a new interpreter keeps its number.
    HELD = push_fds_above(int(sys.argv[1]))

    def make():
        # In the warm parent: its idle sandboxes' sockets and taken pipes, and the lease
        # channel, are opened after this, all above 2100.
        HELD.extend(push_fds_above(2100))
        return gym.make("CartPole-v1")

    from gym_fork import ForkVectorEnv

    def high_fds(pid):
        kinds = {}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if int(fd) > 1023:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                kind = target.split(":")[0]
                if kind in ("socket", "pipe"):
                    kinds.setdefault(kind, []).append(int(fd))
        return kinds

    def leases(host):
        with host._lock:
            host._leases._drain(host._new_members)
        return {lease.watch.pid for lease in host._leases.ready}

    envs = ForkVectorEnv.from_parent(make, 1, seed=0, lineage_log=False)
    host = envs.sandboxes.host
    first = host.pid
    out = {"forked_by_zygote": host.process is None, "rewards": [], "leased": 0}
    envs.reset(seed=0)
    envs.reset(seed=1)  # the second spawn request opens the lease channel
    for seed in range(2, 7):
        deadline = time.monotonic() + 10
        while not leases(host) and time.monotonic() < deadline:
            time.sleep(0.01)
        offered = leases(host)
        if seed == 2:
            out["warm_parent_fds"] = high_fds(first)
        envs.reset(seed=seed)
        out["leased"] += envs.worker_pids[0] in offered
        _, reward, *_ = envs.step(np.zeros(1, dtype=np.int64))
        out["rewards"].append(float(reward[0]))
    out["same_warm_parent"] = envs.sandboxes.host.pid == first and host.alive()
    envs.close()
    print(json.dumps(out), flush=True)
    """
)


def run_controller(code: str, env: dict[str, str], *args: str) -> tuple[dict, str, int]:
    """Run ``code`` as a controller of its own; what it printed last (JSON), its stderr,
    its pid. Its sandboxes are checked gone (by their marker) before this returns."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert wait_until(lambda: not marked_processes(proc.pid), 5.0), (
        f"the controller's sandboxes outlived it: {marked_processes(proc.pid)}"
    )
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err, proc.pid


@pytest.mark.slow  # 1.1 s here
def test_a_warm_parent_serves_with_its_fds_above_1023():
    env = dict(os.environ, GYM_FORK_ZYGOTE="0", GYM_FORK_IDLE_SANDBOXES="2")
    report, err, _ = run_controller(FD_SCRIPT, env, "1400")
    assert not report["forked_by_zygote"]  # a fresh interpreter: its socket is fd > 1400
    high = report["warm_parent_fds"]
    assert any(fd > 1400 for fd in high.get("socket", [])), high  # the control socket
    assert any(fd > 2100 for fd in high.get("pipe", [])), high  # the taken pipes
    # Five clones taken from leases, a pool of two: each refill came from the serve loop
    # seeing a taken pipe above 2100 readable.
    assert report["leased"] == 5, report
    assert report["same_warm_parent"], report
    assert report["rewards"] == [1.0] * 5
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow  # 1.1 s here
def test_a_zygote_serves_a_controller_whose_fds_are_above_1023():
    env = dict(os.environ, GYM_FORK_ZYGOTE="1", GYM_FORK_IDLE_SANDBOXES="2")
    report, err, _ = run_controller(FD_SCRIPT, env, "1400")
    assert report["same_warm_parent"] and report["rewards"] == [1.0] * 5, report
    assert report["forked_by_zygote"] and "Traceback" not in err, (
        f"the warm parent is no fork of the zygote: {err[-2000:]}"
    )


# -- 3. replace() after the warm parent died -----------------------------------------------


def tree_of(envs: ForkVectorEnv, before: set[int]) -> set[int]:
    """Every process of ``envs``'s warm parent tree (marked), not those of ``before``."""
    tree = marked_processes() - before
    assert envs.sandboxes.host.pid in tree and set(envs.worker_pids) <= tree
    return tree


def kill_warm_parent(envs: ForkVectorEnv, before: set[int]) -> int:
    """SIGKILL the warm parent; returns its pid once its whole tree is gone."""
    old = envs.sandboxes.host.pid
    tree = tree_of(envs, before)
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: not alive(tree), 5.0), f"left of the tree: {alive(tree)}"
    assert not envs.sandboxes.host.alive()
    return old


def started(envs: ForkVectorEnv) -> None:
    """Two resets (the second opens the lease channel) and a step each."""
    for seed in (0, 1):
        envs.reset(seed=seed)
        envs.step(TWO)


@pytest.mark.slow  # 1.4 s here
def test_a_reset_after_the_warm_parent_died_clones_a_new_one_and_leaks_nothing(tmp_path):
    leaks = Leaks()
    envs = ForkVectorEnv.from_parent(cartpole, 2, seed=0, lineage_log=tmp_path / "log.jsonl")
    try:
        first_obs, _ = envs.reset(seed=0)
        envs.step(TWO)
        envs.reset(seed=1)
        old = kill_warm_parent(envs, leaks.marked)
        obs, _ = envs.reset(seed=0)
        host = envs.sandboxes.host
        new = host.pid
        assert new != old and host.alive()
        assert all(parent_of(pid) == new for pid in envs.worker_pids)  # clones of the new one
        np.testing.assert_array_equal(obs, first_obs)  # the cold launch prepared the same env
        _, reward, *_ = envs.step(TWO)
        assert list(reward) == [1.0, 1.0]
        envs.reset(seed=2)  # and it stays: no other launch
        assert envs.sandboxes.host.pid == new
        envs.step(TWO)
        events = [e for e in envs.lineage.record.events if e["event"] == "replaced_warm_parent"]
        assert len(events) == 1, events
        assert events[0]["old_pid"] == old and events[0]["new_pid"] == new
    finally:
        envs.close()
    leaks.check()


class InjectedSpawnFailure(SandboxStartError):
    pass


@pytest.mark.parametrize("then", ["close", "reset"])
def test_a_failed_spawn_after_the_warm_parent_died_releases_the_old_sandboxes(monkeypatch, then):
    leaks = Leaks()
    envs = ForkVectorEnv.from_parent(cartpole, 2, seed=0, lineage_log=False)
    try:
        started(envs)
        old_workers = list(envs.sandboxes.pool.workers)
        made = []
        real_make_host = lifecycle.make_host

        def make_host(config):
            host = real_make_host(config)
            made.append(host)
            real_spawn = host.spawn

            def spawn_once(*args, **kwargs):
                host.spawn = real_spawn  # only the first spawn of the new warm parent fails
                raise InjectedSpawnFailure("injected: the new warm parent made no sandbox")

            host.spawn = spawn_once
            return host

        monkeypatch.setattr(lifecycle, "make_host", make_host)
        old = kill_warm_parent(envs, leaks.marked)
        with pytest.raises(InjectedSpawnFailure, match="injected"):
            envs.reset(seed=0)
        # The cold launch happened; only its spawn failed. The old sandboxes stay in the
        # pool, dead, until a replacement or the teardown releases them.
        assert len(made) == 1 and envs.sandboxes.host is made[0]
        assert made[0].pid != old and made[0].alive()
        assert envs.sandboxes.pool.workers == old_workers
        assert not any(w.alive() for w in old_workers)
        if then == "reset":
            envs.reset(seed=0)
            assert len(made) == 1  # the new warm parent is used, not launched again
            assert all(parent_of(pid) == made[0].pid for pid in envs.worker_pids)
            _, reward, *_ = envs.step(TWO)
            assert list(reward) == [1.0, 1.0]
    finally:
        envs.close()
    leaks.check()


def test_a_failed_cold_launch_after_the_warm_parent_died_is_named_and_leaks_nothing(tmp_path):
    flag = str(tmp_path / "refuse")

    def refusing_cartpole():
        if os.path.exists(flag):
            raise RuntimeError("cold launch refused by the test")
        return gym.make("CartPole-v1")

    leaks = Leaks()
    envs = ForkVectorEnv.from_parent(refusing_cartpole, 2, seed=0, lineage_log=False)
    try:
        started(envs)
        with open(flag, "w"):
            pass
        old = kill_warm_parent(envs, leaks.marked)
        with pytest.raises(SandboxStartError, match="could not prepare") as info:
            envs.reset(seed=0)
        assert "cold launch refused by the test" in str(info.value)
        assert envs.sandboxes.host.pid == old  # still the dead one: nothing replaced it
        assert marked_processes() <= leaks.marked  # the failed launch left nothing running
        os.unlink(flag)
        envs.reset(seed=0)
        assert envs.sandboxes.host.pid != old and envs.sandboxes.host.alive()
        _, reward, *_ = envs.step(TWO)
        assert list(reward) == [1.0, 1.0]
    finally:
        envs.close()
    leaks.check()


HOLDER = textwrap.dedent(
    """
    import ctypes, os, select, sys, time
    # A process in the warm parent's pid namespace whose parent is outside it: killed
    # with the namespace, its zombie is reaped only by us, and until then the warm
    # parent (the namespace's init) cannot finish exiting: its pidfd is not readable.
    # Reaped once our stdin closes (at most 20 s).
    libc = ctypes.CDLL(None, use_errno=True)
    ns = os.open(f"/proc/{sys.argv[1]}/ns/pid", os.O_RDONLY)
    if libc.setns(ns, 0x20000000) != 0:  # CLONE_NEWPID
        sys.exit("setns: " + os.strerror(ctypes.get_errno()))
    pid = os.fork()
    if pid == 0:
        while True:
            time.sleep(10)
    print(pid, flush=True)
    select.select([sys.stdin], [], [], 20)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    """
)


@pytest.mark.slow  # 2.7 s here
def test_a_reset_while_the_warm_parent_is_dying_recovers():
    envs = ForkVectorEnv.from_parent(cartpole, 2, seed=0, lineage_log=False)
    holder = None
    try:
        started(envs)
        host = envs.sandboxes.host
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(host.pid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        if not holder.stdout.readline().strip().isdigit():
            pytest.skip("cannot fork into the warm parent's pid namespace (setns)")
        os.kill(host.pid, signal.SIGKILL)
        assert host.sock is not None and wait_readable(host.sock.fileno(), 5.0)  # closed
        assert host.watch is not None and host.watch.alive()  # ... but not gone yet
        envs.reset(seed=0)  # a closed control socket is a dead warm parent: a new one
        assert envs.sandboxes.host is not host
        envs.step(TWO)
    finally:
        try:
            if holder is not None:
                holder.communicate(timeout=10)  # closes its stdin: it reaps its child
        finally:
            envs.close()

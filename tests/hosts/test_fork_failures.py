"""A FORK that fails midway leaves no clone running (gym_fork/hosts/process/sandbox.py):
a clone that cannot be made (the pids cgroup's pids.max reached, in the worker, a helper
or the double fork's helper), snapshots that never finish (env code in a clone holds
the snapshot pipe open) or helpers that never report (env code hangs in them) fail the
FORK with an error that says why, and the clones made so far are killed by pidfd.
Leftovers are looked for where clones live: among the warm parent's children (and a
double fork's source's), not the controller's descendants.

Root is exempt from RLIMIT_NPROC (and a sandbox cannot change its uid), so the kernel's
own EAGAIN comes from the pids cgroup limit, which binds root and which a clone shares
with its source.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SubEnvError
from gym_fork.system import cgroups
from gym_fork.system.children import live_children
from gym_fork.system.isolation import SandboxLimits
from tests.helpers import wait_until

needs_pids_cgroup = pytest.mark.skipif(
    cgroups.controller_root("pids") is None, reason="no writable pids cgroup controller"
)


def _join_own_cgroups_late() -> None:
    """A clone moves into cgroups of its own as its first step (test_branch_memory.py):
    an at-fork hook that sleeps first keeps it in its source's pids cgroup meanwhile,
    where the fan-out meets pids.max."""
    os.register_at_fork(after_in_child=lambda: time.sleep(0.5))


def cartpole() -> gym.Env:
    _join_own_cgroups_late()
    return gym.make("CartPole-v1")


class ThreadedEnv(gym.Wrapper):
    """CartPole with a second thread in its sandbox: its FORK takes the double fork."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        _join_own_cgroups_late()


class ForkHookEnv(gym.Wrapper):
    """CartPole whose env code, once armed, runs in each process its worker forks from
    its first instruction (an at-fork hook): ``hold`` keeps a copy of every fd it
    inherited (the snapshot pipe's write end among them, so its source never sees
    EOF); ``hang`` never returns (a helper then reports nothing)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def arm(self, hook: str, timeout: float) -> None:
        from gym_fork.hosts.process import sandbox

        sandbox.SNAPSHOT_TIMEOUT = timeout
        held: list[int] = []

        def hold() -> None:
            for fd in range(3, 512):
                with contextlib.suppress(OSError):  # not open
                    held.append(os.dup(fd))

        if hook == "hang-after-forking":  # a helper that forked a clone, then hangs
            worker = os.getpid()

            def hang_in_a_helper() -> None:
                if os.getpid() != worker:
                    threading.Event().wait()

            os.register_at_fork(after_in_parent=hang_in_a_helper)
            return
        os.register_at_fork(after_in_child=hold if hook == "hold" else threading.Event().wait)


def _fails_and_leaves_nothing(env: ForkVectorEnv, copies: int, match: str) -> None:
    """``env.fork`` of ``copies`` clones raises SubEnvError matching ``match``, no clone
    of it runs afterwards, and the source steps on."""
    warm_parent = env.sandboxes.host.pid
    source = env.worker_pids[0]
    before = live_children(warm_parent)
    with pytest.raises(SubEnvError, match=match):
        env.fork("doomed", [0], copies=copies)
    # No clone stays among the warm parent's children (nor the source's: a double
    # fork's helper is its child until it exits).
    assert wait_until(lambda: live_children(warm_parent) == before, 2.0), (
        live_children(warm_parent) - before
    )
    assert live_children(source) == set()
    _, rewards, _, _, _ = env.step(np.array([0]))
    assert list(rewards) == [1.0]


@needs_pids_cgroup
@pytest.mark.parametrize(
    ("env_fn", "processes", "copies", "match"),
    [
        # Forked by the worker itself: clone 3 is refused (source + 2 clones = pids.max).
        (cartpole, 3, 6, r"clone 3 of 6 could not be made \(.*Errno 11"),
        # 40 clones are forked by helpers (one per core, up to 40 // 16): pids.max stops
        # them about halfway, after each has made and reported some.
        (cartpole, 20, 40, r"could not be made .*clones made of 40 are killed"),
        # The double fork: the source counts 2 tasks (threads count), its helper 1.
        (ThreadedEnv, 5, 6, r"clone 3 of 6 could not be made .*Errno 11"),
    ],
    ids=["by-the-worker", "by-helpers", "double-fork"],
)
def test_a_fan_out_failing_midway_kills_every_clone_made(env_fn, processes, copies, match):
    env = ForkVectorEnv([env_fn], lineage_log=False, limits=SandboxLimits(processes=processes))
    try:
        env.reset(seed=0)
        _fails_and_leaves_nothing(env, copies, match)
    finally:
        env.close()


@pytest.mark.parametrize(
    ("hook", "copies"),
    # 40: by helpers, where there are 2 cores or more
    [("hold", 2), ("hang", 40), ("hang-after-forking", 40)],
    ids=["clones-hold-the-snapshot-pipe", "helpers-hang", "helpers-hang-after-a-clone"],
)
def test_a_fork_whose_children_never_finish_fails_at_its_deadline(hook, copies):
    env = ForkVectorEnv([ForkHookEnv], lineage_log=False)
    try:
        env.reset(seed=0)
        env.call("arm", hook, 0.5)
        match = r"did not (take their snapshot|report every clone) .*within 0.5 s"
        _fails_and_leaves_nothing(env, copies, match)
    finally:
        env.close()


def test_a_source_whose_side_socket_takes_nothing_is_refused_by_name():
    """A sandbox's side socket ended (a message to it was torn: it did not read in time):
    its forks are refused, naming it and why, and its steps go on."""
    import socket

    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.sandboxes.pool.workers[0].host_data.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(Exception, match="side socket took no message") as refused:
            envs.fork("b")
        assert "sub-env 0" in str(refused.value) or "fork of" in str(refused.value)
        envs.step(np.zeros(1, np.int64))
    finally:
        envs.close()


def test_a_source_whose_fork_fails_before_it_took_its_new_layer_takes_it_all_the_same():
    """Its clones would be forked before it takes its /tmp's new layer (the freeze,
    made meanwhile): where the fork fails first (here refused, before any clone: it
    maps memory shared), it takes the layer all the same (its /tmp stands on it), so
    what it writes next is frozen for its next branch (not copied: a layer taken late,
    at its next fork, comes after that fork's check)."""
    import warnings

    from gym_fork.gpu.cuda import ForkUnsafeError
    from tests.helpers import why_no_frozen_layers
    from tests.hosts.test_frozen_layers import Workspace

    why = why_no_frozen_layers()
    if why:
        pytest.skip(f"no frozen layers here: {why}")

    class SharesMemory(Workspace):
        def share(self):
            import mmap

            self._shared = mmap.mmap(-1, 4096)

    env = ForkVectorEnv([SharesMemory], lineage_log=False)
    try:
        env.reset(seed=0)
        env.call("share")
        env.call("write", "/tmp/ws/f.txt", "before\n")
        with pytest.raises(ForkUnsafeError):
            env.fork("refused", [0], shared_memory="refuse")
        env.call("write", "/tmp/ws/g.txt", "after the refused fork\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # it shares memory with its source: said
            branch = env.fork("b", [0])
        try:
            assert branch.call("read", "/tmp/ws/f.txt") == ("before\n",)
            assert branch.call("read", "/tmp/ws/g.txt") == ("after the refused fork\n",)
            assert branch.call("layers") == (2,)  # both forks froze
        finally:
            branch.close()
    finally:
        env.close()

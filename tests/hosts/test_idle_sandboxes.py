"""Idle sandboxes: forked and isolated ahead of need, handed out by the warm parent."""

from __future__ import annotations

import contextlib
import os
import signal

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from tests.helpers import _descendants, alive, wait_until

pytestmark = pytest.mark.process_only
ONE = np.zeros(1, dtype=np.int64)


def cartpole():
    return gym.make("CartPole-v1")


def idle_pids(envs: ForkVectorEnv) -> set[int]:
    """Processes of the tree that serve no sub-env."""
    return _descendants(envs.sandboxes.host.pid) - set(envs.worker_pids)


def test_after_a_clone_the_next_clones_come_from_the_idle_pool(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "2")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 1)) as envs:
        envs.reset(seed=0)  # construction was the first request; nothing idle yet
        assert wait_until(lambda: len(alive(idle_pids(envs))) == 2, 3.0)
        for seed in range(1, 4):
            waiting = alive(idle_pids(envs))
            envs.reset(seed=seed)  # a fresh clone of the warm parent
            assert set(envs.worker_pids) <= waiting
            envs.step(ONE)
            assert wait_until(lambda: len(alive(idle_pids(envs))) == 2, 3.0)
        report = envs.isolation  # a sandbox from the pool is isolated like any other
        assert report["capabilities"].startswith("dropped") and report["seccomp"].startswith("on (")
        assert report["namespaces"]["pid"] and report["private_tmp"]


def test_a_dead_idle_sandbox_is_skipped(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "1")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 1)) as envs:
        envs.reset(seed=0)
        assert wait_until(lambda: len(alive(idle_pids(envs))) == 1, 3.0)
        (victim,) = alive(idle_pids(envs))
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: victim not in alive({victim}), 2.0)
        envs.reset(seed=1)
        assert victim not in envs.worker_pids
        envs.step(ONE)


def test_pool_off_keeps_no_idle_process(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "0")
    with contextlib.closing(ForkVectorEnv.from_parent(cartpole, 1)) as envs:
        for seed in range(3):
            envs.reset(seed=seed)
        # (the sandbox a reset replaced is killed, not waited for: it may still be exiting)
        assert wait_until(lambda: not alive(idle_pids(envs)), 3.0), alive(idle_pids(envs))

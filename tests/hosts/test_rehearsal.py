"""An idle sandbox rehearses a new sandbox's start before its assignment
(gym_fork/hosts/process/worker.py rehearse): on a channel and slab of its own, with the
prepared env as it is, leaving nothing behind."""

from __future__ import annotations

import os
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest

from gym_fork.hosts.process.worker import rehearse
from gym_fork.system.isolation import IsolationConfig

pytestmark = pytest.mark.process_only


def attach_arg(env: gym.Env) -> dict:
    return {
        "observation_space": env.observation_space,
        "action_space": env.action_space,
        "observation_mode": "custom",
        "autoreset_mode": "NextStep",
        "num_envs": 1,
        "shared_memory": True,
    }


def open_fds() -> set[int]:
    return set(map(int, os.listdir("/proc/self/fd")))


def test_a_rehearsal_runs_no_env_code_and_leaves_no_fd():
    env = gym.make("CartPole-v1")
    env.reset(seed=3)
    state = np.array(env.unwrapped.state).copy()
    calls = []

    def make_env(origin: int) -> gym.Env:
        calls.append(origin)
        return env

    before = open_fds()
    rehearse(
        make_env,
        attach_arg(env),
        warm_parent=os.getpid(),
        isolation=(IsolationConfig(), SimpleNamespace(tree={})),
        entered=(None, {}),
    )
    assert open_fds() == before, "the rehearsal left fds open"
    assert calls == [0]  # the prepared env handed out, nothing built
    assert np.array_equal(np.array(env.unwrapped.state), state), "the env's state changed"
    env.close()


def test_a_rehearsal_that_fails_closes_what_it_opened():
    env = gym.make("CartPole-v1")
    before = open_fds()
    broken = attach_arg(env)
    del broken["autoreset_mode"]  # fails in the worker's attach, after the ring and slab
    with pytest.raises(KeyError):
        rehearse(
            lambda origin: env,
            broken,
            warm_parent=os.getpid(),
            isolation=(IsolationConfig(), SimpleNamespace(tree={})),
            entered=(None, {}),
        )
    assert open_fds() == before
    env.close()

"""The controller never acts on wrong data, never waits without a deadline, and checks
every argument before it allocates (hardening issue, vector-layer items)."""

from __future__ import annotations

import multiprocessing
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv, SandboxStartError, SubEnvTimeout
from tests.helpers import SpaceEnv, descendants


class RecordingEnv(SpaceEnv):
    """Remembers every action it was given; sub-env 1 is slow on its first step."""

    def __init__(self, index: int, slow: float = 0.0):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(4), max_len=100, trunc_prob=0)
        self.index = index
        self.slow = slow
        self.seen: list[int] = []

    def step(self, action):
        if self.slow and not self.seen:
            time.sleep(self.slow)
        self.seen.append(int(action))
        return super().step(action)

    def actions_seen(self):
        return list(self.seen)


def recording_fns(n: int, slow_index: int = 1, slow: float = 1.0):
    return [(lambda i=i: RecordingEnv(i, slow if i == slow_index else 0.0)) for i in range(n)]


@pytest.mark.slow  # 3.9 s here
@pytest.mark.parametrize("envs_per_worker", [1, 2, "auto"])
def test_a_late_step_acts_on_its_own_actions_not_on_the_next_ones(envs_per_worker):
    envs = ForkVectorEnv(recording_fns(4), envs_per_worker=envs_per_worker)
    try:
        envs.reset(seed=0)
        first, second = np.array([0, 1, 2, 3]), np.array([3, 2, 1, 0])
        envs.step_async(first)
        with pytest.raises(multiprocessing.TimeoutError):
            envs.step_wait(timeout=0.3)  # sub-env 1 is still in its slow first step
        envs.step(second)
        seen = envs.call("actions_seen")
        assert [s[:2] for s in seen] == [[0, 3], [1, 2], [2, 1], [3, 0]], seen
        # Caught up: the fast path (actions in the slab) is back and still right.
        envs.step(first)
        assert [s[2] for s in envs.call("actions_seen")] == [0, 1, 2, 3]
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"copies": 10**9}, ValueError, "ceiling"),
        ({"copies": 0}, ValueError, "copies"),
        ({"copies": 2.5}, ValueError, "copies"),
        ({"indices": [0.7]}, TypeError, "ints"),
        ({"indices": [True]}, TypeError, "ints"),
        ({"indices": "0"}, TypeError, "sequence"),
        ({"indices": [5]}, ValueError, r"\[0, 2\)"),
        ({"indices": []}, ValueError, "at least one"),
        ({"reseed": "xy"}, TypeError, "reseed"),
        ({"indices": [0], "reseed": [1.5]}, TypeError, "reseed"),
        ({"indices": [0], "reseed": [-1]}, ValueError, ">= 0"),
        ({"reseed": [1, 2, 3]}, ValueError, "one seed per"),
    ],
)
def test_fork_arguments_are_checked_before_anything_is_made(kwargs, error, text):
    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")] * 2, envs_per_worker=1)
    try:
        envs.reset(seed=0)
        before = descendants()
        started = time.perf_counter()
        with pytest.raises(error, match=text):
            envs.fork("bad-args", **kwargs)
        assert time.perf_counter() - started < 1.0
        assert descendants() == before
        assert envs.step(np.array([0, 1]))[0].shape == (2, 4)  # still usable
    finally:
        envs.close()


def test_the_sandbox_ceiling_applies_to_constructors(monkeypatch):
    monkeypatch.setenv("GYM_FORK_MAX_SANDBOXES", "3")
    before = descendants()
    with pytest.raises(ValueError, match="ceiling is 3"):
        ForkVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    with pytest.raises(ValueError, match="ceiling is 3"):
        ForkVectorEnv.from_parent(lambda: gym.make("CartPole-v1"), 10**9)
    assert descendants() == before


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"envs_per_worker": True}, "envs_per_worker"),
        ({"envs_per_worker": 0}, "envs_per_worker"),
        ({"ring_bytes": 5000}, "ring_bytes"),
        ({"timeout": -1}, "timeout"),
        ({"host": "docker"}, "host"),
        ({"reset_mode": "fresh"}, "reset_mode"),
    ],
)
def test_bad_options_are_named_before_anything_starts(kwargs, text):
    before = descendants()
    with pytest.raises(ValueError, match=text):
        ForkVectorEnv([lambda: gym.make("CartPole-v1")] * 2, **kwargs)
    assert descendants() == before


def _hangs_forever():
    time.sleep(3600)


@pytest.mark.slow  # 3.2 s here
def test_the_constructor_honours_timeout_when_an_env_fn_never_returns():
    started = time.perf_counter()
    with pytest.raises(SubEnvTimeout, match="building the sub-envs"):
        ForkVectorEnv([_hangs_forever, lambda: gym.make("CartPole-v1")], timeout=1.0)
    assert time.perf_counter() - started < 5.0


@pytest.mark.slow  # 6.0 s here
def test_from_parent_honours_timeout_when_the_warmup_never_returns(monkeypatch):
    from gym_fork.vector import config

    # The bound is the timeout plus the start-up allowance, whatever that is: a shorter
    # one here spares this test most of the default's 10 s wait.
    monkeypatch.setattr(config, "STARTUP_ALLOWANCE", 3.0)
    started = time.perf_counter()
    with pytest.raises(SandboxStartError, match="no answer within"):
        ForkVectorEnv.from_parent(
            lambda: gym.make("CartPole-v1"), 2, warmup=lambda env: _hangs_forever(), timeout=1.0
        )
    assert time.perf_counter() - started < 1.0 + config.STARTUP_ALLOWANCE + 5.0


@pytest.mark.slow
@pytest.mark.parametrize("num_envs", [64, 300])
def test_many_one_per_sandbox_sub_envs_build_reset_and_step(num_envs):
    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs, envs_per_worker=1)
    try:
        assert len(set(envs.worker_pids)) == num_envs
        obs, _ = envs.reset(seed=0)
        obs, rewards, *_ = envs.step(np.zeros(num_envs, dtype=np.int64))
        assert obs.shape == (num_envs, 4) and rewards.sum() == num_envs
        branch = envs.fork("wide", indices=[0], copies=num_envs)
        try:
            assert branch.step(np.zeros(num_envs, dtype=np.int64))[0].shape == (num_envs, 4)
        finally:
            branch.close()
    finally:
        envs.close()


@pytest.mark.slow
def test_from_parent_with_128_clones_builds_resets_and_steps():
    envs = ForkVectorEnv.from_parent(lambda: gym.make("CartPole-v1"), 128)
    try:
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (128, 4) and len(set(envs.worker_pids)) == 128
        _, rewards, *_ = envs.step(np.ones(128, dtype=np.int64))
        assert rewards.sum() == 128
    finally:
        envs.close()


class DiesMidReplyEnv(SpaceEnv):
    """Its step returns a 128 MB info (a reply of ~500 fragments) and the sandbox is
    SIGKILLed while that reply is being sent."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=50, trunc_prob=0)
        self.armed = False

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if self.armed:
            import os
            import signal
            import threading

            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
            info = {"blob": b"x" * (128 << 20)}
        return obs, reward, terminated, truncated, info


def test_a_sandbox_dying_in_the_middle_of_a_reply_is_a_crash_with_its_status_at_once():
    from gym_fork import SubEnvCrashed

    envs = ForkVectorEnv([DiesMidReplyEnv, DiesMidReplyEnv], envs_per_worker=1)
    try:
        envs.reset(seed=0)
        envs.set_attr("armed", [True, False])
        started = time.perf_counter()
        with pytest.raises(SubEnvCrashed) as info:
            envs.step(np.array([0, 1]))
        assert time.perf_counter() - started < 5.0  # not the 30 s fragment timeout
        assert info.value.exitcode == -9 and info.value.indices == [0]
        envs.reset(seed=1)  # replaced
        assert envs.step(np.array([0, 1]))[0].shape == (2, 2)
    finally:
        envs.close()


def test_an_env_instead_of_an_env_fn_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"env_fns\[1\] is a TimeLimit .*lambda: gym.make"):
        ForkVectorEnv([lambda: gym.make("CartPole-v1"), gym.make("CartPole-v1")])


class _DeclaresAHugeSpace(gym.Env):
    """A space cheap to declare (gymnasium allocates nothing for it), 1.8 TiB to batch."""

    observation_space = gym.spaces.MultiBinary([10**6, 10**6])
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros((1, 1), np.int8), {}

    def step(self, action):
        return np.zeros((1, 1), np.int8), 0.0, False, False, {}


def test_a_space_too_big_to_batch_is_a_start_error_naming_the_spaces():
    """numpy's MemoryError from batching it was raised as it was; nothing is left."""
    with pytest.raises(SandboxStartError, match="observation_space and action_space"):
        ForkVectorEnv([_DeclaresAHugeSpace] * 2, lineage_log=False)

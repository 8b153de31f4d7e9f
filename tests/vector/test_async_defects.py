"""AsyncVectorEnv's known defects, each fixed in ForkVectorEnv (docs/compatibility.md)."""

from __future__ import annotations

import multiprocessing
import time
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode

from gym_fork import ForkVectorEnv
from tests.helpers import SpaceEnv


class FlakyEnv(SpaceEnv):
    """Raises in step when the action is 2; sleeps ``action`` tenths of a second if 3+."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(9), max_len=1000, trunc_prob=0)

    def step(self, action):
        if action == 2:
            raise ValueError("flaky step exploded")
        if action >= 3:
            time.sleep(action / 10)
        return super().step(action)


def test_subenv_exception_keeps_the_vector_env_usable_and_carries_the_traceback():
    envs = ForkVectorEnv([FlakyEnv for _ in range(3)])
    try:
        envs.reset(seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="flaky step exploded") as info:
                envs.step(np.array([0, 2, 0]))
        notes = "\n".join(info.value.__notes__)
        assert "sub-env 1" in notes
        assert "in step" in notes and 'raise ValueError("flaky step exploded")' in notes
        assert info.value.gym_fork_index == 1
        texts = [str(w.message) for w in caught]
        assert sum("ValueError: flaky step exploded (sub-env 1)" in t for t in texts) == 1
        # AsyncVectorEnv would now have None pipes; here the next calls just work.
        obs, *_ = envs.step(np.array([0, 0, 0]))
        assert obs.shape == (3, 2)
        obs, _ = envs.reset(seed=1)
        assert obs.shape == (3, 2)
    finally:
        envs.close()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_after_a_step_wait_timeout_the_next_step_returns_its_own_results(shared_memory):
    envs = ForkVectorEnv([FlakyEnv for _ in range(2)], shared_memory=shared_memory)
    try:
        envs.reset(seed=0)
        envs.step_async(np.array([0, 5]))  # sub-env 1 sleeps 0.5 s
        with pytest.raises(multiprocessing.TimeoutError, match="step_wait"):
            envs.step_wait(timeout=0.05)
        # The late reply to the timed-out step must not be returned for this one.
        _, _, _, _, info = envs.step(np.array([0, 0]))
        t_after = envs.get_attr("t")
        assert t_after == (2, 2)
        assert info["t"].tolist() == [2, 2]
    finally:
        envs.close()


def test_get_attr_of_a_missing_attribute_raises_but_does_not_break():
    # trusted=True: get_attr("spec") travels pickled until transport/codec.py carries an
    # EnvSpec as plain data (tests/vector/test_trusted_default.py, the xfail).
    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(2)], trusted=True)
    try:
        envs.reset(seed=0)
        with pytest.raises(AttributeError, match="no_such_attribute"):
            envs.get_attr("no_such_attribute")
        obs, *_ = envs.step(np.array([0, 1]))
        assert obs.shape == (2, 4)
        assert envs.get_attr("spec")[0].id == "CartPole-v1"
    finally:
        envs.close()


def test_explicit_reset_clears_a_pending_next_step_autoreset_without_shared_memory():
    env_fns = [lambda: SpaceEnv(spaces.Discrete(50), max_len=2) for _ in range(2)]
    envs = ForkVectorEnv(env_fns, shared_memory=False, autoreset_mode=AutoresetMode.NEXT_STEP)
    sync = gym.vector.SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        for vec in (envs, sync):
            vec.reset(seed=4)
            done = np.zeros(2, bool)
            while not done.all():
                _, _, term, trunc, _ = vec.step(np.array([0, 0]))
                done |= term | trunc
        a, b = envs.reset(seed=9), sync.reset(seed=9)
        assert np.array_equal(a[0], b[0])
        # A pending autoreset would turn this step into a reset (reward 0, no step).
        sa, sb = envs.step(np.array([1, 1])), sync.step(np.array([1, 1]))
        assert np.array_equal(sa[1], sb[1]) and np.all(sa[1] != 0)
        assert envs.get_attr("t") == (1, 1)
    finally:
        envs.close()
        sync.close()

"""``envs_per_worker="auto"`` with as many sub-envs as cores: grouped at first, split into
one sandbox per sub-env (by fork, state kept) once the steps prove slow."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv, SubEnvCrashed
from gym_fork.vector import adaptive
from gym_fork.vector import config as config_module
from tests.helpers import SpaceEnv

pytestmark = pytest.mark.process_only


class BusyEnv(SpaceEnv):
    """SpaceEnv (deterministic by its seeds and actions) with a step that busy-waits."""

    def step(self, action):
        end = time.perf_counter() + 50e-6
        while time.perf_counter() < end:
            pass
        return super().step(action)


def busy_env():
    return BusyEnv(spaces.Box(-1.0, 1.0, (3,), np.float32), spaces.Discrete(3), max_len=9)


@pytest.fixture
def two_cores(monkeypatch):
    """As on a 2-core machine, whatever this one has."""
    monkeypatch.setattr(config_module, "available_cores", lambda: 2)


def run(envs, steps: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    out = [envs.reset(seed=[11, 12])]
    counts = []
    for _ in range(steps):
        out.append(envs.step(rng.integers(0, 3, size=2)))
        counts.append(len(getattr(envs, "worker_pids", [])))
    return out, counts


def test_a_split_continues_every_sub_env_exactly(two_cores, monkeypatch):
    monkeypatch.setenv("GYM_FORK_SPLIT_STEP_US", "0")  # any step is "slow": split at step 40
    with contextlib.closing(ForkVectorEnv([busy_env] * 2)) as envs:
        assert envs.envs_per_worker == 2 and len(envs.worker_pids) == 1
        got, workers = run(envs, 80)
        split = adaptive.FIRST_TIMED_STEP + adaptive.SAMPLES - 1  # the deciding step
        assert workers[split - 2] == 1 and workers[split - 1] == 2
        assert envs.envs_per_worker == 1
    with contextlib.closing(gym.vector.SyncVectorEnv([busy_env] * 2)) as sync:
        want, _ = run(sync, 80)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        for x, y in zip(a[:-1], b[:-1], strict=True):  # obs, rewards, flags: bit-identical
            np.testing.assert_array_equal(x, y, err_msg=f"step {k}")
        assert a[-1].keys() == b[-1].keys(), f"step {k}"
        for key in a[-1]:
            np.testing.assert_array_equal(a[-1][key], b[-1][key], err_msg=f"step {k} {key}")


def test_a_masked_reset_after_a_split_keeps_the_other_sub_envs_observations(two_cores, monkeypatch):
    monkeypatch.setenv("GYM_FORK_SPLIT_STEP_US", "0")
    mask = np.array([False, True])
    with (
        contextlib.closing(ForkVectorEnv([busy_env] * 2)) as envs,
        contextlib.closing(gym.vector.SyncVectorEnv([busy_env] * 2)) as sync,
    ):
        steps = adaptive.FIRST_TIMED_STEP + adaptive.SAMPLES  # the split comes before
        run(envs, steps)
        run(sync, steps)
        assert len(envs.worker_pids) == 2
        got = envs.reset(seed=5, options={"reset_mask": mask})
        want = sync.reset(seed=5, options={"reset_mask": mask})
        np.testing.assert_array_equal(got[0], want[0])


def test_steps_waited_for_late_are_not_timed(two_cores, monkeypatch):
    # A caller that works between step_async and step_wait would make any step look
    # slow: such steps are no samples, so even a zero threshold never splits.
    monkeypatch.setenv("GYM_FORK_SPLIT_STEP_US", "0")
    with contextlib.closing(ForkVectorEnv([busy_env] * 2)) as envs:
        envs.reset(seed=0)
        for _ in range(adaptive.FIRST_TIMED_STEP + adaptive.SAMPLES + 5):
            envs.step_async(np.zeros(2, dtype=np.int64))
            time.sleep(0.001)
            envs.step_wait()
        assert len(envs.worker_pids) == 1


def test_fast_steps_stay_grouped(two_cores, monkeypatch):
    monkeypatch.setenv("GYM_FORK_SPLIT_STEP_US", "1e9")
    with contextlib.closing(ForkVectorEnv([busy_env] * 2)) as envs:
        _, workers = run(envs, 60)
        assert set(workers) == {1}


def test_a_split_sub_env_crashes_alone_and_is_replaced_at_reset(two_cores, monkeypatch):
    monkeypatch.setenv("GYM_FORK_SPLIT_STEP_US", "0")
    with contextlib.closing(ForkVectorEnv([busy_env] * 2, timeout=10)) as envs:
        run(envs, 45)
        first, second = envs.worker_pids
        os.kill(second, signal.SIGKILL)
        with pytest.raises(SubEnvCrashed) as crash:
            envs.step(np.zeros(2, dtype=np.int64))
        assert crash.value.indices == [1]
        envs.reset(seed=[1, 2])
        assert envs.worker_pids[0] == first and envs.worker_pids[1] != second
        envs.step(np.zeros(2, dtype=np.int64))


def test_more_cores_than_sub_envs_and_clone_resets_are_never_grouped(monkeypatch):
    monkeypatch.setattr(config_module, "available_cores", lambda: 4)
    with contextlib.closing(ForkVectorEnv([busy_env] * 2)) as envs:
        assert len(envs.worker_pids) == 2
    monkeypatch.setattr(config_module, "available_cores", lambda: 2)
    with contextlib.closing(ForkVectorEnv([busy_env] * 2, reset_mode="clone")) as envs:
        assert len(envs.worker_pids) == 2


def test_a_failed_split_keeps_the_step_and_the_grouped_worker(two_cores, monkeypatch):
    from gym_fork.errors import SandboxStartError
    from gym_fork.vector.lifecycle import Sandboxes

    monkeypatch.setenv("GYM_FORK_SPLIT_STEP_US", "0")
    with (
        contextlib.closing(ForkVectorEnv([busy_env] * 2)) as envs,
        contextlib.closing(gym.vector.SyncVectorEnv([busy_env] * 2)) as sync,
    ):
        (source,) = envs.worker_pids

        def clones_never_start(self, workers, timeout=None):
            raise SandboxStartError("the clones did not start")

        monkeypatch.setattr(Sandboxes, "receive_hellos", clones_never_start)
        got, workers = run(envs, adaptive.FIRST_TIMED_STEP + adaptive.SAMPLES + 3)
        want, _ = run(sync, adaptive.FIRST_TIMED_STEP + adaptive.SAMPLES + 3)
        assert set(workers) == {1} and envs.worker_pids == [source]  # kept, not killed
        for a, b in zip(got[1:], want[1:], strict=True):  # no step lost, none wrong
            for x, y in zip(a[:4], b[:4], strict=True):
                np.testing.assert_array_equal(x, y)

"""The in-process host: the same worker loop in a controller thread (debugging, unit
tests), no isolation, and it says so."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from tests.helpers import SpaceEnv, descendants


class WhereAmI(SpaceEnv):
    def __init__(self):
        super().__init__(gym.spaces.Box(-1, 1, (2,)), gym.spaces.Discrete(2))

    def where(self):
        return os.getpid(), threading.current_thread().name


def test_sub_envs_run_in_the_controllers_own_process_and_no_process_is_made():
    before = descendants()
    envs = ForkVectorEnv([WhereAmI, WhereAmI], host="inline", envs_per_worker=1)
    try:
        assert descendants() == before
        envs.reset(seed=0)
        places = envs.call("where")
        assert {pid for pid, _ in places} == {os.getpid()}
        assert all(name.startswith("gym_fork-inline") for _, name in places)
        report = envs.isolation
        assert report["host"] == "inline" and "process" in report["missing"]
        with pytest.raises(NotImplementedError, match="inline"):
            envs.fork("nope")
    finally:
        envs.close()


@pytest.mark.slow  # 3.0 s here
def test_inline_from_parent_rebuilds_the_prepared_env_for_each_sandbox():
    calls = []

    def warm(env):
        calls.append(1)

    envs = ForkVectorEnv.from_parent(lambda: gym.make("CartPole-v1"), 3, warmup=warm, host="inline")
    try:
        envs.reset(seed=1)
        assert envs.step(np.array([0, 1, 0]))[0].shape == (3, 4)
        assert len(calls) >= 3  # a cold start per sandbox, visibly in this process
    finally:
        envs.close()


@pytest.mark.slow
def test_the_conformance_suite_passes_on_the_inline_host():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "tests/vector/test_conformance.py",
            "tests/vector/test_async_defects.py",
        ],
        env={**os.environ, "GYM_FORK_HOST": "inline"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout

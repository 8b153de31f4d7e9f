"""The zygote: warm parents are forks of one pre-imported interpreter per controller."""

from __future__ import annotations

import contextlib
import os
import signal

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import GymForkError
from gym_fork.hosts.process import zygote
from tests.helpers import _descendants, alive, marked_processes, wait_until

pytestmark = pytest.mark.process_only


@pytest.fixture(autouse=True)
def zygotes_on(monkeypatch):
    """These tests are about the zygote, whatever the caller's GYM_FORK_ZYGOTE."""
    monkeypatch.setenv("GYM_FORK_ZYGOTE", "1")


class EnvironmentEnv(gym.Env):
    """Reports an environment variable as seen inside its sandbox."""

    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return 0, {}

    def step(self, action):
        return 0, 0.0, False, False, {}

    def variable(self, name):
        return os.environ.get(name)


def cartpole():
    return gym.make("CartPole-v1")


def zygote_of(envs: ForkVectorEnv) -> int | None:
    """The pid of the zygote whose fork holds ``envs``' sandboxes, None if none."""
    for pid, _ in zygote.running():
        if set(envs.worker_pids) <= _descendants(pid):
            return pid
    return None


def test_warm_parents_of_later_vector_envs_are_forks_of_one_zygote():
    with (
        contextlib.closing(ForkVectorEnv([cartpole] * 2)) as first,
        contextlib.closing(ForkVectorEnv([cartpole] * 2)) as second,
    ):
        first.reset(seed=0)
        second.reset(seed=0)
        assert zygote_of(first) is not None
        assert zygote_of(first) == zygote_of(second)


def test_a_sandbox_sees_the_controller_environment_of_its_construction(monkeypatch):
    with contextlib.closing(ForkVectorEnv([cartpole])):
        pass  # the zygote exists now, with the environment of then
    monkeypatch.setenv("ZYGOTE_TEST_VALUE", "set after the zygote started")
    # Passed by name (the allowlist leaves it out: gym_fork/system/environment.py).
    with contextlib.closing(ForkVectorEnv([EnvironmentEnv], pass_env=["ZYGOTE_*"])) as envs:
        assert zygote_of(envs) is not None
        assert envs.call("variable", "ZYGOTE_TEST_VALUE") == ("set after the zygote started",)
    with contextlib.closing(ForkVectorEnv([EnvironmentEnv])) as envs:
        assert envs.call("variable", "ZYGOTE_TEST_VALUE") == (None,)


@pytest.mark.slow  # 1.1 s here
def test_a_changed_startup_variable_gets_a_new_zygote_and_the_old_one_retires(monkeypatch):
    old_envs = ForkVectorEnv([cartpole])
    try:
        old_envs.reset(seed=0)
        old = zygote_of(old_envs)
        assert old is not None
        monkeypatch.setenv("PYTHONZYGOTETEST", "changed")
        with contextlib.closing(ForkVectorEnv([cartpole])) as envs:
            new = zygote_of(envs)
        assert new is not None and new != old
        assert {pid for pid, _ in zygote.running()} == {new}  # the old one retired
        # Retired, it still holds the warm parent of a live vector env:
        assert alive({old})
        old_envs.step(np.array([0]))
    finally:
        old_envs.close()
    assert wait_until(lambda: not alive({old}), 3.0), "a retired zygote outlived its last env"


@pytest.mark.slow  # 2.1 s here
def test_a_killed_zygote_takes_its_trees_down_and_the_next_env_gets_a_new_one():
    envs = ForkVectorEnv([cartpole])
    try:
        envs.reset(seed=0)
        victim = zygote_of(envs)
        workers = set(envs.worker_pids)
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: not alive(workers), 3.0)
        with pytest.raises(GymForkError):
            envs.step(np.array([0]))
    finally:
        envs.close()
    with contextlib.closing(ForkVectorEnv([cartpole])) as fresh:
        fresh.reset(seed=0)
        assert zygote_of(fresh) not in (None, victim)
    assert not marked_processes() & workers


def test_zygote_off_starts_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("GYM_FORK_ZYGOTE", "0")
    before = zygote.running()
    with contextlib.closing(ForkVectorEnv([cartpole])) as envs:
        envs.reset(seed=0)
        assert zygote_of(envs) is None
    assert zygote.running() == before


def test_prestart_makes_the_zygote_the_first_vector_env_uses(monkeypatch):
    import gym_fork

    monkeypatch.setenv("PYTHONZYGOTETEST", "prestart")  # a key no zygote has yet
    before = {pid for pid, _ in zygote.running()}
    gym_fork.prestart(wait=True)
    started = {pid for pid, _ in zygote.running()} - before
    assert len(started) == 1
    with contextlib.closing(ForkVectorEnv([cartpole])) as envs:
        assert zygote_of(envs) in started


@pytest.mark.slow  # 1.4 s here
def test_one_zygote_serves_vector_envs_made_one_after_the_other():
    # gym_fork sets variables of its own at run time (GYM_FORK_SCRATCH_BASE at the first
    # close): none of them may make the next vector env start a zygote of its own.
    used = set()
    for _ in range(3):
        with contextlib.closing(ForkVectorEnv([cartpole])) as envs:
            envs.reset(seed=0)
            used.add(zygote_of(envs))
    assert len(used) == 1 and None not in used


@pytest.mark.slow  # 1.3 s here
def test_a_failed_fork_falls_back_and_spares_the_zygotes_other_warm_parents(monkeypatch):
    with contextlib.closing(ForkVectorEnv([cartpole])) as first:
        first.reset(seed=0)
        before = zygote_of(first)

        def no_fds():
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(zygote, "_output_fds", no_fds)
        with contextlib.closing(ForkVectorEnv([cartpole])) as second:  # a fresh interpreter
            second.reset(seed=0)
            assert zygote_of(second) is None
        monkeypatch.undo()
        monkeypatch.setenv("GYM_FORK_ZYGOTE", "1")
        first.step(np.array([0]))  # its warm parent lives: the zygote was retired, not closed
        assert alive({before})
    assert wait_until(lambda: not alive({before}), 3.0)


# -- the zygote key (pure: which variables get a new zygote) ---------------------------

KEY_BASE = {"PATH": "/usr/bin", "HOME": "/root"}
START_UP_INPUTS = [
    "PYTHONHASHSEED",
    "LD_PRELOAD",
    "MALLOC_ARENA_MAX",
    "LC_ALL",
    "LANG",
    "OMP_NUM_THREADS",
    "GYM_FORK_SPIN",
]


@pytest.mark.parametrize("name", START_UP_INPUTS)
def test_a_start_up_input_changes_the_zygote_key(name):
    assert zygote.zygote_key({**KEY_BASE, name: "1"}) != zygote.zygote_key(KEY_BASE)


@pytest.mark.parametrize("name", ["PATH", "GYM_FORK_SCRATCH_BASE", "MY_SETTING", "NUM_THREADS"])
def test_other_variables_leave_the_zygote_key_alone(name):
    assert zygote.zygote_key({**KEY_BASE, name: "changed"}) == zygote.zygote_key(KEY_BASE)


def test_the_zygote_key_ignores_the_order_of_the_environment():
    env = {"LANG": "C", "PYTHONPATH": "/a", "LC_ALL": "C"}
    assert zygote.zygote_key(env) == zygote.zygote_key(dict(reversed(list(env.items()))))

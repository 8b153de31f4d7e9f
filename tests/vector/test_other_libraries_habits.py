"""What users of EnvPool, Stable-Baselines3, PufferLib and Gymnasium's make_vec write
first (issue 31): it works, or the error names gym_fork's equivalent."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.vector.foreign_arguments import EQUIVALENTS


def cartpole():
    return gym.make("CartPole-v1")


@pytest.mark.parametrize("name", sorted(EQUIVALENTS))
def test_another_librarys_argument_names_gym_forks_equivalent(name):
    origin, instead = EQUIVALENTS[name]
    with pytest.raises(TypeError) as raised:
        ForkVectorEnv([cartpole], **{name: 2})
    text = str(raised.value)
    assert repr(name) in text and origin in text and instead in text
    if name not in inspect.signature(ForkVectorEnv.from_parent).parameters:  # seed is
        with pytest.raises(TypeError, match=repr(name)):
            ForkVectorEnv.from_parent(cartpole, 1, **{name: 2})


def test_the_migration_page_lists_every_refused_argument():
    page = (Path(__file__).resolve().parents[2] / "docs/guides/migrating.md").read_text()
    for name in EQUIVALENTS:
        assert f"`{name}=" in page, name


def test_a_misspelt_argument_still_gets_pythons_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'envs_per_workr'"):
        ForkVectorEnv([cartpole], envs_per_workr=2)


def test_an_env_id_instead_of_env_fns_points_to_make_vec():
    with pytest.raises(TypeError, match=r"gym_fork.make_vec\('CartPole-v1', num_envs=n\)"):
        ForkVectorEnv("CartPole-v1")
    with pytest.raises(TypeError, match="make_vec"):
        ForkVectorEnv(env_fns="CartPole-v1")


def test_envpools_send_with_env_id_and_its_info_env_id():
    envs = ForkVectorEnv([cartpole] * 3, batch_size=2)
    try:
        envs.async_reset(seed=0)
        seen = set()
        # Until each sub-env came at least once (first-k-done order: on a loaded machine
        # one sandbox can stay behind for many rounds), bounded by time.
        deadline = time.monotonic() + 30
        while seen != {0, 1, 2} and time.monotonic() < deadline:
            obs, *_, info = envs.recv()
            ids = info["env_id"]
            assert len(ids) == len(obs) == 2 and set(ids) <= {0, 1, 2}
            seen |= set(ids.tolist())
            envs.send(np.zeros(len(ids), np.int64), env_id=ids)  # EnvPool's spelling
        assert seen == {0, 1, 2}
        with pytest.raises(TypeError, match="env_ids or EnvPool's env_id, not both"):
            envs.send(np.zeros(1, np.int64), [0], env_id=[0])
    finally:
        envs.close()


def test_an_out_of_range_action_names_check_actions():
    """CartPole asserts its action is in its space: the AssertionError from the sandbox
    says how to have actions checked (and named) before they are sent."""
    envs = ForkVectorEnv([cartpole] * 2)
    try:
        envs.reset(seed=0)
        with pytest.raises(AssertionError) as raised:
            envs.step(np.array([0, 7]))
        assert any("check_actions=True" in note for note in raised.value.__notes__)
        envs.reset(seed=1)  # and the vector env goes on
        envs.step(np.array([0, 1]))
    finally:
        envs.close()
    checked = ForkVectorEnv([cartpole] * 2, check_actions=True)
    try:
        checked.reset(seed=0)
        with pytest.raises(Exception, match="7") as raised:
            checked.step(np.array([0, 7]))
        assert not isinstance(raised.value, AssertionError)
    finally:
        checked.close()

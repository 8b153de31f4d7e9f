"""Envs for the adapter tests; light to import (sandboxes unpickle env_fns from here)."""

from __future__ import annotations

import gymnasium as gym
from gymnasium import spaces

from tests.helpers import SpaceEnv

DICT_SPACE = spaces.Dict(
    {"pos": spaces.Box(-1.0, 1.0, (3,), dtype="float32"), "k": spaces.Discrete(5)}
)


class CountingEnv(SpaceEnv):
    """SpaceEnv with a side-effecting method, to see which sub-envs a call reached."""

    def __init__(self, **kwargs):
        super().__init__(spaces.Box(-1.0, 1.0, (2,), dtype="float32"), **kwargs)
        self.bumps = 0

    def bump(self, k=1):
        self.bumps += k
        return self.bumps


def dict_env() -> gym.Env:
    """Dict observations, random episode lengths and truncations, sparse infos."""
    return SpaceEnv(DICT_SPACE, spaces.Discrete(3), max_len=6, trunc_prob=0.15)


def counting_env() -> gym.Env:
    """A CountingEnv that renders rgb_array frames."""
    return CountingEnv(render_mode="rgb_array")


def short_cartpole() -> gym.Env:
    """CartPole cut at 12 steps: both terminations and truncations happen."""
    from stable_baselines3.common.monitor import Monitor

    return Monitor(gym.make("CartPole-v1", max_episode_steps=12))

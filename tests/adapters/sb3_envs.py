"""Envs for the SB3 convention tests; light to import (sandboxes and SubprocVecEnv's
workers unpickle env_fns from here): gymnasium and numpy only."""

from __future__ import annotations

import copy

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ARRAY_SPACES = {
    "Box": spaces.Box(-1.0, 1.0, (2,), dtype=np.float32),
    "Discrete": spaces.Discrete(5),
    "MultiDiscrete": spaces.MultiDiscrete([2, 3]),
    "MultiBinary": spaces.MultiBinary(3),
}
SB3_SPACES = {
    **ARRAY_SPACES,
    "Dict": spaces.Dict({name.lower(): space for name, space in ARRAY_SPACES.items()}),
    "Tuple": spaces.Tuple(tuple(ARRAY_SPACES.values())),
}
EPISODE = 4


class EchoEnv(gym.Env):
    """Observes the action it was given (observation space = action space): a step
    shows exactly what reached the sub-env. Episodes last EPISODE steps; the reset
    observation is a sample seeded by the reset's seed."""

    def __init__(self, space_name: str = "Box") -> None:
        # Own copies: a space carries an RNG, and DummyVecEnv's sub-envs share a process.
        self.observation_space = copy.deepcopy(SB3_SPACES[space_name])
        self.action_space = copy.deepcopy(SB3_SPACES[space_name])
        self.t = 0
        self.ident = None
        self.mark = None
        self.bumps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        self.t += 1
        return action, float(self.t), self.t >= EPISODE, False, {"t": self.t}

    def whoami(self):
        """The identity set with set_attr("ident", ...)."""
        return self.ident

    def bump(self):
        """Count the calls that reached this sub-env."""
        self.bumps += 1
        return self.bumps


def echo_env(space_name: str = "Box") -> gym.Env:
    """An EchoEnv (a named function: SubprocVecEnv and gym_fork pickle env_fns)."""
    return EchoEnv(space_name)


class UnusedWrapper(gym.Wrapper):
    """A wrapper no sub-env is wrapped in (env_is_wrapped answers False for it); here,
    not in a test module, so that a sandbox unpickling it imports nothing heavy."""

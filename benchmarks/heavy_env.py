"""A synthetic heavy env: seconds of initialisation and hundreds of MB of touched state."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class HeavyEnv(gym.Env):
    """Takes ``init_seconds`` to build and holds ``state_mb`` of touched memory.

    Each step writes one element of the state (so a clone copies one page), like a
    simulator that mutates a little of a large world per step. ``hugepages`` toggles
    numpy's MADV_HUGEPAGE on the big array (numpy's default on Linux is on).
    """

    def __init__(self, init_seconds: float = 1.5, state_mb: int = 200, hugepages: bool = True):
        start = time.perf_counter()
        from numpy._core import multiarray

        previous = multiarray._get_madvise_hugepage()
        multiarray._set_madvise_hugepage(hugepages)
        try:
            self.state = np.ones(state_mb * 2**20 // 8)  # touched: every page is resident
        finally:
            multiarray._set_madvise_hugepage(previous)
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = spaces.Discrete(2)
        self.t = 0
        left = init_seconds - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)  # stands for simulator init, asset loading, JIT warm-up

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4), {}

    def step(self, action):
        self.t += 1
        i = (self.t * 4099) % self.state.size
        self.state[i] += action
        obs = np.array([self.t, action, self.state[i], 0.0])
        return obs, 1.0, False, self.t >= 10_000, {}

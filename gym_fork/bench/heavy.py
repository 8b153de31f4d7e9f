"""A synthetic heavy env for the clone benchmarks: slow to build, large in memory."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


@contextlib.contextmanager
def _hugepages(enabled: bool) -> Iterator[None]:
    """numpy's MADV_HUGEPAGE on new large arrays, on or off (a private numpy switch: left
    alone where this numpy has none)."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    getter = getattr(multiarray, "_get_madvise_hugepage", None)
    setter = getattr(multiarray, "_set_madvise_hugepage", None)
    if getter is None or setter is None:
        yield
        return
    previous = getter()
    setter(enabled)
    try:
        yield
    finally:
        setter(previous)


class HeavyEnv(gym.Env):
    """Takes ``init_seconds`` to build and holds ``state_mb`` MB of touched memory.

    Each step writes one element of the state, so a copy-on-write clone copies one page
    per step, like a simulator that changes a little of a large world at a time.
    ``hugepages`` lets numpy back the state with transparent huge pages (its default).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, init_seconds: float = 1.5, state_mb: int = 200, hugepages: bool = True):
        start = time.perf_counter()
        with _hugepages(hugepages):
            self.state = np.ones(state_mb * 2**20 // 8)  # ones, not zeros: every page resident
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float64)
        self.action_space = spaces.Discrete(2)
        self.t = 0
        left = init_seconds - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)  # stands for asset loading, simulator set-up, JIT warm-up

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        """Start over at t=0 (the state array is kept)."""
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4), {}

    def step(self, action):
        """Write one element of the state; never terminates, truncates at 10,000 steps."""
        self.t += 1
        i = (self.t * 4099) % self.state.size
        self.state[i] += action
        obs = np.array([self.t, action, self.state[i], 0.0])
        return obs, 1.0, False, self.t >= 10_000, {}

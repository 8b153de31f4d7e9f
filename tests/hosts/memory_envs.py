"""Envs for tests/hosts/test_branch_memory.py (importable by reference: env_fns are
pickled): a plain deterministic env that can fill its /tmp, and envs that keep their
state in memory a fork does not copy (anonymous shared memory, multiprocessing's
RawArray), as a careless env would."""

from __future__ import annotations

import mmap
import multiprocessing
import os

import gymnasium as gym
import numpy as np


class CounterEnv(gym.Env):
    """A counter and draws of its seeded RNG: the same seed and actions give the same
    observations, in any process."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def __init__(self) -> None:
        self.t = 0
        self.ballast: np.ndarray | None = None
        self.forks_seen = 0
        os.register_at_fork(after_in_parent=self._forked)

    def _forked(self) -> None:
        self.forks_seen += 1  # in the source, after each fork it made

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1 + int(action)
        return self._obs(), 1.0, False, False, {}

    def _obs(self) -> np.ndarray:
        return np.array([float(self.t), float(self.np_random.random())])

    def hold(self, nbytes: int) -> int:
        """Keep ``nbytes`` of touched private memory (resident: in this process's RSS)."""
        self.ballast = np.ones(nbytes, np.uint8)
        return int(self.ballast[-1])

    def drop(self) -> None:
        self.ballast = None  # a large numpy buffer is unmapped when freed

    def fill_tmp(self, nbytes: int) -> str:
        """Write ``nbytes`` into a /tmp file at once (tmpfs: pages no process's RSS
        counts; posix_fallocate allocates them all)."""
        fd = os.open("/tmp/branch-video.bin", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
        return "filled"


class _SharedCounterEnv(CounterEnv):
    """A counter kept in memory a fork does not copy (``self.shared``, 8 bytes)."""

    shared: memoryview

    def step(self, action):
        value = np.frombuffer(self.shared, np.int64, 1)
        value[0] += 1
        return np.array([float(value[0]), 0.0]), 1.0, False, False, {}

    def count(self) -> int:
        return int(np.frombuffer(self.shared, np.int64, 1)[0])


class AnonymousSharedEnv(_SharedCounterEnv):
    """State in ``mmap.mmap(-1, n)`` (MAP_SHARED | MAP_ANONYMOUS)."""

    def __init__(self) -> None:
        super().__init__()
        self.region = mmap.mmap(-1, mmap.PAGESIZE)
        self.shared = memoryview(self.region)[:8]


class RawArrayEnv(_SharedCounterEnv):
    """State in a ``multiprocessing.RawArray`` (a deleted file in /dev/shm, mapped)."""

    def __init__(self) -> None:
        super().__init__()
        self.array = multiprocessing.RawArray("q", 1)
        self.shared = memoryview(self.array).cast("B")


class MemfdEnv(CounterEnv):
    """A counter in a memfd it keeps open and never maps (``os.pread``/``os.pwrite``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fd = os.memfd_create("counter")
        os.pwrite(self.fd, bytes(8), 0)

    def count(self) -> int:
        return int.from_bytes(os.pread(self.fd, 8, 0), "little")

    def step(self, action):
        value = self.count() + 1
        os.pwrite(self.fd, value.to_bytes(8, "little"), 0)
        return np.array([float(value), 0.0]), 1.0, False, False, {}

"""Small envs for the microVM tests (imported by reference inside the guests)."""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class GuestProbeEnv(gym.Env):
    """Observes its own sandbox: urandom bytes, a counter, and files under /tmp."""

    observation_space = spaces.Box(0, 255, (8,), np.uint8)
    action_space = spaces.Discrete(3)

    def __init__(self) -> None:
        self.counter = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {"counter": self.counter}

    def step(self, action):
        self.counter += 1
        if action == 1:
            with open(f"/tmp/written-by-{os.getpid()}-{self.counter}", "w") as f:
                f.write("x")
        if action == 2:
            os._exit(7)
        files = sorted(n for n in os.listdir("/tmp") if n.startswith("written-by-"))
        info = {"counter": self.counter, "files": files, "random": os.urandom(8).hex()}
        return self._obs(), 0.0, False, False, info

    def _obs(self):
        return self.np_random.integers(0, 255, 8, dtype=np.uint8)

    def guest_time(self) -> float:
        import time

        return time.time()

    def sandbox_facts(self):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        return {
            "kernel": os.uname().release,
            "boot_id": boot_id,
            "interfaces": sorted(os.listdir("/sys/class/net")),
        }


def warm_up(env: GuestProbeEnv) -> None:
    """The parent's preparation: it shows in every clone."""
    env.counter = 100


class HangEnv(GuestProbeEnv):
    def step(self, action):
        if action == 1:
            while True:
                pass
        return super().step(0)


class InterpreterEnv(gym.Env):
    """An env whose state lives in a child process it talks to: a persistent Python
    interpreter (the shape of an agent's `python -i` tool). Each step sends ``x += a``
    (a = action) and reads ``x`` back; the observation is [x, the child's pid]."""

    observation_space = spaces.Box(-1e9, 1e9, (2,), dtype=np.float64)
    action_space = spaces.Discrete(5)
    PROGRAM = (
        "import sys\nx = 0\nfor line in sys.stdin:\n"
        "    x = x * 3 + int(line)\n    print(x, flush=True)\n"
    )

    def __init__(self):
        import subprocess
        import sys

        self.child = subprocess.Popen(
            [sys.executable, "-u", "-c", self.PROGRAM],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.x = 0

    def _tell(self, value: int) -> int:
        self.child.stdin.write(f"{value}\n")
        self.child.stdin.flush()
        return int(self.child.stdout.readline())

    def _obs(self):
        return np.array([self.x, self.child.pid], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs(), {}

    def step(self, action):
        self.x = self._tell(int(action))
        return self._obs(), 0.0, False, False, {"x": self.x}

    def close(self):
        self.child.kill()

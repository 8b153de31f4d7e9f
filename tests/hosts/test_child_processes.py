"""A sub-env whose env started a process of its own (a shell, an interpreter it talks to)
is refused a fork on the process host, naming the child and host='microvm'; the source
goes on, and nothing is left behind (issue 32)."""

from __future__ import annotations

import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv
from gym_fork.errors import GymForkError


class ShellEnv(gym.Env):
    """Talks to a persistent child interpreter: its state lives in that process too."""

    observation_space = spaces.Box(-1e9, 1e9, (1,), np.float64)
    action_space = spaces.Discrete(3)

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None

    def _ask(self, line: str) -> float:
        assert self.child and self.child.stdin and self.child.stdout
        self.child.stdin.write(line + "\n")
        self.child.stdin.flush()
        return float(self.child.stdout.readline())

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.child is None:
            code = (
                "import sys\nt = 0\nfor line in sys.stdin:\n t += int(line)\n print(t, flush=True)"
            )
            self.child = subprocess.Popen(
                [sys.executable, "-u", "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        return np.array([self._ask("0")]), {}

    def step(self, action):
        return np.array([self._ask(str(int(action)))]), 0.0, False, False, {}

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.wait()


def test_a_fork_of_an_env_with_a_child_process_is_refused_by_name_and_the_source_goes_on():
    envs = ForkVectorEnv([ShellEnv], timeout=30)
    try:
        envs.reset(seed=0)
        envs.step(np.array([2]))
        with pytest.raises(GymForkError) as caught:
            envs.fork("with-the-shell")
        message = str(caught.value)
        assert "child process" in message and "python" in message
        assert "host='microvm'" in message
        obs, *_ = envs.step(np.array([1]))
        assert obs[0, 0] == 3.0  # the source and its child kept their state
        plain = ForkVectorEnv([lambda: gym.make("CartPole-v1")])
        try:
            plain.reset(seed=0)
            plain.fork("no-children").close()  # an env without children forks as before
        finally:
            plain.close()
    finally:
        envs.close()

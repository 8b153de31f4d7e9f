"""Step throughput of ForkVectorEnv against AsyncVectorEnv and SyncVectorEnv (one run).

    .venv/bin/python -m pytest benchmarks/test_step_throughput.py --benchmark-only

Each round is 200 batched steps of CartPole-v1 x 8; compare the rows of one run only
(this machine is shared and noisy). benchmarks/report.py prints the same as ratios.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv

NUM_ENVS = 8
STEPS = 200


def env_fns():
    return [lambda: gym.make("CartPole-v1") for _ in range(NUM_ENVS)]


MAKERS = {
    "sync": lambda: gym.vector.SyncVectorEnv(env_fns()),
    "async": lambda: gym.vector.AsyncVectorEnv(env_fns()),
    "fork-auto": lambda: ForkVectorEnv(env_fns()),
    "fork-1-per-worker": lambda: ForkVectorEnv(env_fns(), envs_per_worker=1),
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_cartpole_x8_step_throughput(benchmark, kind):
    envs = MAKERS[kind]()
    try:
        envs.reset(seed=0)
        actions = np.random.default_rng(0).integers(0, 2, (STEPS, NUM_ENVS))

        def run():
            for a in actions:
                envs.step(a)

        benchmark.group = "CartPole-v1 x8, 200 steps"
        benchmark.extra_info["steps_per_round"] = STEPS * NUM_ENVS
        benchmark.pedantic(run, rounds=15, warmup_rounds=2)
    finally:
        envs.close()

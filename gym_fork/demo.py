"""The main demo: the one-line swap from AsyncVectorEnv to ForkVectorEnv, and its speed."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np


def _steps_per_second(envs, steps: int, seed: int = 0) -> float:
    envs.reset(seed=seed)
    rng = np.random.default_rng(seed)
    actions = [rng.integers(0, 2, envs.num_envs) for _ in range(64)]
    for i in range(50):
        envs.step(actions[i % 64])
    start = time.perf_counter()
    for i in range(steps):
        envs.step(actions[i % 64])
    return steps * envs.num_envs / (time.perf_counter() - start)


def run(num_envs: int = 8, steps: int = 3000) -> dict[str, float]:
    """Build each vector env over CartPole-v1, check Fork == Sync, print steps/s."""
    from gym_fork import ForkVectorEnv

    def env_fns():
        return [lambda: gym.make("CartPole-v1") for _ in range(num_envs)]

    print(f"gym_fork demo: CartPole-v1 x {num_envs}, {steps} steps each\n")
    print("  envs = gym.vector.AsyncVectorEnv(env_fns)   # before")
    print("  envs = gym_fork.ForkVectorEnv(env_fns)      # after: the only change\n")

    fork, sync = ForkVectorEnv(env_fns()), gym.vector.SyncVectorEnv(env_fns())
    try:
        a, b = fork.reset(seed=7), sync.reset(seed=7)
        same = np.array_equal(a[0], b[0])
        rng = np.random.default_rng(1)
        for _ in range(500):
            act = rng.integers(0, 2, num_envs)
            ra, rb = fork.step(act), sync.step(act)
            same = same and all(np.array_equal(x, y) for x, y in zip(ra[:4], rb[:4], strict=True))
        print(f"ForkVectorEnv == SyncVectorEnv over 500 seeded steps: {same}")
    finally:
        fork.close()
        sync.close()

    results = {}
    makers = {
        "AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv(env_fns()),
        "SyncVectorEnv": lambda: gym.vector.SyncVectorEnv(env_fns()),
        "ForkVectorEnv": lambda: ForkVectorEnv(env_fns()),
        "ForkVectorEnv(envs_per_worker=4)": lambda: ForkVectorEnv(env_fns(), envs_per_worker=4),
    }
    for name, make in makers.items():
        envs = make()
        try:
            results[name] = _steps_per_second(envs, steps)
        finally:
            envs.close()
    base = results["AsyncVectorEnv"]
    print(f"\n{'vector env':<36}{'steps/s':>12}{'vs Async':>10}")
    for name, value in results.items():
        print(f"{name:<36}{value:>12,.0f}{value / base:>9.1f}x")
    return results


if __name__ == "__main__":
    run()

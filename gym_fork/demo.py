"""The main demo: the one-line swap from AsyncVectorEnv to ForkVectorEnv, and its speed."""

from __future__ import annotations

import os
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


class _Work(gym.Wrapper):
    """CartPole with ``seconds`` of CPU work per step: a simulator's step, not a 5 us one."""

    def __init__(self, env: gym.Env, seconds: float) -> None:
        super().__init__(env)
        self.seconds = seconds

    def step(self, action):
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


def _heavier(num_envs: int, seconds: float, steps: int) -> tuple[float, float]:
    """(SyncVectorEnv, ForkVectorEnv) steps/s over CartPole with ``seconds`` of work."""
    from gym_fork import ForkVectorEnv

    def env_fns():
        return [lambda: _Work(gym.make("CartPole-v1"), seconds) for _ in range(num_envs)]

    rates = []
    for make in (lambda: gym.vector.SyncVectorEnv(env_fns()), lambda: ForkVectorEnv(env_fns())):
        envs = make()
        try:
            rates.append(_steps_per_second(envs, steps))
        finally:
            envs.close()
    return rates[0], rates[1]


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
    sync_heavy, fork_heavy = _heavier(num_envs, 0.001, max(50, steps // 15))
    results["SyncVectorEnv, 1 ms step"] = sync_heavy
    results["ForkVectorEnv, 1 ms step"] = fork_heavy
    sync_light = results["SyncVectorEnv"]
    fork_light = max(results["ForkVectorEnv"], results["ForkVectorEnv(envs_per_worker=4)"])
    if sync_light > fork_light:
        print(
            f"\nCartPole's step is ~5 us: handing it to another process costs more than "
            f"the step,\nso SyncVectorEnv, in this process, does {sync_light / fork_light:.1f}x "
            "ForkVectorEnv's steps here."
        )
    else:
        print(
            f"\nEven at CartPole's ~5 us step, ForkVectorEnv does {fork_light / sync_light:.1f}x "
            "SyncVectorEnv's steps here."
        )
    print(
        f"With 1 ms of work per step (a simulator's), the sub-envs run in parallel:\n"
        f"  SyncVectorEnv {sync_heavy:,.0f} steps/s, ForkVectorEnv {fork_heavy:,.0f} "
        f"steps/s ({fork_heavy / sync_heavy:.1f}x Sync, {os.cpu_count()} cores)"
    )
    return results


if __name__ == "__main__":
    run()

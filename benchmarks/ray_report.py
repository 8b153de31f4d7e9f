"""Steps/s of RayForkVectorEnv against a local ForkVectorEnv, and the per-step cost of
going through Ray as the number of shard actors grows.

Run:  .venv/bin/python benchmarks/ray_report.py [--steps 2000] [--address HOST:PORT]

Without ``--address`` it starts a 3-node loopback cluster on this machine (1 CPU each);
every node then shares this machine's cores, so the figures are Ray's overhead, not a
multi-machine speed-up. Two envs, 8 sub-envs each: CartPole-v1 (a few microseconds a
step) and ``SpinEnv`` (a 100 us busy step). Per-step overhead is
(time per batched step through Ray - time per batched step of the local vector env).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray: loopback

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium import spaces
from ray import cloudpickle as ray_cloudpickle

from gym_fork import ForkVectorEnv
from gym_fork.ray import RayForkVectorEnv, ShardLost, loopback_cluster


class SpinEnv(gym.Env):
    """Each step busy-waits ``step_us`` microseconds (a stand-in for a ~100 us simulator)."""

    def __init__(self, step_us: float = 100.0) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (8,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.step_s = step_us / 1e6
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observation_space.sample(), {}

    def step(self, action):
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            pass
        self.t += 1
        return np.full(8, 0.001 * self.t, np.float32), 1.0, False, self.t >= 500, {}


def cartpole():
    return gym.make("CartPole-v1")


def spin():
    return SpinEnv(100.0)


def measure(envs, steps: int) -> float:
    """Seconds per batched step (after a warm-up)."""
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    for _ in range(min(100, steps // 10)):
        envs.step(actions)
    started = time.perf_counter()
    for _ in range(steps):
        envs.step(actions)
    return (time.perf_counter() - started) / steps


def report(steps: int, shards: list[int], num_envs: int) -> list[dict]:
    rows = []
    for name, fn in (("CartPole-v1", cartpole), ("SpinEnv 100us", spin)):
        local = ForkVectorEnv([fn] * num_envs, lineage_log=False)
        try:
            t_local = measure(local, steps)
        finally:
            local.close()
        rows.append({"env": name, "backend": "ForkVectorEnv (local)", "actors": 0, "t": t_local})
        for k in shards:
            envs = RayForkVectorEnv([fn] * num_envs, num_shards=k, lineage_log=False)
            try:
                t_ray = measure(envs, steps)
            finally:
                envs.close()
            rows.append(
                {
                    "env": name,
                    "backend": "RayForkVectorEnv",
                    "actors": k,
                    "t": t_ray,
                    "base": t_local,
                }
            )
    return rows


def latencies(repeats: int = 5) -> list[tuple[str, float]]:
    """Median seconds of the control-path operations (CartPole x6 over the nodes)."""
    import ray

    def median(fn) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return float(np.median(times))

    out = []
    times = []
    for r in range(repeats):
        started = time.perf_counter()
        envs = RayForkVectorEnv([cartpole] * 6, lineage_log=False)
        times.append(time.perf_counter() - started)
        if r < repeats - 1:
            envs.close()
    out.append(("build RayForkVectorEnv(CartPole x6), actors included", float(np.median(times))))
    envs.reset(seed=0)
    last = envs.num_envs - 1
    counter = iter(range(10**6))

    def fork(**kw) -> None:
        envs.fork(f"b{next(counter)}", indices=[last], copies=3, **kw).close()

    out.append(("fork(indices=[i], copies=3), exact, on i's node, + close", median(fork)))
    out.append(
        (
            "fork(..., copies=3, spread=True), 1 exact + 2 fresh, + close",
            median(lambda: fork(spread=True)),
        )
    )

    def lose_and_rebuild() -> tuple[float, float]:
        ray.kill(envs.actors[0], no_restart=True)
        started = time.perf_counter()
        try:
            while True:
                envs.step(np.zeros(envs.num_envs, dtype=np.int64))
        except ShardLost:
            detected = time.perf_counter() - started
        started = time.perf_counter()
        envs.reset(seed=0)
        return detected, time.perf_counter() - started

    detected, rebuilt = zip(*[lose_and_rebuild() for _ in range(3)], strict=True)
    out.append(
        ("ray.kill of a shard actor -> ShardLost raised by step()", float(np.median(detected)))
    )
    out.append(
        ("reset() rebuilding that shard (new actor + ForkVectorEnv)", float(np.median(rebuilt)))
    )
    envs.close()
    return out


def table(rows: list[dict], num_envs: int) -> str:
    lines = [
        f"| env (x{num_envs}) | backend | actors | steps/s (batched) | sub-env steps/s "
        "| ratio to local | overhead per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "1" if "base" not in r else f"{r['base'] / r['t']:.3f}"
        over = "-" if "base" not in r else f"{(r['t'] - r['base']) * 1e6:,.0f} us"
        lines.append(
            f"| {r['env']} | {r['backend']} | {r['actors'] or '-'} | {1 / r['t']:,.0f} "
            f"| {num_envs / r['t']:,.0f} | {ratio} | {over} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--shards", default="1,2,3")
    parser.add_argument("--address", help="an existing Ray cluster (default: 3 loopback nodes)")
    args = parser.parse_args()
    shards = [int(s) for s in args.shards.split(",")]
    # The actors do not import benchmarks/: ship SpinEnv by value.
    if __name__ != "__main__":
        module = __import__(__name__)
        for pickler in (cloudpickle, ray_cloudpickle):
            pickler.register_pickle_by_value(module)
    if args.address:
        import ray

        ray.init(address=args.address)
        rows = report(args.steps, shards, args.num_envs)
        control = latencies()
    else:
        with loopback_cluster(num_nodes=max(shards), num_cpus=1):
            rows = report(args.steps, shards, args.num_envs)
            control = latencies()
    print(f"{os.cpu_count()} cores, {args.steps} batched steps per row")
    print(table(rows, args.num_envs))
    print()
    print("| control path (median) | time |")
    print("|---|---|")
    for what, seconds in control:
        print(f"| {what} | {seconds * 1e3:,.1f} ms |")


if __name__ == "__main__":
    main()

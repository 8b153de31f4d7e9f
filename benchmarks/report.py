"""Print the step-throughput and ring-latency table as ratios measured in one run.

.venv/bin/python benchmarks/report.py [--steps 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv
from gym_fork.transport.channel import Channel


def steps_per_second(make, steps: int, num_envs: int) -> float:
    envs = make()
    try:
        envs.reset(seed=0)
        actions = np.random.default_rng(0).integers(0, 2, (steps, num_envs))
        for a in actions[:100]:
            envs.step(a)
        start = time.perf_counter()
        for a in actions:
            envs.step(a)
        return steps * num_envs / (time.perf_counter() - start)
    finally:
        envs.close()


def ring_round_trip_us(count: int = 20000) -> float:
    controller = Channel.create("bench", 1 << 16)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 16, "bench")
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(count):
                worker.outbox.write(bytes(worker.inbox.read(5)))
        finally:
            os._exit(0)
    msg = b"x" * 32
    start = time.perf_counter()
    for _ in range(count):
        controller.outbox.write(msg)
        controller.inbox.read(5)
    elapsed = time.perf_counter() - start
    os.waitpid(pid, 0)
    worker.close()
    controller.close()
    return elapsed / count * 1e6


def _echo(conn, count):
    for _ in range(count):
        conn.send_bytes(conn.recv_bytes())


def pipe_round_trip_us(count: int = 20000) -> float:
    ours, theirs = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_echo, args=(theirs, count))
    proc.start()
    msg = b"x" * 32
    start = time.perf_counter()
    for _ in range(count):
        ours.send_bytes(msg)
        ours.recv_bytes()
    elapsed = time.perf_counter() - start
    proc.join()
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=8)
    args = parser.parse_args()
    n = args.num_envs

    def fns():
        return [lambda: gym.make("CartPole-v1") for _ in range(n)]

    makers = {
        "SyncVectorEnv": lambda: gym.vector.SyncVectorEnv(fns()),
        "AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv(fns()),
        "ForkVectorEnv (auto)": lambda: ForkVectorEnv(fns()),
        "ForkVectorEnv (envs_per_worker=1)": lambda: ForkVectorEnv(fns(), envs_per_worker=1),
    }
    results: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(args.repeats):  # interleaved, so drift hits every row alike
        for name, make in makers.items():
            results[name].append(steps_per_second(make, args.steps, n))
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"CartPole-v1 x{n}, {args.steps} steps, median of {args.repeats}, cores={os.cpu_count()}")
    print(f"{'vector env':<36}{'steps/s':>10}{'vs Async':>10}{'vs Sync':>9}")
    for name, value in med.items():
        print(
            f"{name:<36}{value:>10,.0f}{value / med['AsyncVectorEnv']:>9.2f}x"
            f"{value / med['SyncVectorEnv']:>8.2f}x"
        )
    ring = statistics.median(ring_round_trip_us() for _ in range(3))
    pipe = statistics.median(pipe_round_trip_us() for _ in range(3))
    print(f"\nsmall-record round trip: ring {ring:.2f} us, pipe {pipe:.2f} us ({pipe / ring:.1f}x)")


if __name__ == "__main__":
    main()

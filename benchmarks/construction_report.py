"""Construction + first reset of CartPole x8: ForkVectorEnv (the first in a process, then
later ones) against AsyncVectorEnv, interleaved in one process.

    .venv/bin/python benchmarks/construction_report.py [--runs 16]
    GYM_FORK_ZYGOTE=0 .venv/bin/python benchmarks/construction_report.py   # no zygote
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym

from gym_fork import ForkVectorEnv


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def timed(make) -> float:
    """Seconds for ``make()`` and its first reset (closed afterwards)."""
    started = time.perf_counter()
    envs = make()
    envs.reset(seed=0)
    elapsed = time.perf_counter() - started
    envs.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16)
    args = parser.parse_args()
    fns = [cartpole] * 8
    fork, async_ = [], []
    for _ in range(args.runs):
        fork.append(timed(lambda: ForkVectorEnv(fns)))
        async_.append(timed(lambda: gym.vector.AsyncVectorEnv(fns)))
    later = fork[1:] or fork
    print(
        f"ForkVectorEnv: first {fork[0] * 1e3:.1f} ms, later median "
        f"{statistics.median(later) * 1e3:.1f} ms; AsyncVectorEnv median "
        f"{statistics.median(async_[1:] or async_) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()

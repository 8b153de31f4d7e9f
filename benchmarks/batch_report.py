"""Batch mode (``batch_size=k``, send/recv) against synchronous steps, on uneven envs.

    .venv/bin/python benchmarks/batch_report.py [--envs 8] [--batch 4] [--seconds 3]
                                                [--rounds 3] [--json OUT]

An env whose step time is heavy-tailed (lognormal, median ``--median-us`` 300 us, sigma
1: one step in 20 costs over 5x the median) in two kinds:

  cpu     the step busy-works (holds a core), as a simulator does
  sleep   the step sleeps (holds no core), as an env waiting on I/O or a remote server does

Contenders, each in a fresh interpreter, interleaved over ``rounds``, medians [min-max]
of sub-env steps per second:

  Async         gymnasium.vector.AsyncVectorEnv, step()
  Fork step     ForkVectorEnv(envs_per_worker=1), step(): waits for the slowest sub-env
  Fork batch    ForkVectorEnv(batch_size=k): recv() the first k, send() them on at once
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

CONTENDERS = ("Async", "Fork step", "Fork batch")


class UnevenStepEnv(gym.Env):
    """A step of lognormal duration: busy-worked (``kind="cpu"``) or slept."""

    def __init__(self, kind: str = "cpu", median_us: float = 300.0, sigma: float = 1.0):
        self.observation_space = spaces.Box(-1.0, 1.0, (8,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.kind, self.mu, self.sigma = kind, np.log(median_us * 1e-6), sigma

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(8, np.float32), {}

    def step(self, action):
        seconds = min(0.05, float(self.np_random.lognormal(self.mu, self.sigma)))
        if self.kind == "sleep":
            time.sleep(seconds)
        else:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        obs = self.np_random.uniform(-1, 1, 8).astype(np.float32)
        return obs, 1.0, False, False, {}


def run_one(contender: str, kind: str, num_envs: int, batch: int, seconds: float) -> float:
    """Sub-env steps per second of one contender, in this interpreter."""
    fns = [lambda: UnevenStepEnv(kind) for _ in range(num_envs)]
    if contender == "Async":
        envs: Any = gym.vector.AsyncVectorEnv(fns)
    elif contender == "Fork step":
        from gym_fork import ForkVectorEnv

        envs = ForkVectorEnv(fns, envs_per_worker=1, lineage_log=False)
    else:
        from gym_fork import ForkVectorEnv

        envs = ForkVectorEnv(fns, batch_size=batch, lineage_log=False)
    try:
        if contender == "Fork batch":
            envs.async_reset(seed=0)
            zeros = np.zeros(batch, dtype=np.int64)
            for _ in range(20):  # warm-up
                envs.recv()
                envs.send(zeros)
            steps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                envs.recv()
                envs.send(zeros)
                steps += batch
            return steps / (time.perf_counter() - start)
        envs.reset(seed=0)
        zeros = np.zeros(num_envs, dtype=np.int64)
        for _ in range(20):
            envs.step(zeros)
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            envs.step(zeros)
            steps += num_envs
        return steps / (time.perf_counter() - start)
    finally:
        envs.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="cpu,sleep")
    parser.add_argument("--json", metavar="OUT")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # CONTENDER:KIND
    args = parser.parse_args()
    if args.one:
        contender, kind = args.one.split(":")
        print(json.dumps(run_one(contender, kind, args.envs, args.batch, args.seconds)))
        return
    kinds = args.kinds.split(",")
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            for contender in CONTENDERS:
                command = [
                    sys.executable, __file__, "--one", f"{contender}:{kind}",
                    "--envs", str(args.envs), "--batch", str(args.batch),
                    "--seconds", str(args.seconds),
                ]  # fmt: skip
                out = subprocess.run(command, capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    raise SystemExit(f"{contender} {kind} failed:\n{out.stderr[-2000:]}")
                rate = json.loads(out.stdout.strip().splitlines()[-1])
                rates.setdefault((kind, contender), []).append(rate)
                print(f"  {kind:5} {contender:10} {rate:10,.0f} steps/s", flush=True)
    print(
        f"\n{args.envs} sub-envs, batch_size {args.batch}, lognormal steps (median 300 us,"
        f" sigma 1), medians of {args.rounds} [min-max]"
    )
    print("| step kind | " + " | ".join(CONTENDERS) + " | batch / step |")
    print("|---|" + "---|" * (len(CONTENDERS) + 1))
    for kind in kinds:
        med = {c: statistics.median(rates[(kind, c)]) for c in CONTENDERS}
        cells = [
            f"{med[c]:,.0f} [{min(rates[(kind, c)]):,.0f}-{max(rates[(kind, c)]):,.0f}]"
            for c in CONTENDERS
        ]
        ratio = med["Fork batch"] / med["Fork step"]
        print(f"| {kind} | " + " | ".join(cells) + f" | **{ratio:.2f}x** |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{k}:{c}": v for (k, c), v in rates.items()}, f, indent=1)


if __name__ == "__main__":
    main()

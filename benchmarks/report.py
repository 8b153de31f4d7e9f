"""Print the step-throughput and ring-latency table as ratios measured in one run.

.venv/bin/python benchmarks/report.py [--steps 3000] [--repeats 3]

Before/after two versions of the code, back to back (docs/benchmarks.md, "where a small
step's time goes"): each tree is a directory holding a ``gym_fork`` package with its
built ``_ring*.so`` (for a commit: ``git archive C gym_fork | tar -x -C DIR`` and copy
the .so); each round runs every configuration under each tree in a fresh process, the
trees alternating, and the medians of the rounds are printed in us per vector step:

.venv/bin/python benchmarks/report.py --ab /tmp/before /tmp/after --repeats 6 \\
    --configs cartpole:8:sync,cartpole:8:auto,cartpole:8:8,slow100us:8:auto
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from gym_fork.bench.throughput import (
    cartpole_makers,
    compare,
    medians,
    pipe_round_trip_us,
    ring_round_trip_us,
)

DEFAULT_CONFIGS = (
    "cartpole:2:sync,cartpole:2:auto,cartpole:8:sync,cartpole:8:auto,cartpole:8:8,"
    "cartpole:64:sync,cartpole:64:auto,slow100us:8:sync,slow100us:8:auto"
)


def step_us(config: str, steps: int) -> float:
    """us per vector step of ``kind:num_envs:who`` (who: sync, auto or envs_per_worker),
    a fresh vector env, after 100 warm-up steps."""
    import gymnasium as gym
    import numpy as np
    from peers import ENVS

    kind, n, who = config.split(":")
    n = int(n)
    env_fn, actions_n, _ = ENVS[kind]
    if who == "sync":
        envs = gym.vector.SyncVectorEnv([env_fn] * n)
    else:
        from gym_fork import ForkVectorEnv

        envs = ForkVectorEnv([env_fn] * n, envs_per_worker="auto" if who == "auto" else int(who))
    steps = max(50, steps * 8 // max(n, 8)) if kind == "cartpole" else max(50, steps // 8)
    actions = np.random.default_rng(0).integers(0, actions_n, (steps + 100, n))
    try:
        envs.reset(seed=0)
        for a in actions[:100]:
            envs.step(a)
        started = time.perf_counter()
        for a in actions[100:]:
            envs.step(a)
        return (time.perf_counter() - started) / steps * 1e6
    finally:
        envs.close()


def ab(trees: list[str], configs: list[str], steps: int, repeats: int) -> None:
    """Every configuration under every tree, trees alternating per round; medians."""
    here = os.path.dirname(os.path.abspath(__file__))
    results = {t: {c: [] for c in configs} for t in trees}
    for round_ in range(repeats):
        for tree in trees if round_ % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            done = subprocess.run(
                [sys.executable, os.path.join(here, "report.py"), "--child", *configs,
                 "--steps", str(steps)],
                env=env, capture_output=True, text=True, cwd="/", check=True,
            )  # fmt: skip
            for config, value in json.loads(done.stdout.strip().splitlines()[-1]).items():
                results[tree][config].append(value)
            print(f"[{round_ + 1}/{repeats}] {tree}", file=sys.stderr, flush=True)
    load = os.getloadavg()
    print(f"us per vector step, median (min-max) of {repeats}, load {load[0]:.2f}")
    print(
        f"{'configuration':<22}" + "".join(f"{os.path.basename(t.rstrip('/')):>24}" for t in trees)
    )
    for config in configs:
        cells = []
        for tree in trees:
            values = results[tree][config]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})")
        print(f"{config:<22}" + "".join(f"{c:>24}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--ab", nargs="+", metavar="TREE", help="compare source trees")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="kind:num_envs:who,...")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({c: step_us(c, args.steps) for c in args.child}))
        return
    if args.ab:
        ab(args.ab, args.configs.split(","), args.steps, args.repeats)
        return
    n = args.num_envs

    makers = cartpole_makers(n)
    results = compare(makers, args.steps, n, args.repeats)  # interleaved
    med = medians(results)
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

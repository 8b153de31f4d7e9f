"""Gymnasium's own vector-step benchmark, ``gymnasium.utils.performance.benchmark_vector_step``,
run on SyncVectorEnv, AsyncVectorEnv and ForkVectorEnv: the figure a Gymnasium user gets
from the library's own tool, next to ours.

    .venv/bin/python benchmarks/gymnasium_step.py [--rounds 3] [--seconds 2] [--json OUT]

Rows: CartPole-v1 x8 and the ~100 us Python step env x8 (benchmarks/peers.py). Each
(row, contender) runs in a fresh interpreter, the contenders interleaved over ``rounds``;
medians with min-max of steps per second, and each contender's ratio to SyncVectorEnv's
median. benchmark_vector_step counts sub-env steps and leaves out the step after an
autoreset, as Gymnasium defines it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = {"CartPole x8": ("cartpole", 8), "100 us step x8": ("slow100us", 8)}
CONTENDERS = ("Sync", "Async", "ForkVectorEnv auto")

CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import peers
from gymnasium.utils.performance import benchmark_vector_step
envs = peers.make({contender!r}, {kind!r}, {n})
try:
    print(json.dumps(benchmark_vector_step(envs, target_duration={seconds}, seed=0)))
finally:
    envs.close()
"""


def one(contender: str, kind: str, n: int, seconds: float) -> float:
    """Steps per second of one fresh interpreter running Gymnasium's benchmark."""
    from gym_fork.bench.fresh import last_json

    code = CHILD.format(here=HERE, contender=contender, kind=kind, n=n, seconds=seconds)
    return float(last_json([sys.executable, "-c", code], 300, f"{contender} {kind} x{n}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="target_duration per run")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[float]]] = {row: {c: [] for c in CONTENDERS} for row in ROWS}
    for _ in range(args.rounds):
        for row, (kind, n) in ROWS.items():
            for contender in CONTENDERS:
                samples[row][contender].append(one(contender, kind, n, args.seconds))
    print(f"benchmark_vector_step, medians (min-max) of {args.rounds}, load {load_before}")
    for row, by in samples.items():
        sync = statistics.median(by["Sync"])
        cells = [
            f"{c} {statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f}) "
            f"{statistics.median(v) / sync:.2f}x"
            for c, v in by.items()
        ]
        print(f"  {row}: " + "; ".join(cells))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "rounds": args.rounds,
                    "seconds": args.seconds,
                    "samples": samples,
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()

"""Print the step-throughput and ring-latency table as ratios measured in one run.

.venv/bin/python benchmarks/report.py [--steps 3000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics

from gym_fork.bench.throughput import (
    cartpole_makers,
    compare,
    medians,
    pipe_round_trip_us,
    ring_round_trip_us,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-envs", type=int, default=8)
    args = parser.parse_args()
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

"""Clone time, fan-out and memory of gym_fork clones against cold starts (one run).

    .venv/bin/python benchmarks/clone_report.py [--quick | --setup]

For CartPole-v1 and a synthetic heavy env (benchmarks/heavy_env.py: 1.5 s of init,
200 MB of touched state; with and without transparent huge pages):
  cold      env_fn() + reset + first step, in this process
  clone     reset of a from_parent sub-env by a fresh clone (reset_mode="clone") + first step
            (back to back; "apart": 30 ms apart, as resets at episodes' ends are)
  fork      fork() of a running sub-env into a 1-env branch + first step
  fan-out   fork(copies=64) + one step of all 64
  --setup   only a new sandbox's isolation set-up: time, CPU and page faults
  memory    PSS added by the 64 clones (after their first step: the PSS of the warm parent,
            source and clones minus that before the fan-out) against 64 x the PSS of one
            independent process holding the same env (nothing shared between those)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import gymnasium as gym

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from heavy_env import HeavyEnv

from gym_fork.bench.clones import measure as _measure
from gym_fork.bench.clones import pct, sandbox_setup

# The independent processes build the env from benchmarks/heavy_env.py, as this script does.
HERE = os.path.dirname(os.path.abspath(__file__))
IMPORTS = f"import sys; sys.path.insert(0, {HERE!r}); from heavy_env import HeavyEnv"


def cartpole():
    return gym.make("CartPole-v1")


def measure(name: str, make, expr: str, cold_runs: int, clone_runs: int) -> dict:
    """Cold, clone, fork, fan-out of 64 (3 times) and memory of 64 clones."""
    return _measure(
        name, make, expr, cold_runs, clone_runs, fan_sizes=(64,), fan_repeats=3, imports=IMPORTS
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer runs, 50 MB heavy env")
    parser.add_argument(
        "--setup", action="store_true", help="only a new sandbox's isolation set-up (root)"
    )
    parser.add_argument("--json", metavar="OUT", help="write every sample as JSON to OUT")
    args = parser.parse_args()
    if args.setup:
        setup = sandbox_setup()
        if setup is None:
            sys.exit("no tree could be made here (the set-up needs root)")
        print(
            f"sandbox set-up (enter_sandbox + report, fork of a CartPole parent): "
            f"{setup['wall_ms']:.2f} ms wall, {setup['cpu_ms']:.2f} ms CPU, "
            f"{setup['faults']:.0f} page faults (medians of 40)"
        )
        return
    runs = 15 if args.quick else 50
    mb = 50 if args.quick else 200
    cases = [
        ("CartPole-v1", cartpole, "gym.make('CartPole-v1')", 20),
        (
            f"heavy {mb} MB, THP on",
            functools.partial(HeavyEnv, 1.5, mb, True),
            f"HeavyEnv(1.5, {mb}, True)",
            2,
        ),
        (
            f"heavy {mb} MB, THP off",
            functools.partial(HeavyEnv, 1.5, mb, False),
            f"HeavyEnv(1.5, {mb}, False)",
            2,
        ),
    ]
    load_before = os.getloadavg()
    rows = [measure(name, make, expr, cold_runs, runs) for name, make, expr, cold_runs in cases]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "quick": args.quick,
                    "heavy_mb": mb,
                    "heavy_init_s": 1.5,
                    "rows": rows,
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                },
                out,
                indent=1,
            )
    ms = 1000.0
    print(
        f"{'env':<24}{'cold p50':>10}{'clone p50/p99':>16}{'apart p50':>10}{'fork p50/p99':>15}"
        f"{'vs cold':>9}{'fan-out 64':>12}{'PSS +64 clones':>15}{'vs 64 indep.':>13}"
    )
    for r in rows:
        cold = statistics.median(r["cold"])
        clone50, clone99 = pct(r["clone"], 0.5), pct(r["clone"], 0.99)
        fork50, fork99 = pct(r["fork"], 0.5), pct(r["fork"], 0.99)
        print(
            f"{r['name']:<24}{cold * ms:>8.1f}ms"
            f"{clone50 * ms:>8.2f}/{clone99 * ms:<6.2f}ms"
            f"{pct(r['clone_apart'], 0.5) * ms:>8.2f}ms"
            f"{fork50 * ms:>7.2f}/{fork99 * ms:<6.2f}ms"
            f"{cold / clone50:>8.0f}x"
            f"{statistics.median(r['fan']) * ms:>10.1f}ms"
            f"{r['clones_pss_kb'] / 1024:>12.1f} MB"
            f"{r['independent_pss_kb'] / max(1, r['clones_pss_kb']):>11.1f}x"
        )
    print(
        "\napart: clones 30 ms apart (back to back, the loop outruns the idle pool's refill)."
        "\nvs cold: cold p50 / clone p50. vs 64 indep.: 64 independent processes' PSS divided"
        " by the PSS the 64 clones added (the goal is >= 20x)."
    )


if __name__ == "__main__":
    main()

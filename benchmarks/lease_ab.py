"""Resets by clone with and without the lease fast path, side by side (issue 33).

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/lease_ab.py --rounds 3 [--json OUT]

A lease is an idle sandbox the warm parent hands to the controller ahead of need
(gym_fork/hosts/process/leases.py): a reset by clone then assigns it without a round trip
to the warm parent. ``GYM_FORK_LEASES=0`` closes the lease channel at once (spawns ask the
warm parent, which still keeps its idle pool). Each (contender, workload) runs in a fresh
interpreter, contenders interleaved, rounds repeated; each run times ``reset()`` plus the
first ``step()`` of a ``from_parent`` CartPole vector env with ``reset_mode="clone"``:
back to back, and 30 ms apart (as resets at episodes' ends come). The figures are the
median over rounds of each run's p50 / p99 (with min-max), and the load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONTENDERS = {"leases": "1", "no leases": "0"}
WORKLOADS = (1, 8)  # sub-envs, every one reset by a fresh clone at each reset()
GAP_S = 0.03


def one_run(num_envs: int, resets: int) -> dict:
    """In a fresh interpreter: the reset+first-step times of one contender."""
    import gymnasium as gym
    import numpy as np

    from gym_fork import ForkVectorEnv

    def cartpole():
        return gym.make("CartPole-v1")

    envs = ForkVectorEnv.from_parent(cartpole, num_envs, lineage_log=False)
    actions = np.zeros(num_envs, dtype=np.int64)
    try:
        envs.reset(seed=0)
        envs.step(actions)
        series: dict[str, list[float]] = {"back_to_back": [], "apart": []}
        for name, gap in (("back_to_back", 0.0), ("apart", GAP_S)):
            for i in range(resets):
                time.sleep(gap)
                start = time.perf_counter()
                envs.reset(seed=i)
                envs.step(actions)
                series[name].append(time.perf_counter() - start)
    finally:
        envs.close()
    return {name: _summary(times) for name, times in series.items()}


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "mean_ms": 1e3 * statistics.fmean(ordered),
    }


def _fresh(leases: str, num_envs: int, resets: int) -> dict:
    env = {**os.environ, "GYM_FORK_LEASES": leases}
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--one",
        str(num_envs),
        "--resets",
        str(resets),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise SystemExit(
            f"run (GYM_FORK_LEASES={leases}, {num_envs} envs) failed:\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resets", type=int, default=200)
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_run(args.one, args.resets)))
        return
    runs: list[dict] = []
    for round_ in range(args.rounds):
        for num_envs in WORKLOADS:
            for name, value in CONTENDERS.items():
                before = os.getloadavg()[0]
                figures = _fresh(value, num_envs, args.resets)
                after = os.getloadavg()[0]
                runs.append(
                    {
                        "round": round_,
                        "envs": num_envs,
                        "contender": name,
                        "load": [before, after],
                        **figures,
                    }
                )
                print(
                    f"round {round_} x{num_envs} {name:9s} load {before:.2f}->{after:.2f} "
                    + "  ".join(
                        f"{s} p50 {figures[s]['p50_ms']:.2f} p99 {figures[s]['p99_ms']:.2f}"
                        for s in ("back_to_back", "apart")
                    ),
                    flush=True,
                )
    print(
        f"\n{os.cpu_count()} cores; medians over {args.rounds} rounds (min-max), "
        "ms of reset + first step"
    )
    for num_envs in WORKLOADS:
        for series in ("back_to_back", "apart"):
            cells = []
            for name in CONTENDERS:
                mine = [r[series] for r in runs if r["envs"] == num_envs and r["contender"] == name]
                for stat in ("p50_ms", "p99_ms"):
                    values = [m[stat] for m in mine]
                    cells.append(
                        f"{name} {stat[:3]} {statistics.median(values):.2f} "
                        f"({min(values):.2f}-{max(values):.2f})"
                    )
            print(f"x{num_envs} {series:12s} " + " | ".join(cells))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cores": os.cpu_count(), "resets": args.resets, "runs": runs}, out, indent=1)


if __name__ == "__main__":
    main()

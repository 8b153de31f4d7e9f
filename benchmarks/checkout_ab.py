"""Step and clone times of two checkouts side by side: did a change cost the hot paths?

    git worktree add /tmp/base <commit> && cp gym_fork/_ring.abi3.so /tmp/base/gym_fork/
    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/checkout_ab.py \
        --base /tmp/base [--new /work/main] [--rounds 3] [--json OUT]

Each measurement is a fresh interpreter whose ``gym_fork`` comes from one checkout
(PYTHONPATH; the probe prints where it imported it from), the two checkouts interleaved,
``--rounds`` rounds. Probes: CartPole x8, the 100 us step x8 and Pong x8 steps/s (ForkVectorEnv,
envs_per_worker auto), a reset by clone + first step (``from_parent`` x1,
back to back) and a ``fork()`` + first step of a 1-env branch, each p50 over its run.
Reports the median over rounds with min-max and new / base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROBES = (
    "cartpole_x8_steps_per_s",
    "slow100us_x8_steps_per_s",
    "pong_x8_steps_per_s",
    "clone_p50_ms",
    "fork_p50_ms",
)


def probe() -> dict:
    """In a fresh interpreter: every probe once, with this interpreter's gym_fork."""
    import gymnasium as gym
    import numpy as np

    import gym_fork
    from gym_fork import ForkVectorEnv

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peers

    out: dict = {"gym_fork": os.path.dirname(gym_fork.__file__)}
    for kind, steps, name in (
        ("cartpole", 3000, PROBES[0]),
        ("slow100us", 500, PROBES[1]),
        ("pong", 400, PROBES[2]),
    ):
        env_fn, actions_n, _ = peers.ENVS[kind]
        actions = np.random.default_rng(0).integers(0, actions_n, (steps + 50, 8))
        envs = ForkVectorEnv([env_fn] * 8, lineage_log=False)
        try:
            envs.reset(seed=0)
            for a in actions[:50]:
                envs.step(a)
            started = time.perf_counter()
            for a in actions[50:]:
                envs.step(a)
            out[name] = steps * 8 / (time.perf_counter() - started)
        finally:
            envs.close()

    def cartpole():
        return gym.make("CartPole-v1")

    one = np.zeros(1, dtype=np.int64)
    envs = ForkVectorEnv.from_parent(cartpole, 1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.step(one)
        clones, forks = [], []
        for i in range(100):
            started = time.perf_counter()
            envs.reset(seed=i)
            envs.step(one)
            clones.append(time.perf_counter() - started)
        for i in range(50):
            started = time.perf_counter()
            branch = envs.fork(f"b{i}")
            branch.step(one)
            forks.append(time.perf_counter() - started)
            branch.close()
    finally:
        envs.close()
    out[PROBES[3]] = 1e3 * statistics.median(clones)
    out[PROBES[4]] = 1e3 * statistics.median(forks)
    return out


def _fresh(checkout: str) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    argv = [sys.executable, os.path.abspath(__file__), "--probe"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, cwd="/")
    if done.returncode != 0:
        raise SystemExit(f"probe of {checkout} failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if os.path.realpath(got["gym_fork"]) != os.path.realpath(os.path.join(checkout, "gym_fork")):
        raise SystemExit(f"the probe imported {got['gym_fork']}, not {checkout}'s gym_fork")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the checkout to compare against")
    parser.add_argument(
        "--new", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe()))
        return
    if not args.base:
        parser.error("--base is required")
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for round_ in range(args.rounds):
        for label in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
            before = os.getloadavg()[0]
            got = _fresh(getattr(args, label))
            got["load"] = [before, os.getloadavg()[0]]
            runs[label].append(got)
            print(
                f"[{round_}] {label:4s} load {got['load'][0]:.2f}->{got['load'][1]:.2f} "
                + " ".join(f"{p}={got[p]:.2f}" for p in PROBES),
                flush=True,
            )
    print(f"\n{os.cpu_count()} cores, medians of {args.rounds} (min-max)")
    for name in PROBES:
        cells = []
        medians = {}
        for label in ("base", "new"):
            values = [r[name] for r in runs[label]]
            medians[label] = statistics.median(values)
            cells.append(f"{label} {medians[label]:.2f} ({min(values):.2f}-{max(values):.2f})")
        print(
            f"  {name:26s} "
            + "  ".join(cells)
            + f"  new/base {medians['new'] / medians['base']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"base": args.base, "new": args.new, "runs": runs}, out, indent=1)


if __name__ == "__main__":
    main()

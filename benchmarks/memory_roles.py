"""Where the memory of 16 envs goes, per process role: PSS (shared pages split among
their sharers) and USS (pages only that process has: what it costs to keep it).

    python benchmarks/memory_roles.py [--runs 3] [--envs pong|cartpole] [--n 16]

Each contender runs in a fresh interpreter (the way a script builds its first vector
env), contenders interleaved, medians of ``--runs``. Roles: the controller; the
sandboxes (AsyncVectorEnv's workers, ForkVectorEnv's worker sandboxes); the zygote; the
rest of the tree (the warm parent, the process waiting for it, idle sandboxes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers

CONTENDERS = [peers.ASYNC, peers.FORK1, peers.FORK]


def private_and_proportional_kb(pid: int) -> tuple[int, int]:
    """(USS, PSS) of ``pid`` in KiB, (0, 0) once it is gone."""
    uss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    uss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return uss, pss


def measure_child(contender: str, kind: str, n: int) -> None:
    """(In a fresh process.) Build, reset and step 50 times; print MiB per role as JSON."""
    import numpy as np

    from gym_fork.bench.clones import tree_of
    from gym_fork.hosts.process import zygote

    envs = peers.make(contender, kind, n)
    try:
        envs.reset(seed=0)
        _, actions_n, _ = peers.ENVS[kind]
        for actions in np.random.default_rng(0).integers(0, actions_n, (50, n)):
            envs.step(actions)
        sandboxes = set(getattr(envs, "worker_pids", None) or [])
        zygotes = {pid for pid, _ in zygote.running()}
        processes = set(tree_of(os.getpid())) | sandboxes | zygotes
        if not sandboxes:  # AsyncVectorEnv: its workers are our children
            sandboxes = processes - {os.getpid()}
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for pid in processes:
            if pid == os.getpid():
                role = "controller"
            elif pid in sandboxes:
                role = "sandboxes"
            elif pid in zygotes:
                role = "zygote"
            else:
                role = "rest of the tree"
            uss, pss = private_and_proportional_kb(pid)
            totals[role][0] += uss / 1024
            totals[role][1] += pss / 1024
        print(json.dumps(totals))
    finally:
        envs.close()


def run_fresh(contender: str, kind: str, n: int) -> dict[str, list[float]]:
    from gym_fork.bench.fresh import last_json

    argv = [sys.executable, os.path.abspath(__file__), "--child", contender, kind, str(n)]
    return last_json(argv, 600, contender)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--envs", default="pong", choices=sorted(peers.ENVS))
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure_child(args.child[0], args.child[1], int(args.child[2]))
        return
    runs: dict[str, list[dict[str, list[float]]]] = defaultdict(list)
    for _ in range(args.runs):
        for contender in CONTENDERS:  # interleaved
            runs[contender].append(run_fresh(contender, args.envs, args.n))
    print(f"{args.n} {args.envs} envs, MiB, medians of {args.runs} (USS / PSS)")
    print("| contender | controller | sandboxes | zygote | rest of the tree | total |")
    print("|---|---|---|---|---|---|")
    for contender, results in runs.items():
        cells = []
        for role in ("controller", "sandboxes", "zygote", "rest of the tree", None):
            uss = [
                sum(r[k][0] for k in r) if role is None else r.get(role, [0, 0])[0] for r in results
            ]
            pss = [
                sum(r[k][1] for k in r) if role is None else r.get(role, [0, 0])[1] for r in results
            ]
            cells.append(f"{statistics.median(uss):.0f} / {statistics.median(pss):.0f}")
        print(f"| {contender} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

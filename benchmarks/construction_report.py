"""Construction + first reset of CartPole x8, the first vector env of a fresh process:
ForkVectorEnv against AsyncVectorEnv, each measurement in a new interpreter, the
contenders interleaved, medians (min-max).

    .venv/bin/python benchmarks/construction_report.py [--runs 3] [--work 0 0.3 torch]

Contenders: ``fork`` (``from gym_fork import ForkVectorEnv``: the lookup starts the
zygote), ``fork-lazy`` (imported from its module: the zygote starts at construction, as
``import gym_fork`` then ``gym_fork.ForkVectorEnv(...)`` later would not), ``fork-ready``
(the lookup, then ``gym_fork.prestart(wait=True)`` before the clock starts: the best a
zygote kept across processes could give), ``async`` (``gymnasium.vector.AsyncVectorEnv``).
``--work``: what the script does between its imports and the construction (a script
that loads a model first): a number is seconds of sleep, anything else a module to
import (``torch``). Also printed: the load average, the whole process's wall time and,
for ForkVectorEnv, a second vector env of the process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

IMPORTS = {
    "fork": "from gym_fork import ForkVectorEnv as Vector\n",
    "fork-lazy": "from gym_fork.vector.fork_vector_env import ForkVectorEnv as Vector\n",
    "fork-ready": (
        "import gym_fork\nVector = gym_fork.ForkVectorEnv\ngym_fork.prestart(wait=True)\n"
    ),
    "async": "Vector = gym.vector.AsyncVectorEnv\n",
}

SCRIPT = """
import json, time
import gymnasium as gym
{imports}
{work}
fns = [lambda: gym.make("CartPole-v1")] * 8
figures = {{}}
for name in ("first", "second"):
    started = time.perf_counter()
    envs = Vector(fns)
    envs.reset(seed=0)
    figures[name] = time.perf_counter() - started
    envs.close()
print(json.dumps(figures))
"""


def work_code(work: str) -> str:
    """The script's line for ``--work``: a sleep of that many seconds, or an import."""
    try:
        return f"time.sleep({float(work)})"
    except ValueError:
        return f"import {work}"


def measure(kind: str, work: str) -> dict[str, float]:
    """One fresh interpreter: its first and second vector env, and its wall time."""
    from gym_fork.bench.fresh import last_json

    started = time.perf_counter()
    script = SCRIPT.format(imports=IMPORTS[kind], work=work_code(work))
    figures = last_json([sys.executable, "-c", script], 120, "the measuring process")
    return {**figures, "process": time.perf_counter() - started}


def shown(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", nargs="+", default=["0", "0.3"])
    parser.add_argument("--json", metavar="OUT", help="write every run's figures as JSON")
    args = parser.parse_args()
    load_before = os.getloadavg()
    print(f"load average (1, 5, 15 min) at the start: {load_before}")
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for work in args.work:
        rows: dict[str, list[dict[str, float]]] = {kind: [] for kind in IMPORTS}
        for _ in range(args.runs):
            for kind in IMPORTS:
                rows[kind].append(measure(kind, work))
        results[work] = rows
        base = statistics.median(r["first"] for r in rows["async"])
        print(f"--work {work}: seconds, median (min-max) of {args.runs} fresh processes")
        for kind, runs in rows.items():
            first = [r["first"] for r in runs]
            print(
                f"  {kind:10s} first env {shown(first)} = "
                f"{statistics.median(first) / base:.1f}x async; second env "
                f"{shown([r['second'] for r in runs])}; "
                f"whole process {shown([r['process'] for r in runs])}"
            )
    print(f"load average at the end: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "runs": args.runs,
                    "work": results,
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()

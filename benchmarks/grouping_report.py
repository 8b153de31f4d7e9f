"""What ``envs_per_worker="auto"`` leaves on the table: ``gym_fork.autotune`` on two envs
that pull the grouping opposite ways, each in a fresh interpreter.

    .venv/bin/python benchmarks/grouping_report.py [--rounds 3] [--json OUT]

Rows: CartPole-v1 x8 (a ~5 us step: fewer hand-overs win) and the ~100 us Python step
x8 (a core per sandbox wins). For each: every grouping autotune tried (sub-env steps/s,
medians of its rounds) and the fastest one's ratio to the default "auto".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = {"CartPole x8": "cartpole", "100 us step x8": "slow100us"}

CHILD = """
import json, sys
sys.path.insert(0, {here!r})
import peers
import gym_fork
fn = peers.ENVS[{kind!r}][0]
r = gym_fork.autotune([fn] * 8, rounds={rounds})
print(json.dumps({{"by_grouping": r.steps_per_second, "rounds": r.rounds,
                  "recommended": r.envs_per_worker, "auto": r.auto}}))
"""


def main() -> None:
    from gym_fork.bench.fresh import last_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = {}
    for row, kind in ROWS.items():
        code = CHILD.format(here=HERE, kind=kind, rounds=args.rounds)
        rows[row] = last_json([sys.executable, "-c", code], 600, f"autotune {row}")
        found = rows[row]
        best = found["by_grouping"][str(found["recommended"])]
        auto = found["by_grouping"][str(found["auto"])]
        print(
            f"{row}: auto = {found['auto']} per worker, fastest {found['recommended']} "
            f"({best / auto:.2f}x auto)"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"rows": rows, "load_before": load_before, "load_after": os.getloadavg()},
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()

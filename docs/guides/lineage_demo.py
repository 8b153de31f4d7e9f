"""The demo lineage of docs/guides/lineage.md: a small lookahead tree search over
CartPole-v1 with fork(), drawn with ``gym-fork lineage --html/--png``.

    .venv/bin/python docs/guides/lineage_demo.py [--out docs/images] [--depth 3]
    .venv/bin/python docs/guides/lineage_demo.py --log PATH   # log there, draw nothing

By default it logs to a temporary file and draws that log's one tree into ``--out``.
With ``--log PATH`` its tree is appended to the lineage log PATH as any run's is
(``gym-fork lineage PATH`` shows it, headed by its time and script), and it draws
pictures only when ``--out`` is given too.

At each depth the current node is expanded: one ``fork(copies=2)`` tries both actions,
then each child is scored by 4 reseeded random rollouts (a branch of its own). The
better child becomes the next node; the rollouts of the losing action are terminated,
everything else is closed, and the final node is still running when the picture is
taken (status "open").
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv
from gym_fork.lineage import read_log, read_logs, render_html, render_png


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def rollout_return(branch: ForkVectorEnv, steps: int, rng: np.random.Generator) -> float:
    """Mean return of the branch's sub-envs under random actions, up to ``steps`` steps
    or until each one's episode ends."""
    total = np.zeros(branch.num_envs)
    alive = np.ones(branch.num_envs, dtype=bool)
    for _ in range(steps):
        actions = rng.integers(0, 2, branch.num_envs)
        _, rewards, terminated, truncated, _ = branch.step(actions)
        total += rewards * alive
        alive &= ~(terminated | truncated)
        if not alive.any():
            break
    return float(total.mean())


def search(log_path: str | os.PathLike, depth: int = 3, rollout_steps: int = 60):
    """Run the search, logging its lineage to ``log_path``; return (the final node,
    the chosen actions). The caller closes the final node."""
    rng = np.random.default_rng(0)
    root = ForkVectorEnv.from_parent(cartpole, 1, branch_id="cartpole-root", lineage_log=log_path)
    root.reset(seed=0)
    node, index, chosen = root, 0, []
    try:
        for d in range(depth):
            expand = node.fork(f"expand-{d}", indices=[index], copies=2)
            expand.step(np.array([0, 1]))
            scores = []
            rollouts = []
            for action in (0, 1):
                branch = expand.fork(
                    f"rollouts-{d}-a{action}",
                    indices=[action],
                    copies=4,
                    reseed=100 * d + 10 * action,
                )
                scores.append(rollout_return(branch, rollout_steps, rng))
                rollouts.append(branch)
            best = int(np.argmax(scores))
            for action, branch in enumerate(rollouts):
                branch.close(terminate=action != best)  # pruned: killed, not closed
            node.close()  # a branch outlives its source
            node, index = expand, best
            chosen.append(best)
    except BaseException:
        node.close()
        raise
    return node, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description="A lookahead search over CartPole-v1.")
    parser.add_argument("--out", help="where to write the pictures (default: docs/images)")
    parser.add_argument("--depth", type=int, default=3, help="levels of the search (default 3)")
    parser.add_argument(
        "--log", help="append the tree to this lineage log (default: a temporary one)"
    )
    args = parser.parse_args()
    if args.log:
        node, chosen = search(args.log, args.depth)
        node.close()
        print(f"actions chosen: {chosen}; its tree: gym-fork lineage {args.log}")
        if args.out:
            draw(read_logs(args.log), Path(args.out), chosen)
        return
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "lineage.jsonl"
        node, chosen = search(log, args.depth)
        try:
            events = read_log(log)  # taken while the final node still runs
        finally:
            node.close()
    out = Path(args.out or "docs/images")
    draw(events, out, chosen)
    with open(out / "lineage-demo.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(e, sort_keys=True) + "\n" for e in events)
    print(f"wrote {out}/lineage-demo.html, .png and .jsonl")


def draw(events: list[dict], out: Path, chosen: list[int]) -> None:
    """The HTML page and PNG of the latest tree named cartpole-root in ``events``."""
    out.mkdir(parents=True, exist_ok=True)
    title = f"Lookahead search over CartPole-v1 (actions chosen: {chosen})"
    page = render_html(events, title=title, source="demo", root="cartpole-root")
    (out / "lineage-demo.html").write_text(page)
    render_png(events, out / "lineage-demo.png", title=title, root="cartpole-root")


if __name__ == "__main__":
    main()

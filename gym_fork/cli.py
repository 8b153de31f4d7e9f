"""The ``gym-fork`` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gym-fork``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="gym-fork", description="gym_fork tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the drop-in swap from AsyncVectorEnv, and its speed")
    demo.add_argument("--num-envs", type=int, default=8)
    demo.add_argument("--steps", type=int, default=3000)
    sub.add_parser("doctor", help="what this host supports and what gym_fork will use")
    lineage = sub.add_parser("lineage", help="print the branch tree of a lineage log")
    lineage.add_argument("log", nargs="?", help="a lineage JSONL log (default: the default log)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from gym_fork.demo import run

        run(args.num_envs, args.steps)
    elif args.command == "doctor":
        from gym_fork.doctor import run

        return run()
    elif args.command == "lineage":
        from gym_fork.lineage import default_log_path, read_log, render_tree

        path = args.log or default_log_path()
        if path is None:
            parser.error("no log given and the default log is disabled")
        try:
            events = read_log(path)
        except FileNotFoundError:
            print(f"gym-fork lineage: no such log: {path}")
            return 2
        print(render_tree(events) or "(no branches in this log)")
    return 0

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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from gym_fork.demo import run

        run(args.num_envs, args.steps)
    return 0

"""Benchmarks of gym_fork against Gymnasium's vector envs and cold starts, shared by
``gym-fork bench`` and the scripts in benchmarks/."""

from gym_fork.bench.run import MODES, Sizes, format_table, run_bench

__all__ = ["MODES", "Sizes", "format_table", "run_bench"]

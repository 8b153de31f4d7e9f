"""Stable-Baselines3 adapter: ``from gym_fork.sb3 import ForkVecEnv, fork_wrapped``."""

from gym_fork.adapters.sb3 import ForkVecEnv, fork_wrapped

__all__ = ["ForkVecEnv", "fork_wrapped"]

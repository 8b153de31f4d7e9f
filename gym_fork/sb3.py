"""Stable-Baselines3 adapter: ``from gym_fork.sb3 import ForkVecEnv``."""

from gym_fork.adapters.sb3 import ForkVecEnv

__all__ = ["ForkVecEnv"]

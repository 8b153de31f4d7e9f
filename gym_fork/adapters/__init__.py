"""Adapters that put gym_fork under other RL libraries.

- :class:`gym_fork.adapters.sb3.ForkVecEnv`: a Stable-Baselines3 ``VecEnv`` over a
  :class:`~gym_fork.ForkVectorEnv` (needs the ``sb3`` extra).
- :func:`gym_fork.adapters.infos.unbatch_infos`: Gymnasium's batched info dict (with its
  ``_key`` masks) turned into one plain dict per sub-env.

Nothing heavy is imported here: sandboxes import :mod:`gym_fork.adapters.bridge` to
rebuild the sub-envs of an SB3 vector env, and must not pay for torch.
"""

from __future__ import annotations

from typing import Any

from gym_fork.adapters.infos import unbatch_infos

__all__ = ["ForkVecEnv", "unbatch_infos"]


def __getattr__(name: str) -> Any:
    if name == "ForkVecEnv":
        from gym_fork.adapters.sb3 import ForkVecEnv

        return ForkVecEnv
    raise AttributeError(f"module 'gym_fork.adapters' has no attribute {name!r}")

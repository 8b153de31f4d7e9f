"""SB3 ``VecEnvWrapper``s copied onto a branch, with their state.

A branch of sub-envs wrapped in ``VecNormalize`` must see the observations normalised
as its source did, and a ``VecFrameStack`` branch must hold the frames its source
sub-envs had stacked. :func:`copy_wrappers` wraps a branch in copies of its source's
wrappers: running statistics copied (the branch updates its own, never its source's),
per-sub-env state (returns, last observations, stacked frames) taken row by row from
the sub-envs each branch sub-env was cloned from. A wrapper whose state gym_fork does
not know is refused up front (:func:`check_carried`) with what to do instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from stable_baselines3.common.vec_env import (
    VecCheckNan,
    VecEnv,
    VecEnvWrapper,
    VecFrameStack,
    VecNormalize,
    VecTransposeImage,
)


def _rows(value: Any, sources: list[int], num_envs: int) -> Any:
    """Per-sub-env state (an array, or a dict of arrays, along the sub-env axis) for the
    branch: the rows of its sources, copied; anything else (not set yet) copied whole."""
    if isinstance(value, dict):
        return {key: _rows(item, sources, num_envs) for key, item in value.items()}
    if isinstance(value, np.ndarray) and value.ndim and len(value) == num_envs:
        return value[sources]  # fancy indexing copies
    return copy.deepcopy(value)


def _normalize(source: VecNormalize, new: VecNormalize, sources: list[int]) -> None:
    new.obs_rms = copy.deepcopy(source.obs_rms)
    new.ret_rms = copy.deepcopy(source.ret_rms)
    new.norm_obs_keys = copy.copy(source.norm_obs_keys)
    for name in ("returns", "old_obs", "old_reward"):
        if hasattr(source, name):
            setattr(new, name, _rows(getattr(source, name), sources, source.num_envs))


def _stacked(stacked: Any, sources: list[int], num_envs: int) -> Any:
    """A copy of a StackedObservations holding the stacked frames of ``sources``."""
    new = copy.copy(stacked)
    if hasattr(stacked, "sub_stacked_observations"):
        new.sub_stacked_observations = {
            key: _stacked(sub, sources, num_envs)
            for key, sub in stacked.sub_stacked_observations.items()
        }
    else:
        new.stacked_obs = _rows(stacked.stacked_obs, sources, num_envs)
    return new


def _frame_stack(source: VecFrameStack, new: VecFrameStack, sources: list[int]) -> None:
    new.stacked_obs = _stacked(source.stacked_obs, sources, source.num_envs)


def _check_nan(source: VecCheckNan, new: VecCheckNan, sources: list[int]) -> None:
    for name in ("_actions", "_observations"):
        if hasattr(source, name):
            setattr(new, name, _rows(getattr(source, name), sources, source.num_envs))


def _stateless(source: VecEnvWrapper, new: VecEnvWrapper, sources: list[int]) -> None:
    pass


# The wrappers whose state gym_fork knows, by exact type (a subclass may hold more).
CARRIED: dict[type, Callable[[Any, Any, list[int]], None]] = {
    VecNormalize: _normalize,
    VecFrameStack: _frame_stack,
    VecCheckNan: _check_nan,
    VecTransposeImage: _stateless,
}


def check_carried(chain: Sequence[VecEnvWrapper]) -> None:
    """Refuse (TypeError) a wrapper chain with a wrapper whose state is not carried."""
    for wrapper in chain:
        if type(wrapper) not in CARRIED:
            name = type(wrapper).__name__
            known = ", ".join(t.__name__ for t in CARRIED)
            raise TypeError(
                f"fork() through {name}: gym_fork carries the state of {known} into a "
                f"branch, not {name}'s (exact types; a subclass may hold more state). "
                f"Fork the ForkVecEnv under the wrappers instead (env.unwrapped.fork(...)) "
                f"and wrap the branch in a new {name} yourself, copying what of its state "
                "the branch needs."
            )


def copy_wrapper(wrapper: VecEnvWrapper, venv: VecEnv, sources: list[int]) -> VecEnvWrapper:
    """``wrapper`` around ``venv``, a branch whose sub-env j was cloned from sub-env
    ``sources[j]`` of the env under ``wrapper``: its settings as they are, its state
    copied (see the module docstring)."""
    new = object.__new__(type(wrapper))
    new.__dict__.update(wrapper.__dict__)
    new.venv = venv
    new.num_envs = venv.num_envs
    infos = wrapper.reset_infos if len(wrapper.reset_infos) == wrapper.num_envs else None
    new.reset_infos = [copy.deepcopy(infos[i]) if infos else {} for i in sources]
    new._seeds = [None] * venv.num_envs
    new._options = [{} for _ in range(venv.num_envs)]
    CARRIED[type(wrapper)](wrapper, new, sources)
    return new


def copy_wrappers(chain: Sequence[VecEnvWrapper], branch: VecEnv, sources: list[int]) -> VecEnv:
    """``branch`` wrapped in copies of ``chain`` (innermost first), each with its state."""
    check_carried(chain)
    env = branch
    for wrapper in chain:
        env = copy_wrapper(wrapper, env, sources)
    return env

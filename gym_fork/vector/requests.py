"""Checks of what a caller passes to reset and set_attr, with AsyncVectorEnv's errors."""

from __future__ import annotations

from typing import Any

import numpy as np


def seeds_per_env(seed: int | list[int | None] | None, num_envs: int) -> list[int | None]:
    """One seed per sub-env: None, ``seed + i``, or the caller's list (checked)."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, int):
        return [seed + i for i in range(num_envs)]
    if len(seed) != num_envs:
        raise ValueError(
            "If seeds are passed as a list the length must match "
            f"num_envs={num_envs} but got length={len(seed)}."
        )
    return list(seed)


def values_per_env(values: Any, num_envs: int) -> list[Any] | tuple[Any, ...]:
    """One value per sub-env for set_attr: the caller's list/tuple, or one value for all."""
    if not isinstance(values, list | tuple):
        return [values] * num_envs
    if len(values) != num_envs:
        raise ValueError(
            "Values must be a list or tuple with length equal to the number of "
            f"environments. Got `{len(values)}` values for {num_envs} environments."
        )
    return values


def reset_mask(options: dict[str, Any] | None, num_envs: int):
    """(options without ``reset_mask``, the mask), checked as AsyncVectorEnv checks it."""
    mask = np.ones(num_envs, dtype=np.bool_)
    if options is None or "reset_mask" not in options:
        return options, mask
    options = dict(options)
    reset_mask = options.pop("reset_mask")
    if not isinstance(reset_mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(reset_mask)}")
    if reset_mask.shape != (num_envs,):
        raise ValueError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {reset_mask.shape}"
        )
    if reset_mask.dtype != np.bool_:
        raise TypeError(
            f"`options['reset_mask']` must have `dtype=np.bool_`, got {reset_mask.dtype}"
        )
    if not np.any(reset_mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one "
            f"True value, got reset_mask={reset_mask}"
        )
    return options, reset_mask

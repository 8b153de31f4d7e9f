"""Turn Gymnasium's batched info dict back into one dict per sub-env."""

from __future__ import annotations

from typing import Any

import numpy as np

# Gymnasium batches Python scalars into arrays of these dtypes; their elements go back to
# Python scalars (lossless: np.float64 and np.int64 values compare equal to them).
_PYTHON_KINDS = {np.dtype(np.bool_): bool, np.dtype(np.int64): int, np.dtype(np.float64): float}


def _element(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, np.generic):
        convert = _PYTHON_KINDS.get(value.dtype)
        return convert(value) if convert else value
    return value


def unbatch_infos(infos: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """Split a vector env's info dict into ``num_envs`` per-sub-env dicts.

    A key goes to sub-env ``i`` only where its ``_key`` mask is true; nested dicts (such as
    ``final_info`` or ``episode``) are split recursively. Array entries are copied, so
    the result never aliases the batch. A key without a mask is given to every sub-env.
    """
    out: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in infos.items():
        if isinstance(key, str) and key.startswith("_") and key[1:] in infos:
            continue  # the mask of another key
        mask = infos.get(f"_{key}")
        owners = range(num_envs) if mask is None else np.flatnonzero(mask)
        if isinstance(value, dict):
            nested = unbatch_infos(value, num_envs)
            for i in owners:
                out[i][key] = nested[i]
        elif mask is None and not (
            isinstance(value, np.ndarray) and value.ndim and len(value) == num_envs
        ):
            for i in owners:
                out[i][key] = value
        else:
            for i in owners:
                out[i][key] = _element(value[i])
    return out

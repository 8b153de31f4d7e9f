"""Splitting a batch over shards and putting shard batches back together.

A shard owns the sub-envs at some global positions (a ``slice`` when they are contiguous,
else an index array); these helpers walk Dict and Tuple spaces down to their leaves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces

ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
Selector = slice | np.ndarray


def positions(sel: Selector, n: int) -> np.ndarray:
    """The global indices a selector stands for."""
    return np.arange(n)[sel]


def take(space: spaces.Space, batch: Any, sel: Selector) -> Any:
    """The part of a batched value (actions, observations) at ``sel``."""
    if isinstance(space, spaces.Dict):
        return {k: take(s, batch[k], sel) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(take(s, b, sel) for s, b in zip(space.spaces, batch, strict=True))
    if isinstance(space, ARRAY_SPACES):
        return np.asarray(batch)[sel]
    items = list(batch)
    return tuple(items[i] for i in positions(sel, len(items)))


def assemble(space: spaces.Space, n: int, parts: list[tuple[Selector, Any]]) -> Any:
    """A fresh batch of ``n`` items from shard batches ``(selector, batch)``."""
    if isinstance(space, spaces.Dict):
        return {k: assemble(s, n, [(p, b[k]) for p, b in parts]) for k, s in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(
            assemble(s, n, [(p, b[j]) for p, b in parts]) for j, s in enumerate(space.spaces)
        )
    if isinstance(space, ARRAY_SPACES):
        out = np.empty((n, *space.shape), dtype=space.dtype)
        for sel, batch in parts:
            out[sel] = batch
        return out
    items: list[Any] = [None] * n
    for sel, batch in parts:
        for i, value in zip(positions(sel, n), batch, strict=True):
            items[i] = value
    return tuple(items)


def scalars(n: int, dtype: Any, parts: list[tuple[Selector, np.ndarray]]) -> np.ndarray:
    """Rewards or done flags of ``n`` sub-envs from shard arrays."""
    out = np.empty(n, dtype=dtype)
    for sel, values in parts:
        out[sel] = values
    return out


def merge_infos(n: int, parts: list[tuple[np.ndarray, dict[str, Any]]]) -> dict[str, Any]:
    """Merge shard info dicts (Gymnasium's vector format: ``info[k]`` one entry per
    sub-env, ``info["_k"]`` the mask of the sub-envs that set it) into one of ``n``.

    The result equals what ``VectorEnv._add_info`` builds sub-env by sub-env: an entry's
    array takes the dtype that the sub-env with the lowest index setting it gave its
    shard (numeric, else an object array of None), nested dicts merge recursively.
    """
    out: dict[str, Any] = {}
    keys: list[str] = []
    for _pos, info in parts:
        for key in info:
            if f"_{key}" in info and key not in keys:
                keys.append(key)
    for key in keys:
        entries = [
            (pos, info[key], np.asarray(info[f"_{key}"], dtype=np.bool_))
            for pos, info in parts
            if f"_{key}" in info
        ]
        mask = np.zeros(n, dtype=np.bool_)
        for pos, _value, m in entries:
            mask[pos[m]] = True
        if any(isinstance(value, dict) for _p, value, _m in entries):
            out[key] = merge_infos(
                n, [(pos, value) for pos, value, _m in entries if isinstance(value, dict)]
            )
        else:
            first = min(entries, key=lambda e: int(e[0][e[2]].min()) if e[2].any() else n)
            dtype = np.asarray(first[1]).dtype
            if dtype.kind == "O":
                values = np.empty(n, dtype=object)
                values[:] = None
            else:
                values = np.zeros(n, dtype=dtype)
            for pos, value, m in entries:
                values[pos[m]] = np.asarray(value)[m]
            out[key] = values
        out[f"_{key}"] = mask
    return out

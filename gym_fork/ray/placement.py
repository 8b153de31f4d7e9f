"""Where shards go: the nodes of a new vector env's shards and of a fork's copies.

Pure functions of the cluster's node list; nothing here talks to Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def shard_layout(
    alive: list[dict[str, Any]],
    num_envs: int,
    num_shards: int | None = None,
    cores_per_shard: int | None = None,
    nodes: Sequence[str] | None = None,
) -> list[tuple[str, list[int]]]:
    """(node id, sub-env indices) of each shard: ``alive`` are Ray's node entries
    (``NodeID``, ``Resources``); ``nodes`` narrows and orders them; ``num_shards``
    spreads that many round-robin, else one per node (or per ``cores_per_shard`` CPUs);
    never more shards than sub-envs, sub-envs in contiguous, even blocks."""
    if nodes is not None:
        wanted = list(nodes)
        alive = sorted(
            (n for n in alive if n["NodeID"] in wanted), key=lambda n: wanted.index(n["NodeID"])
        )
    if not alive:
        raise RuntimeError("no alive Ray node with CPUs to place shards on")
    if num_shards is None:
        slots = []
        for node in alive:
            cpus = int(node["Resources"].get("CPU", 1))
            count = max(1, cpus // cores_per_shard) if cores_per_shard else 1
            slots.extend([node["NodeID"]] * count)
    else:
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
        slots = [alive[k % len(alive)]["NodeID"] for k in range(num_shards)]
    slots = slots[:num_envs]
    blocks = np.array_split(np.arange(num_envs), len(slots))
    return [(node, [int(i) for i in block]) for node, block in zip(slots, blocks, strict=True)]


@dataclass
class ExactGroup:
    """The copies one source shard forks on its own node: ``local`` (its indices) with
    ``per_index`` copies each, landing at branch positions ``positions``."""

    shard: Any
    local: list[int] = field(default_factory=list)
    per_index: int = 0
    positions: list[int] = field(default_factory=list)


def fork_layout(
    indices: list[int],
    copies: int,
    owner: Callable[[int], tuple[Any, str, int]],
    nodes: Sequence[str] = (),
) -> tuple[list[ExactGroup], dict[str, list[tuple[int, int]]]]:
    """Where the copies of a fork go. ``owner(i)`` is (shard, its node id, local index)
    of source sub-env ``i``. Copy c of a source goes to the c-th node of its ring (its own
    node first, then the other ``nodes``, round-robin): on its own node it is an exact
    fork (one :class:`ExactGroup` per source shard), elsewhere a fresh sub-env
    (node -> [(branch position, source index)])."""
    exact: dict[int, ExactGroup] = {}
    fresh: dict[str, list[tuple[int, int]]] = {}
    for t, i in enumerate(indices):
        shard, home, local = owner(i)
        ring = [home] + [n for n in nodes if n != home]
        group = exact.setdefault(id(shard), ExactGroup(shard))
        group.local.append(local)
        group.per_index = len(range(0, copies, len(ring)))
        for c in range(copies):
            position = t * copies + c
            node = ring[c % len(ring)]
            if node == home:
                group.positions.append(position)
            else:
                fresh.setdefault(node, []).append((position, i))
    return list(exact.values()), fresh

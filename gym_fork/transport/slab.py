"""Shared batch slabs: observations, actions, rewards and done flags in place.

A slab is one shared region that the controller and every worker of a vector env map.
Each fixed-size leaf of a space (Box, Discrete, MultiDiscrete, MultiBinary, Text) gets
an ``(num_envs, *shape)`` array; Dict and Tuple spaces are trees of leaves. Worker ``i``
writes only row ``i``; the controller reads whole batches as views, so a step copies
no observation through a ring. Spaces with variable-size values (Graph, Sequence,
OneOf, custom spaces) have no slab layout: their values travel in ring records.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gymnasium import spaces

from .region import Region, seal_memfd

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _ArrayLeaf:
    """A Box/Discrete/MultiDiscrete/MultiBinary leaf: one ``(n, *shape)`` array."""

    def __init__(self, space: spaces.Space, n: int) -> None:
        self.space = space
        self.shape = tuple(space.shape)
        self.dtype = np.dtype(space.dtype)
        self.nbytes = n * int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.n = n
        self.array: np.ndarray | None = None

    def bind(self, buffer, offset: int) -> int:
        self.array = np.ndarray((self.n, *self.shape), self.dtype, buffer=buffer, offset=offset)
        return offset + _align(self.nbytes)

    def write(self, index: int, value: Any) -> None:
        value = np.asarray(value)
        if value.shape != self.shape:
            raise ValueError(f"expected shape {self.shape} for {self.space}, got {value.shape}")
        self.array[index] = value

    def read(self, index: int) -> Any:
        row = self.array[index]
        return row.copy() if self.shape else row

    def batch(self) -> Any:
        return self.array

    def accepts(self, values: Any) -> bool:
        """True if ``values`` is already a batch of exactly this dtype and shape."""
        return (
            type(values) is np.ndarray
            and values.dtype == self.dtype
            and values.shape == self.array.shape
        )

    def write_batch(self, values: Any) -> None:
        values = np.asarray(values)
        if values.shape != self.array.shape:
            raise ValueError(
                f"expected a batch of shape {self.array.shape} for {self.space}, got {values.shape}"
            )
        np.copyto(self.array, values, casting="unsafe")


class _TextLeaf:
    """A Text leaf: ``(n, max_length)`` int32 charset indices, padded with charset_length."""

    def __init__(self, space: spaces.Text, n: int) -> None:
        self.space = space
        self.n = n
        self.nbytes = n * space.max_length * 4
        self.array: np.ndarray | None = None

    def bind(self, buffer, offset: int) -> int:
        shape = (self.n, self.space.max_length)
        self.array = np.ndarray(shape, np.int32, buffer=buffer, offset=offset)
        return offset + _align(self.nbytes)

    def write(self, index: int, value: str) -> None:
        if not isinstance(value, str) or len(value) > self.space.max_length:
            raise ValueError(f"expected a str of at most {self.space.max_length} characters")
        pad = len(self.space.character_list)
        codes = [self.space.character_index(c) for c in value]
        self.array[index, : len(codes)] = codes
        self.array[index, len(codes) :] = pad

    def read(self, index: int) -> str:
        chars = self.space.character_list
        pad = len(self.space.character_list)
        return "".join(chars[c] for c in self.array[index] if c < pad)

    def batch(self) -> tuple[str, ...]:
        return tuple(self.read(i) for i in range(self.n))

    def accepts(self, values: Any) -> bool:
        return False

    def write_batch(self, values: Any) -> None:
        values = tuple(values)
        if len(values) != self.n:
            raise ValueError(f"expected {self.n} strings, got {len(values)}")
        for i, value in enumerate(values):
            self.write(i, value)


class _DictNode:
    def __init__(self, space: spaces.Dict, children: dict[str, Any]) -> None:
        self.space = space
        self.children = children

    def bind(self, buffer, offset: int) -> int:
        for child in self.children.values():
            offset = child.bind(buffer, offset)
        return offset

    @property
    def nbytes(self) -> int:
        return sum(_align(c.nbytes) for c in self.children.values())

    def write(self, index: int, value: Any) -> None:
        if set(value.keys()) != set(self.children):
            raise ValueError(f"expected keys {sorted(self.children)}, got {sorted(value.keys())}")
        for key, child in self.children.items():
            child.write(index, value[key])

    def accepts(self, values: Any) -> bool:
        return (
            type(values) is dict
            and values.keys() == self.children.keys()
            and all(c.accepts(values[k]) for k, c in self.children.items())
        )

    def read(self, index: int) -> dict[str, Any]:
        return {key: child.read(index) for key, child in self.children.items()}

    def batch(self) -> dict[str, Any]:
        return {key: child.batch() for key, child in self.children.items()}

    def write_batch(self, values: Any) -> None:
        for key, child in self.children.items():
            child.write_batch(values[key])


class _TupleNode:
    def __init__(self, space: spaces.Tuple, children: list[Any]) -> None:
        self.space = space
        self.children = children

    def bind(self, buffer, offset: int) -> int:
        for child in self.children:
            offset = child.bind(buffer, offset)
        return offset

    @property
    def nbytes(self) -> int:
        return sum(_align(c.nbytes) for c in self.children)

    def write(self, index: int, value: Any) -> None:
        if len(value) != len(self.children):
            raise ValueError(f"expected a tuple of {len(self.children)}, got {len(value)}")
        for child, item in zip(self.children, value, strict=True):
            child.write(index, item)

    def accepts(self, values: Any) -> bool:
        return (
            type(values) is tuple
            and len(values) == len(self.children)
            and all(c.accepts(v) for c, v in zip(self.children, values, strict=True))
        )

    def read(self, index: int) -> tuple[Any, ...]:
        return tuple(child.read(index) for child in self.children)

    def batch(self) -> tuple[Any, ...]:
        return tuple(child.batch() for child in self.children)

    def write_batch(self, values: Any) -> None:
        for child, item in zip(self.children, values, strict=True):
            child.write_batch(item)


def leaves(node) -> list:
    """The leaves of a slab layout tree (each has ``.space`` and ``.array``)."""
    if node is None:
        return []
    if isinstance(node, _DictNode):
        return [leaf for child in node.children.values() for leaf in leaves(child)]
    if isinstance(node, _TupleNode):
        return [leaf for child in node.children for leaf in leaves(child)]
    return [node]


def async_shares(space: spaces.Space) -> bool:
    """True if AsyncVectorEnv(shared_memory=True) accepts ``space`` (Gymnasium 1.x rules)."""
    if type(space) in (
        spaces.Box,
        spaces.Discrete,
        spaces.MultiDiscrete,
        spaces.MultiBinary,
        spaces.Text,
    ):
        return True
    if type(space) is spaces.Dict:
        return all(async_shares(s) for s in space.spaces.values())
    if type(space) in (spaces.Tuple, spaces.OneOf):
        return all(async_shares(s) for s in space.spaces)
    return False


def slab_node(space: spaces.Space, n: int):
    """The slab layout tree of ``space`` batched ``n`` times, or None if it has none."""
    if type(space) in (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary):
        return _ArrayLeaf(space, n)
    if type(space) is spaces.Text:
        return _TextLeaf(space, n)
    if type(space) is spaces.Dict:
        children = {k: slab_node(s, n) for k, s in space.spaces.items()}
        return None if any(c is None for c in children.values()) else _DictNode(space, children)
    if type(space) is spaces.Tuple:
        items = [slab_node(s, n) for s in space.spaces]
        return None if any(c is None for c in items) else _TupleNode(space, items)
    return None


class Slab:
    """The batch slab of one vector env, over a shared :class:`Region`.

    ``observation_space`` / ``action_space`` are the *single* spaces. ``region_fd`` maps
    a memfd made elsewhere (from ``region_offset``: /dev/mem in a VM); its ``owner``
    sizes it first (to ``size`` when that is larger than the layout) and seals it.
    Either space may have no slab layout (``observations``/``actions`` is then None and
    values use the ring).
    Rewards (float64) and termination/truncation flags (bool) always live here.
    """

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        num_envs: int,
        *,
        use_observations: bool = True,
        region: Region | None = None,
        region_fd: int | None = None,
        region_offset: int = 0,
        owner: bool = False,
        size: int | None = None,
    ) -> None:
        self.num_envs = num_envs
        self.observations = slab_node(observation_space, num_envs) if use_observations else None
        self.actions = slab_node(action_space, num_envs)
        self.rewards_leaf = _ArrayLeaf(spaces.Box(-np.inf, np.inf, (), np.float64), num_envs)
        self.terminations_leaf = _ArrayLeaf(spaces.MultiBinary(()), num_envs)
        self.terminations_leaf.dtype = np.dtype(np.bool_)
        self.truncations_leaf = _ArrayLeaf(spaces.MultiBinary(()), num_envs)
        self.truncations_leaf.dtype = np.dtype(np.bool_)
        parts = [self.rewards_leaf, self.terminations_leaf, self.truncations_leaf]
        parts += [p for p in (self.observations, self.actions) if p is not None]
        self.nbytes = max(_ALIGN, sum(_align(p.nbytes) for p in parts))
        if region is None:
            if region_fd is None:
                region = Region(self.nbytes, name="gym_fork-slab")
            else:
                if owner:
                    # Sized once (a VM maps a larger, fixed size), then sealed: no sandbox
                    # holding the fd can shrink it under the controller's mapping.
                    os.ftruncate(region_fd, max(self.nbytes, size or 0))
                    seal_memfd(region_fd)
                region = Region.attach(region_fd, self.nbytes, region_offset)
        self.region = region
        offset = 0
        for part in parts:
            offset = part.bind(region.map, offset)
        self.rewards = self.rewards_leaf.array
        self.terminations = self.terminations_leaf.array
        self.truncations = self.truncations_leaf.array

    def close(self) -> None:
        """Drop every view and unmap the region."""
        for part in (self.observations, self.actions):
            _unbind(part)
        self.rewards = self.terminations = self.truncations = None
        for leaf in (self.rewards_leaf, self.terminations_leaf, self.truncations_leaf):
            leaf.array = None
        self.region.close()


def _unbind(node) -> None:
    if node is None:
        return
    if isinstance(node, _DictNode):
        for child in node.children.values():
            _unbind(child)
    elif isinstance(node, _TupleNode):
        for child in node.children:
            _unbind(child)
    else:
        node.array = None

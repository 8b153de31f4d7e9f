"""Shared slabs: observations, actions, rewards and done flags in place.

A slab is one shared region mapped by one worker sandbox and the controller, holding
the rows of that worker's sub-envs only (a sandbox cannot touch another's data). Each
fixed-size leaf of a space (Box, Discrete, MultiDiscrete, MultiBinary, Text) gets an
``(rows, *shape)`` array; Dict and Tuple spaces are trees of leaves. The controller
scatters a batch of actions over the slabs of a vector env and gathers observations,
rewards and flags from them (:class:`SlabSet`): one copy per leaf and worker, the copy
a ``copy=True`` vector env returns anyway; no observation goes through a ring. Spaces
with variable-size values (Graph, Sequence, OneOf) have no slab layout: their values
travel in ring records. One layout function per space type (``slab_node``, a
``functools.singledispatch``): a custom space registers its own.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from gymnasium import spaces

from .region import Region, seal_memfd

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _ArrayLeaf:
    """A Box/Discrete/MultiDiscrete/MultiBinary leaf: one ``(n, *shape)`` array.

    ``array`` is None until :meth:`bind` (a batch layout is never bound) and after the
    slab is closed; a leaf is read and written only while bound."""

    def __init__(self, space: spaces.Space, n: int) -> None:
        if space.shape is None:
            raise TypeError(f"{space} has no fixed shape: it has no array layout")
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
        assert self.array is not None  # bound
        self.array[index] = value

    def read(self, index: int) -> Any:
        assert self.array is not None  # bound
        row = self.array[index]
        return row.copy() if self.shape else row

    def accepts(self, values: Any) -> bool:
        """True if ``values`` is already a batch of exactly this dtype and shape."""
        return (
            type(values) is np.ndarray
            and values.shape == (self.n, *self.shape)
            and values.dtype == self.dtype
        )

    def gather(self, parts: list[_ArrayLeaf], out: np.ndarray | None) -> np.ndarray:
        """The rows of ``parts`` (same-space leaves) as one batch (into ``out``)."""
        arrays = _bound(parts)
        if len(arrays) == 1 and out is None:
            return arrays[0].copy()
        return np.concatenate(arrays, out=out)

    def scatter(self, parts: list[_ArrayLeaf], values: Any, bounds: list[int]) -> None:
        """Write batch ``values`` over ``parts``: rows bounds[k]:bounds[k+1] to part k."""
        values = np.asarray(values)
        for array, start, end in zip(_bound(parts), bounds, bounds[1:], strict=False):
            np.copyto(array, values[start:end], casting="unsafe")


def _bound(parts: Sequence[_ArrayLeaf]) -> list[np.ndarray]:
    """The arrays of bound leaves (the slabs' own, never a batch layout)."""
    arrays = [p.array for p in parts if p.array is not None]
    if len(arrays) != len(parts):
        raise ValueError("a slab leaf is not mapped (its slab is closed)")
    return arrays


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
        assert self.array is not None  # bound
        self.array[index, : len(codes)] = codes
        self.array[index, len(codes) :] = pad

    def read(self, index: int) -> str:
        chars = self.space.character_list
        pad = len(self.space.character_list)
        assert self.array is not None  # bound
        return "".join(chars[c] for c in self.array[index] if c < pad)

    def batch(self) -> tuple[str, ...]:
        return tuple(self.read(i) for i in range(self.n))

    def accepts(self, values: Any) -> bool:
        return False

    def gather(self, parts: list[_TextLeaf], out: Any) -> tuple[str, ...]:
        return tuple(text for p in parts for text in p.batch())

    def scatter(self, parts: list[_TextLeaf], values: Any, bounds: list[int]) -> None:
        values = tuple(values)
        for part, start, end in zip(parts, bounds, bounds[1:], strict=False):
            for row, value in enumerate(values[start:end]):
                part.write(row, value)


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

    def gather(self, parts: list[_DictNode], out: Any) -> dict[str, Any]:
        return {
            key: child.gather([p.children[key] for p in parts], None if out is None else out[key])
            for key, child in self.children.items()
        }

    def scatter(self, parts: list[_DictNode], values: Any, bounds: list[int]) -> None:
        for key, child in self.children.items():
            child.scatter([p.children[key] for p in parts], values[key], bounds)


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

    def gather(self, parts: list[_TupleNode], out: Any) -> tuple[Any, ...]:
        return tuple(
            child.gather([p.children[k] for p in parts], None if out is None else out[k])
            for k, child in enumerate(self.children)
        )

    def scatter(self, parts: list[_TupleNode], values: Any, bounds: list[int]) -> None:
        for k, child in enumerate(self.children):
            child.scatter([p.children[k] for p in parts], values[k], bounds)


def leaf_values(node, values: Any) -> list[tuple[Any, Any]]:
    """(leaf, the part of the batch ``values`` that belongs to it) for every leaf."""
    if isinstance(node, _DictNode):
        return [pair for k, c in node.children.items() for pair in leaf_values(c, values[k])]
    if isinstance(node, _TupleNode):
        return [
            pair for c, v in zip(node.children, values, strict=True) for pair in leaf_values(c, v)
        ]
    return [(node, values)]


def leaves(node) -> list:
    """The leaves of a slab layout tree (each has ``.space`` and ``.array``)."""
    if node is None:
        return []
    if isinstance(node, _DictNode):
        return [leaf for child in node.children.values() for leaf in leaves(child)]
    if isinstance(node, _TupleNode):
        return [leaf for child in node.children for leaf in leaves(child)]
    return [node]


@functools.singledispatch
def async_shares(space: spaces.Space) -> bool:
    """True if AsyncVectorEnv(shared_memory=True) accepts ``space`` (Gymnasium 1.x rules)."""
    return False


@async_shares.register(spaces.Box)
@async_shares.register(spaces.Discrete)
@async_shares.register(spaces.MultiDiscrete)
@async_shares.register(spaces.MultiBinary)
@async_shares.register(spaces.Text)
def _(space: spaces.Space) -> bool:
    return True


@async_shares.register
def _(space: spaces.Dict) -> bool:
    return all(async_shares(s) for s in space.spaces.values())


@async_shares.register(spaces.Tuple)
@async_shares.register(spaces.OneOf)
def _(space: spaces.Tuple | spaces.OneOf) -> bool:
    return all(async_shares(s) for s in space.spaces)


@functools.singledispatch
def slab_node(space: spaces.Space, n: int):
    """The slab layout tree of ``space`` batched ``n`` times, or None if it has none.

    Register a layout for a custom space with ``@slab_node.register(MySpace)``
    returning an object with the leaf interface (see ``_ArrayLeaf``)."""
    return None


@slab_node.register(spaces.Box)
@slab_node.register(spaces.Discrete)
@slab_node.register(spaces.MultiDiscrete)
@slab_node.register(spaces.MultiBinary)
def _(space: spaces.Space, n: int):
    return _ArrayLeaf(space, n)


@slab_node.register
def _(space: spaces.Text, n: int):
    return _TextLeaf(space, n)


@slab_node.register
def _(space: spaces.Dict, n: int):
    children = {k: slab_node(s, n) for k, s in space.spaces.items()}
    return None if any(c is None for c in children.values()) else _DictNode(space, children)


@slab_node.register
def _(space: spaces.Tuple, n: int):
    items = [slab_node(s, n) for s in space.spaces]
    return None if any(c is None for c in items) else _TupleNode(space, items)


# Built once (every sandbox's slab has these columns): a space per slab cost each new
# sandbox ~100 page faults and part of its HELLO.
_REWARD_SPACE = spaces.Box(-np.inf, np.inf, (), np.float64)
_FLAG_SPACE = spaces.MultiBinary(())


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
        self.rewards_leaf = _ArrayLeaf(_REWARD_SPACE, num_envs)
        self.terminations_leaf = _ArrayLeaf(_FLAG_SPACE, num_envs)
        self.terminations_leaf.dtype = np.dtype(np.bool_)
        self.truncations_leaf = _ArrayLeaf(_FLAG_SPACE, num_envs)
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
        self.rewards, self.terminations, self.truncations = _bound(
            [self.rewards_leaf, self.terminations_leaf, self.truncations_leaf]
        )

    def copy_row(self, row: int, source: Slab, source_row: int) -> None:
        """Row ``row`` becomes ``source``'s row ``source_row``: last observation, reward
        and flags (a clone starts where its source stands)."""
        self.rewards[row] = source.rewards[source_row]
        self.terminations[row] = source.terminations[source_row]
        self.truncations[row] = source.truncations[source_row]
        if self.observations is not None:
            assert source.observations is not None  # the same spaces: the same layout
            self.observations.write(row, source.observations.read(source_row))

    def close(self) -> None:
        """Drop every view and unmap the region."""
        for part in (self.observations, self.actions):
            _unbind(part)
        # The views go so that the mapping can close: a closed slab is never read again.
        self.rewards = self.terminations = self.truncations = None  # type: ignore[assignment]
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


class SlabSet:
    """The slabs of one vector env's workers, one per worker, seen as one batch.

    Worker k hosts the sub-envs ``bounds[k]:bounds[k+1]`` (contiguous, in order) and
    maps only ``slabs[k]``. ``fds`` are memfds made with MFD_ALLOW_SEALING, sized and
    sealed here (to at least ``min_size``: a VM's slab device has a fixed size).
    Concurrency: controller thread only.
    """

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        counts: Sequence[int],
        fds: Sequence[int],
        *,
        use_observations: bool,
        min_size: int = 0,
    ) -> None:
        self.observation_space = observation_space
        self.action_space = action_space
        self.use_observations = use_observations
        self.min_size = min_size
        self.bounds = [0]
        for count in counts:
            self.bounds.append(self.bounds[-1] + count)
        self.num_envs = self.bounds[-1]
        # Unbound batch layouts: they describe a whole batch (accepts, gather, scatter).
        self.observation_layout = (
            slab_node(observation_space, self.num_envs) if use_observations else None
        )
        self.action_layout = slab_node(action_space, self.num_envs)
        self.slabs: list[Slab] = []
        try:
            for count, fd in zip(counts, fds, strict=True):
                self.slabs.append(self._slab(count, fd))
        except BaseException:
            self.close()
            raise
        self._bind_parts()

    def _bind_parts(self) -> None:
        """Cache what every step touches (the hot path: no per-step lists, no lookups):
        the columns of each slab and, for plain array leaves, their arrays and rows."""
        self._rewards = [s.rewards for s in self.slabs]
        self._terminations = [s.terminations for s in self.slabs]
        self._truncations = [s.truncations for s in self.slabs]
        self._obs_parts = [s.observations for s in self.slabs]
        self._act_parts = [s.actions for s in self.slabs]
        self._obs_arrays: list[np.ndarray] | None = None
        if type(self.observation_layout) is _ArrayLeaf:
            # The layout is a plain leaf: so is every slab's (the same spaces).
            self._obs_arrays = _bound(cast("list[_ArrayLeaf]", self._obs_parts))
        self._act_rows = None
        if type(self.action_layout) is _ArrayLeaf:
            bounds = self.bounds
            self._act_rows = [
                (p.array, bounds[k], bounds[k + 1]) for k, p in enumerate(self._act_parts)
            ]

    def _slab(self, count: int, fd: int) -> Slab:
        return Slab(
            self.observation_space,
            self.action_space,
            count,
            use_observations=self.use_observations,
            region_fd=fd,
            owner=True,
            size=self.min_size,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the largest slab (what one sandbox must be able to map)."""
        return max(s.nbytes for s in self.slabs)

    def replace(self, position: int, fd: int) -> Slab:
        """A fresh slab (on the new memfd ``fd``) for the worker at ``position``."""
        old = self.slabs[position]
        self.slabs[position] = self._slab(old.num_envs, fd)
        old.close()
        self._bind_parts()
        return self.slabs[position]

    def new_slab(self, count: int, fd: int) -> Slab:
        """A slab for ``count`` sub-envs on the memfd ``fd`` (not part of the set yet)."""
        return self._slab(count, fd)

    def where(self, index: int) -> tuple[Slab, int]:
        """The slab and row of sub-env ``index``."""
        for k, slab in enumerate(self.slabs):
            if index < self.bounds[k + 1]:
                return slab, index - self.bounds[k]
        raise IndexError(f"no sub-env {index} in {self.num_envs}")

    def accepts_actions(self, values: Any) -> bool:
        """True if ``values`` is an exact batch for the action slab (the fast path)."""
        return self.action_layout is not None and self.action_layout.accepts(values)

    def write_actions(self, values: Any) -> None:
        """Scatter a batch of actions over the workers' slabs."""
        rows = self._act_rows
        if rows is not None:  # a plain array leaf: one slice assignment per worker
            for array, start, end in rows:
                array[...] = values[start:end]
            return
        self.action_layout.scatter(self._act_parts, values, self.bounds)

    def observations(self, out: Any = None) -> Any:
        """The batch of observations (into ``out`` when given)."""
        arrays = self._obs_arrays
        if arrays is not None:  # a plain array leaf
            if len(arrays) == 1 and out is None:
                return arrays[0].copy()
            return np.concatenate(arrays, out=out)
        if self.observation_layout is None:
            raise ValueError("these observations travel in ring records, not in the slabs")
        return self.observation_layout.gather(self._obs_parts, out)

    @staticmethod
    def _column(parts: list[np.ndarray]) -> np.ndarray:
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def rewards(self) -> np.ndarray:
        """A new array of every sub-env's last reward."""
        return self._column(self._rewards)

    def terminations(self) -> np.ndarray:
        """A new array of every sub-env's last termination flag."""
        return self._column(self._terminations)

    def truncations(self) -> np.ndarray:
        """A new array of every sub-env's last truncation flag."""
        return self._column(self._truncations)

    def step_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """New arrays of the last rewards, terminations and truncations (one call)."""
        column = self._column
        return column(self._rewards), column(self._terminations), column(self._truncations)

    def close(self) -> None:
        """Unmap every slab."""
        for slab in self.slabs:
            slab.close()
        self.slabs = []
        self._bind_parts()

"""Shared slabs: observations, actions, rewards and done flags in place.

A slab is one shared region mapped by one worker sandbox and the controller, holding
the rows of that worker's sub-envs only (a sandbox cannot touch another's data). Each
fixed-size leaf of a space (Box, Discrete, MultiDiscrete, MultiBinary, Text) gets an
``(rows, *shape)`` array; Dict and Tuple spaces are trees of leaves. The controller
scatters a batch of actions over the slabs of a vector env and gathers observations,
rewards and flags from them (:class:`SlabSet`): one copy per leaf and worker, the copy
a ``copy=True`` vector env returns anyway; no observation goes through a ring. Spaces
with variable-size values (Graph, Sequence, OneOf) have no slab layout: their values
travel in ring records. The layout of each space type (``slab_node``, which a custom
space can register its own for) is ``layout.py``'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from gymnasium import spaces

from .layout import ALIGN, ArrayLeaf, align, bound_arrays, slab_node, unbind
from .region import Region, seal_memfd

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
        self.rewards_leaf = ArrayLeaf(_REWARD_SPACE, num_envs)
        self.terminations_leaf = ArrayLeaf(_FLAG_SPACE, num_envs)
        self.terminations_leaf.dtype = np.dtype(np.bool_)
        self.truncations_leaf = ArrayLeaf(_FLAG_SPACE, num_envs)
        self.truncations_leaf.dtype = np.dtype(np.bool_)
        parts = [self.rewards_leaf, self.terminations_leaf, self.truncations_leaf]
        parts += [p for p in (self.observations, self.actions) if p is not None]
        self.nbytes = max(ALIGN, sum(align(p.nbytes) for p in parts))
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
        self.rewards, self.terminations, self.truncations = bound_arrays(
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
            unbind(part)
        # The views go so that the mapping can close: a closed slab is never read again.
        self.rewards = self.terminations = self.truncations = None  # type: ignore[assignment]
        for leaf in (self.rewards_leaf, self.terminations_leaf, self.truncations_leaf):
            leaf.array = None
        self.region.close()


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
        if type(self.observation_layout) is ArrayLeaf:
            # The layout is a plain leaf: so is every slab's (the same spaces).
            self._obs_arrays = bound_arrays(cast("list[ArrayLeaf]", self._obs_parts))
        self._act_rows = None
        if type(self.action_layout) is ArrayLeaf:
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

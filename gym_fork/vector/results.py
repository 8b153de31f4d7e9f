"""How a ForkVectorEnv turns its workers' replies into Gymnasium's batched results: the
waits with their two timeouts (the caller's and the env's own), the infos merged in
sub-env order, and the observations out of the slabs (a new batch or the env's buffer,
as ``copy`` says)."""

from __future__ import annotations

import copy as copy_module
import functools
import multiprocessing
from collections.abc import Callable
from typing import Any

import numpy as np
from gymnasium import Space
from gymnasium.vector.utils import concatenate

from .config import VectorConfig
from .frontend import AsyncState
from .lifecycle import Sandboxes
from .spaces import check_ring_observations, ring_text_space
from .waits import WaitTimeout


class Results:
    """The reply side of ForkVectorEnv's calls (its sandboxes, config, observations)."""

    config: VectorConfig
    sandboxes: Sandboxes
    observations: Any
    single_observation_space: Space
    _obs_in_slab: bool
    _state: Any

    _add_info: Callable[[dict[str, Any], dict[str, Any], int], dict[str, Any]]  # VectorEnv's

    def _collect(self, timeout: float | None, op: int, what: str) -> list[Any]:
        """Every worker's result; past ``timeout`` a multiprocessing.TimeoutError (late
        replies are dropped later), past the vector env's own ``timeout`` the sandboxes
        that did not answer are killed (SubEnvTimeout)."""
        own = self.config.timeout
        own_deadline = timeout is None and own is not None
        pool = self.sandboxes.pool
        try:
            return pool.collect(op, own if own_deadline else timeout)
        except WaitTimeout:
            if own_deadline and own is not None:
                raise pool.kill_unanswered(op, what, own) from None
            raise multiprocessing.TimeoutError(
                f"The call to `{what}` has timed out after {timeout} second(s)." + pool.tree_note()
            ) from None
        finally:
            self._state = AsyncState.DEFAULT

    @functools.cached_property
    def _ring_texts(self) -> Space | None:
        """:func:`ring_text_space`'s for this vector env (its spaces never change)."""
        single, trusted = self.single_observation_space, self.config.trusted
        return ring_text_space(single, self._obs_in_slab, trusted)

    def _gather(self, replies: list[Any]) -> dict[str, Any]:
        """The infos of the workers' ``[observations, infos]`` replies to a reset or a
        step, merged in sub-env order (a worker whose sub-envs all returned empty ones
        sends None); observations that came in the replies, not the slab, are batched
        into ``self.observations``."""
        infos: dict[str, Any] = {}
        observations: list[Any] = []
        indices: list[int] = []
        for worker, (obs_list, info_list) in zip(self.sandboxes.pool.workers, replies, strict=True):
            if info_list is not None:
                for k, index in enumerate(worker.indices):
                    infos = self._add_info(infos, info_list[k], index)
            if not self._obs_in_slab:
                observations.extend(obs_list)
                indices.extend(worker.indices)
        if not self._obs_in_slab:
            check_ring_observations(self._ring_texts, observations, indices)
            self.observations = concatenate(
                self.single_observation_space, observations, self.observations
            )
        return infos

    def _observations_out(self) -> Any:
        if self._obs_in_slab:
            # Gathered from the workers' slabs: a new batch (copy=True), or into the
            # vector env's own buffer (copy=False, as AsyncVectorEnv's shared view).
            out = None if self.config.copy else self.observations
            self.observations = self.sandboxes.slab_set().observations(out=out)
            return self.observations
        if not self.config.copy:
            return self.observations
        obs = self.observations
        return obs.copy() if type(obs) is np.ndarray else copy_module.deepcopy(obs)

"""What a ForkVectorEnv reports about itself: the sub-envs' seeds and generators (one
each, as AsyncVectorEnv), the isolation its sandboxes achieved (and ``isolation="strict"``
enforcing it), its lineage, its sandboxes' pids, memory and output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gym_fork.lineage import Lineage

from . import provenance
from .config import VectorConfig
from .lifecycle import Sandboxes


class Reports:
    """ForkVectorEnv's reports (its sandboxes, config, lineage, ``get_attr``)."""

    config: VectorConfig
    sandboxes: Sandboxes
    num_envs: int
    _lineage: Lineage | None

    get_attr: Callable[[str], tuple[Any, ...]]  # ForkVectorEnv's
    _teardown: Callable[..., None]  # ForkVectorEnv's

    # AsyncVectorEnv's contract, kept: one seed and one generator per sub-env, read-only
    # (VectorEnv declares a single one, its generator settable).
    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """Returns a tuple of np_random seeds for all the wrapped envs."""
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        """Returns the tuple of the numpy random number generators for the wrapped envs."""
        return self.get_attr("np_random")

    def _enforce_isolation(self, isolation: dict[str, Any]) -> None:
        """``isolation="strict"``: close and raise if a layer is missing."""
        try:
            provenance.enforce_isolation(self.config, isolation)
        except BaseException:
            self._teardown(terminate=True)
            raise

    @property
    def isolation(self) -> dict[str, Any]:
        """The isolation this vector env's sandboxes actually achieved (as they reported)."""
        return self.sandboxes.isolation() if self.sandboxes is not None else {}

    @property
    def lineage(self) -> Lineage:
        """Provenance of this vector env: branch id, parent, baseline id, events."""
        assert self._lineage is not None  # recorded when the env opened
        return self._lineage

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker sandboxes, in sub-env order of their first index."""
        return [w.pid for w in self.sandboxes.pool.workers] if self.sandboxes else []

    def stats(self) -> list[dict[str, Any]]:
        """Per sub-env: its sandbox's pid, RSS and PSS (bytes) and GPU memory (bytes, from
        NVML; None without a GPU or when the sandbox holds no CUDA context)."""
        return provenance.sandbox_stats(self.sandboxes.pool.workers)

    def sandbox_output(self, index: int, stream: str = "stderr") -> str:
        """The last output (at most 64 KiB) of the sandbox hosting sub-env ``index``."""
        for worker in self.sandboxes.pool.workers:
            if index in worker.indices:
                return worker.output_tail(stream)
        raise IndexError(f"no sub-env {index} in a vector env of {self.num_envs}")

"""``envs_per_worker="auto"`` that learns: split grouped sub-envs once steps prove slow.

With as many sub-envs as cores, "auto" starts them grouped (the controller needs a core
of its own while it waits: two CartPoles in one worker step in 23 us, in two workers on
2 cores in 38 us, SyncVectorEnv in 22 us). Whether grouping pays depends on the step's
cost, which nobody knows before the first steps: a 100 us step x2 takes 251 us grouped
and 143 us split. So the vector env times its steps from the 8th to the 40th and, if
their median is above ``GYM_FORK_SPLIT_STEP_US`` (100 us), forks every grouped worker
into one sandbox per sub-env (gym_fork/vector/lifecycle.py ``split_workers``; each clone
continues its sub-env exactly), once. The timing costs two clock reads per step while
it lasts, nothing after.
"""

from __future__ import annotations

import os
import statistics
import time

FIRST_TIMED_STEP = 8
DECIDING_STEP = 40


def slow_step_seconds() -> float:
    """A median vector step above this means the sub-envs are worth a core each."""
    return float(os.environ.get("GYM_FORK_SPLIT_STEP_US", "100")) * 1e-6


class SplitProbe:
    """Times the first vector steps and says, once, whether to split."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._steps = 0
        self._samples: list[float] = []
        self._sent = 0.0

    def step_sent(self) -> None:
        self._sent = time.perf_counter()

    def step_done(self) -> bool:
        """Count a completed step; True once, when the steps so far call for a split."""
        elapsed = time.perf_counter() - self._sent
        self._steps += 1
        if self._steps >= FIRST_TIMED_STEP:
            self._samples.append(elapsed)
        if self._steps < DECIDING_STEP:
            return False
        self.active = False
        return statistics.median(self._samples) > slow_step_seconds()

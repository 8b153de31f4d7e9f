"""``envs_per_worker="auto"`` that learns: split grouped sub-envs once steps prove slow.

On a 2-core machine with 2 sub-envs, "auto" starts them grouped in one worker (the
controller needs a core of its own while it waits: two CartPoles in one worker step in
23 us, in two workers in 38 us, SyncVectorEnv in 22 us). Whether grouping pays depends on
the step's cost, which nobody knows before the first steps: a 100 us step x2 takes
251 us grouped and 133 us split. So the vector env times its steps (only those waited
for at once: a caller that works between ``step_async`` and ``step_wait`` would make any
step look slow) and, once 32 are timed, if their median is above
``GYM_FORK_SPLIT_STEP_US`` (100 us), forks every grouped worker into one sandbox per
sub-env (gym_fork/vector/lifecycle.py ``split_workers``; each clone continues its sub-env
exactly), once. Measured on 2 cores only, so only 2-core machines group
(``config.auto_envs_per_worker``). The timing costs three clock reads per step while it
lasts (at most 400 steps), nothing after.
"""

from __future__ import annotations

import os
import statistics
import time

FIRST_TIMED_STEP = 8  # the first steps pay for page faults and caches
SAMPLES = 32
GIVE_UP_STEP = 400  # a caller that never waits at once: stay grouped
SYNCHRONOUS_GAP_S = 50e-6  # step_wait this soon after step_async: a plain step()


def slow_step_seconds() -> float:
    """A median vector step above this means the sub-envs are worth a core each."""
    return float(os.environ.get("GYM_FORK_SPLIT_STEP_US", "100")) * 1e-6


class SplitProbe:
    """Times the first vector steps and says, once, whether to split."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self._steps = 0
        self._samples: list[float] = []
        self._sending = self._sent = self._waiting = 0.0

    def step_sending(self) -> None:
        """At the start of step_async."""
        self._sending = time.perf_counter()

    def step_sent(self) -> None:
        """At the end of step_async."""
        self._sent = time.perf_counter()

    def step_waiting(self) -> None:
        """At the start of step_wait."""
        self._waiting = time.perf_counter()

    def step_done(self) -> bool:
        """Count a completed step; True once, when the timed steps call for a split."""
        self._steps += 1
        synchronous = self._waiting - self._sent <= SYNCHRONOUS_GAP_S
        if self._steps >= FIRST_TIMED_STEP and synchronous:
            self._samples.append(time.perf_counter() - self._sending)
        if len(self._samples) >= SAMPLES:
            self.active = False
            return statistics.median(self._samples) > slow_step_seconds()
        if self._steps >= GIVE_UP_STEP:
            self.active = False
        return False

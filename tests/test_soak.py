"""Soak: many create/fork/step/close cycles leave nothing behind (docs/reliability.md).

By default the loop runs for a time budget (GYM_FORK_SOAK_SECONDS, 15 s) with at least
MIN_CYCLES cycles, so a machine three times slower still finishes well inside pytest's
timeout; GYM_FORK_SOAK_CYCLES=1000 runs an exact count instead (the figure in
docs/reliability.md).
"""

from __future__ import annotations

import gc
import os
import resource
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from tests.helpers import descendants, gym_fork_scratch_dirs, gym_fork_shm_files, open_fds

CYCLES = int(os.environ["GYM_FORK_SOAK_CYCLES"]) if "GYM_FORK_SOAK_CYCLES" in os.environ else None
SECONDS = float(os.environ.get("GYM_FORK_SOAK_SECONDS", "15"))
MIN_CYCLES = 20


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cycle(i: int) -> None:
    envs = ForkVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 2, envs_per_worker=1, lineage_log=False
    )
    try:
        envs.reset(seed=i)
        branch = envs.fork(f"soak-{i}", indices=[i % 2], copies=2)
        try:
            branch.step(np.array([0, 1]))
            envs.step(np.array([1, 0]))
        finally:
            branch.close()
    finally:
        envs.close()


@pytest.mark.slow
@pytest.mark.timeout(0 if CYCLES else 300)
def test_soak_create_fork_step_close_cycles():
    for i in range(5):  # warm caches and lazy imports before the baseline
        cycle(i)
    gc.collect()
    procs, fds, shm, scratch = (
        descendants(),
        open_fds(),
        gym_fork_shm_files(),
        gym_fork_scratch_dirs(),
    )
    rss = rss_mb()
    start = time.monotonic()
    cycles = 0
    while (
        (cycles < CYCLES) if CYCLES else (cycles < MIN_CYCLES or time.monotonic() - start < SECONDS)
    ):
        cycle(cycles)
        cycles += 1
    elapsed = time.monotonic() - start
    gc.collect()
    time.sleep(0.5)
    growth = rss_mb() - rss
    print(
        f"\nsoak: {cycles} cycles in {elapsed:.1f} s ({elapsed / cycles * 1000:.0f} ms each), "
        f"controller RSS growth {growth:.1f} MB, peak RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
    )
    assert descendants() <= procs
    assert open_fds() <= fds
    assert gym_fork_shm_files() <= shm
    assert gym_fork_scratch_dirs() <= scratch
    assert growth < 20, f"controller RSS grew {growth:.1f} MB"

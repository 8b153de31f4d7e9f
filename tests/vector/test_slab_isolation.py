"""A sandbox reaches only its own sub-envs' rows: scribbling every slab it holds, or
resizing it, changes nothing another sub-env returns (hardening issue)."""

from __future__ import annotations

import errno
import mmap
import os
import time

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import SyncVectorEnv

from gym_fork import ForkVectorEnv
from tests.helpers import SpaceEnv


class ScribblerEnv(SpaceEnv):
    """When marked, waits for its siblings to write their results, then overwrites every
    gym_fork slab it can reach with 0xff and tries to shrink them."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (3,)), spaces.Discrete(3), max_len=50, trunc_prob=0)
        self.report = None

    def step(self, action):
        if self.marker == "scribble":
            time.sleep(0.3)
            self.report = scribble_every_slab()
        return super().step(action)

    def last_report(self):
        return self.report


def scribble_every_slab():
    inodes, sizes, refused = set(), [], []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if "gym_fork-slab" not in target:
            continue
        fd = int(name)
        info = os.fstat(fd)
        if info.st_ino in inodes:  # the same memfd again (mmap keeps a dup of its fd)
            continue
        size = info.st_size
        with mmap.mmap(fd, size) as view:
            view[:] = b"\xff" * size
        for new_size in (0, size * 4):
            try:
                os.ftruncate(fd, new_size)
            except OSError as exc:
                refused.append(exc.errno)
        inodes.add(info.st_ino)
        sizes.append(size)
    return {"slabs": len(inodes), "sizes": sizes, "refused": refused}


@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_a_scribbling_sandbox_cannot_change_what_other_sub_envs_return(envs_per_worker):
    fns = [ScribblerEnv for _ in range(4)]
    fork = ForkVectorEnv(fns, envs_per_worker=envs_per_worker)
    sync = SyncVectorEnv(fns)
    try:
        a, b = fork.reset(seed=3), sync.reset(seed=3)
        assert data_equivalence(a, b)
        fork.set_attr("marker", ["scribble", "initial", "initial", "initial"])
        actions = np.array([0, 1, 2, 1])
        obs_f, rew_f, term_f, trunc_f, _ = fork.step(actions)
        obs_s, rew_s, term_s, trunc_s, _ = sync.step(actions)
        victims = slice(envs_per_worker, None)  # the sub-envs outside the scribbler's sandbox
        assert np.array_equal(obs_f[victims], obs_s[victims])
        assert np.array_equal(rew_f[victims], rew_s[victims])
        assert np.array_equal(term_f[victims], term_s[victims])
        assert np.array_equal(trunc_f[victims], trunc_s[victims])
        report = fork.call("last_report")[0]
        assert report["slabs"] == 1, report  # its own slab only
        assert set(report["refused"]) == {errno.EPERM}  # sealed: no shrink, no grow
        # The vector env goes on; the next step of every sub-env is right again.
        fork.set_attr("marker", "initial")
        a, b = fork.step(actions), sync.step(actions)
        assert data_equivalence(a[:4], b[:4])
    finally:
        fork.close()
        sync.close()

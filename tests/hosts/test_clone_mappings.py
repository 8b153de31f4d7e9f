"""A clone maps and holds only its own channel and slab: its source's are not inherited
(MADV_DONTFORK in the source) and their fds are closed before env code runs, so env
code in a branch can neither read nor write the rings and slab of its source."""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv


class Mappings(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}

    def shared_memory(self):
        """Inodes of the memfds this process maps, and of those it holds an fd of."""
        mapped = set()
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/memfd:"):
                    mapped.add(int(parts[4]))
        held = set()
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                    held.add(os.stat(f"/proc/self/fd/{name}").st_ino)
            except OSError:
                continue
        return sorted(mapped), sorted(held)

    def sources_not_mapped(self):
        """How many sources' channel and slab this process never mapped (a clone)."""
        from gym_fork.hosts.process import sandbox

        return len(sandbox._NOT_MAPPED_HERE)


@pytest.mark.parametrize("copies", [1, 3])
def test_a_clone_maps_and_holds_none_of_its_sources_channel_and_slab(copies):
    envs = ForkVectorEnv([Mappings, Mappings], envs_per_worker=2, lineage_log=False)
    try:
        envs.reset(seed=0)
        source_mapped, source_held = envs.call("shared_memory")[0]
        assert len(source_mapped) >= 2  # its channel and its slab
        branch = envs.fork("b", indices=[1], copies=copies)
        try:
            branch.step(np.zeros(copies, dtype=np.int64))
            assert (
                list(branch.call("sources_not_mapped")) == [1] * copies
            )  # not unmapped: never mapped
            seen = branch.call("shared_memory")
            for mapped, held in seen:
                assert len(mapped) >= 2  # its own
                assert not set(mapped) & set(source_mapped + source_held)
                assert not set(held) & set(source_mapped + source_held)
            deeper = branch.fork("c", indices=[0])  # a clone's own are kept from its forks
            try:
                mapped, held = deeper.call("shared_memory")[0]
                assert not set(mapped + held) & set(seen[0][0] + seen[0][1])
            finally:
                deeper.close()
            assert envs.step(np.zeros(2, dtype=np.int64))[0].shape == (2, 2)  # the source goes on
        finally:
            branch.close()
    finally:
        envs.close()

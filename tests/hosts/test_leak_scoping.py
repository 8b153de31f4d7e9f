"""The leak checks can run beside other pytest-xdist workers because every scratch dir and
cgroup of a tree carries the id of a tree this process recorded starting (issue 33)."""

from __future__ import annotations

import os

import gymnasium as gym

from gym_fork import ForkVectorEnv
from gym_fork.hosts.process.host import TREES_STARTED
from gym_fork.system.cgroups import leftover_groups
from gym_fork.system.isolation import SandboxLimits
from gym_fork.system.scratch import base_dir


def _scratch() -> set[str]:
    return {n for n in os.listdir(base_dir()) if n.startswith("gym_fork-scratch-")}


def test_a_trees_scratch_dirs_and_cgroups_carry_an_id_this_process_recorded() -> None:
    scratch_before, groups_before = _scratch(), leftover_groups()
    envs = ForkVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 2,
        limits=SandboxLimits(memory_bytes=512 << 20, processes=64),
        namespaces=False,  # no private /tmp mount: each sandbox gets a scratch dir,
    )
    try:
        envs.reset(seed=0)
        # Other xdist workers make scratch dirs meanwhile: this env's are named by its pids.
        ours = [n.removeprefix("gym_fork-scratch-").split("-") for n in _scratch() - scratch_before]
        ours = [parts for parts in ours if int(parts[1]) in envs.worker_pids]
        assert len(ours) == 2, "without namespaces each sandbox has a scratch dir while it runs"
        ids = {int(parts[0]) for parts in ours}
        assert ids <= TREES_STARTED, (ids, TREES_STARTED)
        new_groups = {os.path.basename(g) for g in leftover_groups() - groups_before}
        if new_groups:  # where cgroups are writable here: the tree's group carries its id
            assert {f"gym_fork-{tree}" for tree in ids} <= new_groups, (ids, new_groups)
    finally:
        envs.close()

"""A branch owns its memory (issue 30, item 5). Each clone gets memory and pids cgroups
of its own, made by the controller before the clone runs env code or copies its
source's /tmp: what a branch writes (tmpfs pages, in no process's RSS) gets the branch
OOM-killed, never its source. A fork of an env whose state lives in shared memory
(which a fork does not copy) is reported, warned about, or refused."""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest

from gym_fork import ForkVectorEnv, SandboxLimits
from gym_fork.errors import SubEnvCrashed
from gym_fork.gpu import ForkUnsafeError
from gym_fork.system import cgroups
from tests.helpers import wait_until
from tests.hosts.memory_envs import AnonymousSharedEnv, CounterEnv, MemfdEnv, RawArrayEnv

MEMORY = 200 << 20
PROCESSES = 64


def _group(pid: int, controller: str) -> str:
    """The directory of ``pid``'s group under ``controller``, read on the trusted side."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            if controller in names.split(",") or (names == "" and cgroups._v2()):
                return f"{cgroups.controller_root(controller)}{path}"
    raise AssertionError(f"process {pid} is in no {controller} group")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@pytest.mark.skipif(
    cgroups.controller_root("memory") is None or cgroups.controller_root("pids") is None,
    reason="needs writable memory and pids cgroup controllers",
)
def test_a_branch_that_fills_its_tmp_is_oom_killed_alone_in_its_own_cgroups():
    envs = ForkVectorEnv(
        [CounterEnv],
        limits=SandboxLimits(memory_bytes=MEMORY, processes=PROCESSES),
        tmpfs_bytes=1 << 30,  # the branch's /tmp layer is not what stops it: its memory is
        lineage_log=False,
    )
    reference = CounterEnv()
    try:
        obs, _ = envs.reset(seed=0)
        assert np.array_equal(obs[0], reference.reset(seed=0)[0])
        # The source is the larger process: sharing its groups, the branch's /tmp got
        # the source picked by the OOM killer.
        envs.call("hold", 64 << 20)
        source = envs.sandboxes.pool.workers[0].pid
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            branch = envs.fork("b")
        assert not [w for w in caught if "shares memory" in str(w.message)]  # a plain env
        report = branch.isolation
        assert "shared_with_source" not in report["missing"], report["missing"]
        assert "cgroups" not in report["missing"], report["missing"]
        assert report["limits"]["cgroups"]["memory_bytes"] == MEMORY
        clone = branch.sandboxes.pool.workers[0].pid
        groups = [_group(clone, "memory"), _group(clone, "pids")]
        for group, controller in zip(groups, ("memory", "pids"), strict=True):
            assert group != _group(source, controller)
            assert os.path.basename(group).startswith(cgroups.CLONE_PREFIX), group
        memory_knob = "memory.max" if cgroups._v2() else "memory.limit_in_bytes"
        assert int(_read(f"{groups[0]}/{memory_knob}")) == MEMORY
        assert _read(f"{groups[1]}/pids.max") == str(PROCESSES)

        branch.call("drop")
        with pytest.raises(SubEnvCrashed):
            branch.call("fill_tmp", 2 * MEMORY)
        for action in (1, 0, 2, 1):  # the source goes on, on its exact trajectory
            obs, *_ = envs.step(np.array([action]))
            assert np.array_equal(obs[0], reference.step(action)[0])
        branch.close()
        # A plain env forks under "refuse"; the dead branch is let go at the tree's next
        # fork (the root is open), and its groups with it.
        second = envs.fork("c", shared_memory="refuse")
        second.close()
        assert wait_until(lambda: not any(os.path.exists(g) for g in groups)), groups
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("env_class", "mapping"),
    [
        (AnonymousSharedEnv, "/dev/zero (deleted)"),
        (RawArrayEnv, "/dev/shm/pym-"),
        (MemfdEnv, "/memfd:counter (deleted)"),  # never mapped: shared through its fd
    ],
)
def test_a_fork_of_shared_memory_is_reported_warned_about_and_refusable(env_class, mapping):
    envs = ForkVectorEnv([env_class], lineage_log=False)
    try:
        envs.reset(seed=0)
        with pytest.warns(UserWarning, match="shares memory with its source") as warned:
            branch = envs.fork("b")
        assert any(mapping in str(w.message) for w in warned)
        try:
            assert mapping in branch.isolation["missing"]["shared_with_source"]
            branch.step(np.array([0]))
            assert envs.call("count") == (1,)  # what the report says: the write reached it
        finally:
            branch.close()
        forks = envs.call("forks_seen")
        with pytest.raises(ForkUnsafeError, match=re.escape(mapping)) as refused:
            envs.fork("r", shared_memory="refuse")
        assert env_class.__name__ in str(refused.value)
        assert "shared_memory='warn'" in str(refused.value)
        assert envs.call("forks_seen") == forks  # refused before any clone was forked
        obs, *_ = envs.step(np.array([0]))  # the source serves on
        assert obs[0][0] == 2
        with pytest.raises(ValueError, match="shared_memory"):
            envs.fork("x", shared_memory="ignore")
    finally:
        envs.close()

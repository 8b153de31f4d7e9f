"""A deep fork chain meets the kernel's nesting limits: the branch that loses a layer
its source had says so, once."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv, GymForkError
from gym_fork.system.landlock import landlock_abi
from gym_fork.vector import provenance
from tests.helpers import SpaceEnv


def make_env():
    return SpaceEnv(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=1000, trunc_prob=0)


@pytest.mark.skipif(landlock_abi() < 6, reason="needs Landlock ABI >= 6 (Linux 6.12)")
def test_the_branch_past_landlocks_16_levels_warns_once_and_names_the_layer(monkeypatch):
    monkeypatch.setattr(provenance, "_WARNED_MISSING", set())
    env = ForkVectorEnv.from_parent(make_env, 1, lineage_log=False)
    env.reset(seed=0)
    lost_at, messages = None, []
    try:
        for level in range(20):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                branch = env.fork(f"level-{level}")
            messages += [str(w.message) for w in caught if "runs without" in str(w.message)]
            branch.step(np.zeros(1, dtype=np.int64))
            env.close()
            env = branch
            if lost_at is None and "landlock" in env.isolation.get("missing", {}):
                lost_at = level
    finally:
        env.close()
    assert lost_at is not None and lost_at < 20
    assert len(messages) == 1, messages  # once, at the branch that lost it
    assert f"level-{lost_at}" in messages[0] and "landlock" in messages[0]


class DiesWhenForked(SpaceEnv):
    """Exits inside its sandbox the moment it is forked, once told to."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=1000)
        self.armed = False
        os.register_at_fork(before=lambda: self.armed and os._exit(7))


def test_a_source_that_dies_while_the_others_fork_loses_nothing_of_theirs():
    envs = ForkVectorEnv([DiesWhenForked] * 3, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.set_attr("armed", [False, True, False])
        with pytest.raises(GymForkError, match=r"sub-env\(s\) \[1\].*died during fork"):
            envs.fork("half", indices=[0, 1, 2], copies=2)
        # The living sources answered and their clones were released; their side
        # sockets hold nothing stale, so they fork again.
        branch = envs.fork("again", indices=[0, 2], copies=2)
        assert branch.num_envs == 4
        branch.step(np.zeros(4, dtype=np.int64))
        branch.close()
    finally:
        envs.close()

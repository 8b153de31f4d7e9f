"""A workspace the warm parent wrote into its /tmp is every sandbox's shared lower layer:
a fork does not copy it, and a sandbox's write to one of its files is that sandbox's alone
(docs/branching.md, benchmarks/agent_workspace.py)."""

from __future__ import annotations

import os
import tempfile

from gymnasium import spaces

from gym_fork import ForkVectorEnv
from tests.helpers import SpaceEnv

NAME = "gym_fork-test-parent-workspace"


class FileEnv(SpaceEnv):
    """Step 1 appends "a" to the warm parent's file; an info reads the file back."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (1,)), spaces.Discrete(3), max_len=100, trunc_prob=0)
        self.path = os.path.join(tempfile.gettempdir(), NAME, "notes.txt")

    def step(self, action):
        if int(action) == 1:
            with open(self.path, "a") as f:
                f.write(f"-{os.getpid()}")
        obs, reward, term, trunc, info = super().step(action)
        with open(self.path) as f:
            return obs, reward, term, trunc, {**info, "text": f.read()}


def write_workspace(env) -> None:
    folder = os.path.join(tempfile.gettempdir(), NAME)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "notes.txt"), "w") as f:
        f.write("parent")


def test_a_write_to_the_warm_parents_file_stays_in_the_sandbox_that_made_it():
    envs = ForkVectorEnv.from_parent(FileEnv, 2, warmup=write_workspace, seed=0)
    try:
        if not envs.isolation.get("private_tmp"):
            # Without a private /tmp the file is the host's: nothing of this holds.
            assert envs.isolation["missing"].get("private_tmp")
            return
        envs.reset(seed=0)
        _o, _r, _t, _u, infos = envs.step([1, 0])
        first, second = infos["text"]
        assert first.startswith("parent-") and second == "parent"
        branch = envs.fork("writes-its-own", indices=[0], copies=2)
        try:
            _o, _r, _t, _u, binfos = branch.step([1, 0])
            assert binfos["text"][0].startswith(first + "-") and binfos["text"][1] == first
            _o, _r, _t, _u, infos = envs.step([0, 0])
            assert list(infos["text"]) == [first, "parent"]  # the branch's write is its own
        finally:
            branch.close()
    finally:
        envs.close()
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), NAME))  # the host's /tmp

"""Text envs, as tool-using agent envs are: ``Text`` observation and action spaces, str
infos, texts up to the spaces' bounds, and branches of a workspace (issue 32)."""

from __future__ import annotations

import importlib.util
import string
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import SyncVectorEnv

from gym_fork import ForkVectorEnv

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_workspace.py"
_spec = importlib.util.spec_from_file_location("agent_workspace", EXAMPLE)
assert _spec and _spec.loader
workspace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(workspace)

COMMANDS = [
    ("write notes.txt hello", "ls"),
    ("cat notes.txt", "write todo.txt fork"),
    ("append notes.txt x", "cat todo.txt"),
    ("rm notes.txt", "rm nothing.txt"),
    ("ls", "bogus"),
]


class EchoEnv(gym.Env):
    """Observes its action repeated to ``length`` characters; the info holds a long str."""

    observation_space = spaces.Text(4096, min_length=0, charset=string.ascii_lowercase)
    action_space = spaces.Text(64, min_length=1, charset=string.ascii_lowercase)

    def __init__(self, info_bytes: int = 0) -> None:
        self.info_bytes = info_bytes

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "", {}

    def step(self, action):
        text = (str(action) * 4096)[:4096]
        return text, 0.0, False, False, {"note": "n" * self.info_bytes}


def test_the_example_workspace_env_passes_gymnasiums_env_checker() -> None:
    env = workspace.WorkspaceEnv()
    check_env(env, skip_render_check=True)
    env.close()


def test_text_actions_observations_and_str_infos_match_sync_vector_env() -> None:
    fork = ForkVectorEnv([workspace.WorkspaceEnv] * 2)
    sync = SyncVectorEnv([workspace.WorkspaceEnv] * 2)
    try:
        assert fork.observation_space == sync.observation_space
        assert fork.action_space == sync.action_space
        assert fork.reset(seed=0)[0] == sync.reset(seed=0)[0]
        for actions in COMMANDS:
            got, want = fork.step(actions), sync.step(actions)
            assert got[0] == want[0], actions
            assert isinstance(got[0], tuple) and all(isinstance(o, str) for o in got[0])
            np.testing.assert_array_equal(got[1], want[1])
            assert list(got[4]["tool"]) == list(want[4]["tool"])
            np.testing.assert_array_equal(got[4]["files"], want[4]["files"])
    finally:
        fork.close()
        sync.close()


def test_texts_at_the_spaces_bounds_and_a_long_str_info_cross_whole() -> None:
    envs = ForkVectorEnv([lambda: EchoEnv(info_bytes=256 << 10)] * 2, check_actions=True)
    try:
        envs.reset(seed=0)
        longest = "abcdefgh" * 8  # the action space's max_length, 64
        obs, _, _, _, info = envs.step((longest, "z"))
        assert obs[0] == (longest * 64)[:4096] and len(obs[0]) == 4096
        assert obs[1] == "z" * 4096
        assert info["note"][0] == "n" * (256 << 10)
        with pytest.raises(Exception, match="action") as caught:
            envs.step(("a" * 65, "z"))  # one past max_length
        assert "64" in str(caught.value) or "Text" in str(caught.value)
    finally:
        envs.close()


def test_a_branch_owns_its_workspace_files_and_the_source_keeps_its_own() -> None:
    envs = ForkVectorEnv([workspace.WorkspaceEnv])
    try:
        envs.reset(seed=0)
        envs.step(("write notes.txt hello",))
        branch = envs.fork("try-edits", copies=3)
        try:
            obs, *_ = branch.step(("rm notes.txt", "write notes.txt other", "cat notes.txt"))
            assert obs[2] == "hello"  # the clone has the file as it was at the fork
            obs, *_ = branch.step(("cat notes.txt", "cat notes.txt", "ls"))
            assert obs[0].startswith("error:") and obs[1] == "other"
            assert obs[2] == "notes.txt"
        finally:
            branch.close()
        obs, *_ = envs.step(("cat notes.txt",))
        assert obs[0] == "hello"  # no branch's write reached the source
    finally:
        envs.close()


def test_the_example_search_branches_live_workspaces_to_both_targets() -> None:
    total, commands = workspace.search(depth=2, width=2)
    assert total == 2.0
    assert set(commands) == {"write notes.txt hello", "write todo.txt fork"}

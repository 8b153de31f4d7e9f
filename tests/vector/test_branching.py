"""fork(), from_parent(), reset by clone, provenance: the branching contract."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import os
import sys
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv
from gym_fork.lineage import read_log, render_tree
from tests.helpers import SpaceEnv

ROOT = Path(__file__).resolve().parent.parent.parent
# The example is a script; importable here (and in the sandboxes, which get our sys.path).
sys.path.insert(0, str(ROOT / "examples"))
import beam_search  # noqa: E402

CStateWalk = beam_search.CStateWalk


def frozen_lake():
    return gym.make("FrozenLake-v1", is_slippery=True)


def cartpole():
    return gym.make("CartPole-v1")


def pong():
    import ale_py

    gym.register_envs(ale_py)
    return gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.25)


def have_ale() -> bool:
    return importlib.util.find_spec("ale_py") is not None


class PythonRandomWalk(gym.Env):
    """Draws from Python's global ``random`` module (many text and agent envs do)."""

    observation_space = spaces.Box(-1e9, 1e9, (1,), np.float64)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.x = 0.0
        return np.array([self.x]), {}

    def step(self, action):
        import random

        self.x += random.random() - 0.5 + int(action)
        return np.array([self.x]), random.random(), False, False, {}


REPLAY_ENVS = {
    "python-random": (PythonRandomWalk, 2, 20),
    "frozenlake-slippery": (frozen_lake, 4, 40),
    "cartpole": (cartpole, 2, 40),
    "cstate-walk": (CStateWalk, 3, 30),
    "ale-pong": (pong, 6, 25),
}


def steps_of(envs, actions):
    out = envs.step(actions)
    return [np.array(x) for x in out[:4]]


def test_a_branch_draws_what_its_source_draws_from_the_random_module():
    """CPython reseeds ``random`` in every forked child; a clone has its source's state
    back (and a reseeded one its own draws)."""
    envs = ForkVectorEnv([PythonRandomWalk], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.step(np.array([1]))
        same = envs.fork("same", copies=2)
        reseeded = envs.fork("reseeded", copies=2, reseed=5)
        try:
            for _ in range(5):
                src = steps_of(envs, np.array([0]))
                br = steps_of(same, np.array([0, 0]))
                rs = steps_of(reseeded, np.array([0, 0]))
                assert all(
                    np.array_equal(s[0], b[k]) for s, b in zip(src, br, strict=True) for k in (0, 1)
                )
            assert not np.array_equal(rs[1][0], rs[1][1])  # seeds 5 and 6: their own draws
            assert not np.array_equal(src[1][0], rs[1][0])
        finally:
            same.close()
            reseeded.close()
    finally:
        envs.close()


@pytest.mark.slow  # 2.2 s here
@pytest.mark.parametrize("name", list(REPLAY_ENVS))
def test_a_branch_replays_its_source_exactly_and_diverges_when_reseeded(name):
    make, n_actions, steps = REPLAY_ENVS[name]
    if name == "ale-pong" and not have_ale():
        pytest.skip("ale-py is not installed (pip install ale-py)")
    if name in ("cstate-walk", "ale-pong"):  # cannot clone itself
        with pytest.raises((TypeError, ValueError, AttributeError, RuntimeError)):
            probe = make()
            probe.reset(seed=0)
            copy.deepcopy(probe).step(0)
            if name == "ale-pong":  # deepcopy "works" but restarts the emulator
                a, b = make(), make()
                a.reset(seed=0)
                for _ in range(30):
                    a.step(2)
                c = copy.deepcopy(a)
                if not np.array_equal(a.step(0)[0], c.step(0)[0]):
                    raise RuntimeError("deepcopy lost the emulator state")
    envs = ForkVectorEnv([make, make], envs_per_worker=1, lineage_log=False)
    rng = np.random.default_rng(0)
    branches = []
    try:
        envs.reset(seed=7)
        for _ in range(10):
            envs.step(rng.integers(0, n_actions, 2))
        same = envs.fork(f"{name}-same", indices=[1], copies=2)
        branches.append(same)
        reseeded = envs.fork(f"{name}-reseeded", indices=[1], copies=2, reseed=1234)
        branches.append(reseeded)
        diverged = False
        for _ in range(steps):
            a = int(rng.integers(0, n_actions))
            src = steps_of(envs, np.array([0, a]))
            br = steps_of(same, np.array([a, a]))
            rs = steps_of(reseeded, np.array([a, a]))
            for k in range(2):
                assert all(np.array_equal(s[1], b[k]) for s, b in zip(src, br, strict=True))
            diverged |= not all(np.array_equal(s[1], r[0]) for s, r in zip(src, rs, strict=True))
        # CartPole's dynamics are deterministic; ALE draws sticky actions from its own C
        # RNG, which only a reset reseeds. The others draw from np_random.
        if name not in ("cartpole", "ale-pong"):
            assert diverged, "reseeded clones should leave the source's trajectory"
    finally:
        for b in branches:
            b.close()
        envs.close()


def test_branch_memory_and_tmp_files_are_private():
    envs = ForkVectorEnv(
        [lambda: SpaceEnv(spaces.Discrete(5)) for _ in range(2)],
        envs_per_worker=1,
        lineage_log=False,
        private_tmp=True,
    )
    branches = []
    name = f"gym_fork-test-{os.getpid()}.txt"
    try:
        envs.reset(seed=0)
        envs.call("write_scratch", name, "from the source")
        a = envs.fork("a", indices=[0])
        b = envs.fork("b", indices=[0])
        branches += [a, b]
        a.set_attr("marker", "written in a")
        a.call("write_scratch", name, "from a")
        assert b.get_attr("marker") == ("initial",)
        assert envs.get_attr("marker") == ("initial", "initial")
        # A clone starts with a copy of its source's temp files, then diverges.
        assert a.call("read_scratch", name) == ("from a",)
        assert b.call("read_scratch", name) == ("from the source",)
        assert envs.call("read_scratch", name)[0] == "from the source"
        host_tmp = os.path.join(tempfile.gettempdir(), name)
        assert not os.path.exists(host_tmp)
    finally:
        for branch in branches:
            branch.close()
        envs.close()


def test_branches_outlive_their_source_and_close_in_any_order():
    envs = ForkVectorEnv([cartpole] * 3, envs_per_worker=3, lineage_log=False)
    envs.reset(seed=1)
    envs.step(np.array([0, 1, 0]))
    b1 = envs.fork("b1", indices=[2], copies=2)
    b2 = b1.fork("b2")
    expected = envs.step(np.array([1, 1, 1]))[0][2]
    envs.close()
    try:
        assert np.array_equal(b1.step(np.array([1, 1]))[0][0], expected)
        assert np.array_equal(b2.step(np.array([1, 1]))[0][1], expected)
        b1.close()
        b2.step(np.array([0, 0]))
    finally:
        b1.close()
        b2.close()


@pytest.mark.slow  # 1.3 s here
def test_nested_forks_to_depth_five_and_a_fan_out_of_64():
    envs = ForkVectorEnv([cartpole], lineage_log=False)
    chain = [envs]
    try:
        envs.reset(seed=3)
        for depth in range(5):
            chain[-1].step(np.array([depth % 2] * chain[-1].num_envs))
            chain.append(chain[-1].fork(f"depth-{depth + 1}", indices=[0]))
        assert chain[-1].lineage.ancestors() == [
            "depth-4",
            "depth-3",
            "depth-2",
            "depth-1",
            envs.lineage.branch_id,
        ]
        fan = chain[-1].fork("fan", indices=[0], copies=64)
        assert fan.num_envs == 64 and len(set(fan.worker_pids)) == 64
        obs, *_ = fan.step(np.zeros(64, dtype=np.int64))
        assert np.all(obs == obs[0])
        fan.close()
    finally:
        for e in reversed(chain):
            e.close()


def test_duplicate_branch_ids_and_bad_arguments_are_errors():
    envs = ForkVectorEnv([cartpole] * 2, lineage_log=False)
    try:
        envs.reset(seed=0)
        b = envs.fork("x")
        with pytest.raises(ValueError, match="already used"):
            envs.fork("x")
        with pytest.raises(ValueError, match="already used"):
            b.fork("x")
        with pytest.raises(ValueError, match="already used"):
            b.fork(envs.lineage.branch_id)
        with pytest.raises(ValueError, match="indices"):
            envs.fork("y", indices=[5])
        with pytest.raises(ValueError, match="copies"):
            envs.fork("y", copies=0)
        with pytest.raises(ValueError, match="one seed per"):
            envs.fork("y", copies=2, reseed=[1])
        b.close()
    finally:
        envs.close()


class WarmEnv(SpaceEnv):
    """Counts its builds and warm-ups in files, so the test can see where they ran."""

    def __init__(self, log_dir):
        super().__init__(spaces.Discrete(5))
        self.log_dir = log_dir
        self.warm = False
        with open(os.path.join(log_dir, f"built-{os.getpid()}"), "w"):
            pass


def warm(env):
    env.warm = True
    env.marker = "warmed"
    with open(os.path.join(env.log_dir, f"warmed-{os.getpid()}"), "w"):
        pass


@pytest.mark.host_files
def test_from_parent_prepares_once_and_resets_from_fresh_clones(tmp_path):
    log_dir = str(tmp_path)
    envs = ForkVectorEnv.from_parent(
        lambda: WarmEnv(log_dir),
        4,
        warmup=warm,
        ready_check=lambda env: env.warm,
        lineage_log=tmp_path / "lineage.jsonl",
        private_tmp=False,  # the warm parent's files must reach this test's tmp_path
    )
    try:
        built = [f for f in os.listdir(log_dir) if f.startswith("built-")]
        warmed = [f for f in os.listdir(log_dir) if f.startswith("warmed-")]
        assert len(built) == 1 and len(warmed) == 1  # once, in the warm parent
        assert envs.get_attr("warm") == (True,) * 4
        envs.reset(seed=0)
        envs.set_attr("marker", "episode state")
        pids = envs.worker_pids
        envs.reset(seed=1)  # reset_mode="clone": fresh clones of the warm parent
        assert envs.get_attr("marker") == ("warmed",) * 4
        assert not set(pids) & set(envs.worker_pids)
        envs.set_attr("marker", "episode state")
        envs.reset(seed=2, options={"reset_mask": np.array([True, False, True, False])})
        assert envs.get_attr("marker") == ("warmed", "episode state", "warmed", "episode state")
        assert len(os.listdir(log_dir)) == 2 + 1  # still one build, one warm-up, the log
    finally:
        envs.close()


def test_in_place_reset_keeps_the_sandbox():
    envs = ForkVectorEnv.from_parent(
        lambda: SpaceEnv(spaces.Discrete(5)), 2, reset_mode="in_place", lineage_log=False
    )
    try:
        envs.reset(seed=0)
        envs.set_attr("marker", "kept")
        pids = envs.worker_pids
        envs.reset(seed=1)
        assert envs.worker_pids == pids and envs.get_attr("marker") == ("kept", "kept")
    finally:
        envs.close()


def test_a_failing_ready_check_is_an_error():
    with pytest.raises(RuntimeError, match="ready_check"):
        ForkVectorEnv.from_parent(cartpole, 2, ready_check=lambda env: False, lineage_log=False)


def test_provenance_is_queryable_and_logged(tmp_path):
    log = tmp_path / "lineage.jsonl"
    envs = ForkVectorEnv.from_parent(cartpole, 2, seed=5, branch_id="root", lineage_log=log)
    try:
        envs.reset(seed=0)
        b = envs.fork("child", indices=[1], copies=3, reseed=10)
        g = b.fork("grandchild", indices=[2])
        assert b.lineage.parent_branch_id == "root"
        assert g.lineage.ancestors() == ["child", "root"]
        assert envs.lineage.children() == ["child"]
        record = b.lineage.record
        assert record.source_indices == [1] and record.copies == 3
        assert record.seeds == [10, 11, 12] and len(record.pids) == 3
        assert b.lineage.baseline_id == envs.lineage.baseline_id
        b.close()
        g.close()
    finally:
        envs.close()
    events = read_log(log)
    kinds = [e["event"] for e in events]
    assert kinds.count("branch_created") == 2 and kinds.count("closed") == 3
    root = next(e for e in events if e["event"] == "root_ready")
    assert root["baseline_inputs"]["seed"] == 5
    assert root["baseline_inputs"]["packages"]["gymnasium"] == gym.__version__
    tree = render_tree(events)
    heading, first = tree.splitlines()[:2]  # the run's heading (time, script), then the root
    assert heading.startswith("run ") and first.startswith("root baseline=")
    assert "child from [1] x3" in tree and "grandchild from [2] x1" in tree


@pytest.mark.slow  # 1.5 s here
def test_the_baseline_id_changes_with_what_the_ready_point_depends_on():
    ids = []
    for seed, fn in itertools.product((1, 2), (cartpole, frozen_lake)):
        envs = ForkVectorEnv.from_parent(fn, 1, seed=seed, lineage_log=False)
        ids.append(envs.lineage.baseline_id)
        envs.close()
    assert len(set(ids)) == 4


def test_beam_search_returns_match_replay_from_start_and_exhaustive_search():
    make = beam_search.CStateWalk
    best = beam_search.beam_search(make, seed=3, depth=3, width=27)  # keeps every leaf
    for node in best:
        assert node.ret == pytest.approx(beam_search.replay_return(make, 3, node.actions))
    exhaustive = max(
        beam_search.replay_return(make, 3, actions)
        for actions in itertools.product(range(3), repeat=3)
    )
    assert best[0].ret == pytest.approx(exhaustive)


def test_the_lineage_cli_prints_the_tree(tmp_path):
    import subprocess

    log = tmp_path / "lineage.jsonl"
    envs = ForkVectorEnv([cartpole] * 2, branch_id="cli-root", lineage_log=log)
    envs.reset(seed=0)
    envs.fork("cli-child", indices=[0], copies=2).close()
    envs.close()
    out = subprocess.run(
        [sys.executable, "-m", "gym_fork", "lineage", str(log)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    heading, *lines = out.splitlines()
    assert heading.startswith("run ") and "env CartPole-v1" in heading
    assert lines[0].startswith("cli-root baseline=") and lines[0].endswith("[closed]")
    assert lines[1] == "└── cli-child from [0] x2 -> 2 sub-envs [closed]"
    missing = subprocess.run(
        [sys.executable, "-m", "gym_fork", "lineage", str(tmp_path / "nope.jsonl")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no such log" in missing.stdout

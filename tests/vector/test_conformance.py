"""ForkVectorEnv step-for-step against SyncVectorEnv, over every space kind and mode."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from gym_fork import ForkVectorEnv
from tests.helpers import SpaceEnv, make_space_env

OBSERVATION_SPACES = {
    "box-f32": spaces.Box(-1, 1, (3,), np.float32),
    "box-u8-image": spaces.Box(0, 255, (8, 8, 3), np.uint8),
    "box-f64": spaces.Box(-1, 1, (2, 2), np.float64),
    "box-i32": spaces.Box(-9, 9, (4,), np.int32),
    "box-f16": spaces.Box(-1, 1, (3,), np.float16),
    "discrete": spaces.Discrete(7, start=1),
    "multidiscrete": spaces.MultiDiscrete([2, 5, 3]),
    "multibinary": spaces.MultiBinary(5),
    "text": spaces.Text(8),
    "dict": spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "id": spaces.Discrete(4)}),
    "tuple": spaces.Tuple((spaces.MultiBinary(2), spaces.Box(0, 1, (1,)))),
    "oneof": spaces.OneOf((spaces.Discrete(3), spaces.Box(0, 1, (2,)))),
    "sequence": spaces.Sequence(spaces.Discrete(4)),
    "graph": spaces.Graph(spaces.Box(0, 1, (2,)), spaces.Discrete(3)),
}
SHARED_NOT_POSSIBLE = {"sequence", "graph"}
ACTION_SPACES = {
    "discrete": spaces.Discrete(3),
    "box": spaces.Box(-1, 1, (2,), np.float32),
    "dict": spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Box(0, 1, (1,))}),
}


def run_both(env_fns, steps, *, seed, actions_seed=0, **kwargs):
    """Run Fork and Sync with the same seeds and actions; assert identical results."""
    fork = ForkVectorEnv(env_fns, **kwargs)
    sync_kwargs = {k: v for k, v in kwargs.items() if k in ("autoreset_mode", "copy")}
    sync = SyncVectorEnv(env_fns, **sync_kwargs)
    try:
        assert fork.observation_space == sync.observation_space
        assert fork.action_space == sync.action_space
        assert fork.metadata == sync.metadata
        a, b = fork.reset(seed=seed), sync.reset(seed=seed)
        assert data_equivalence(a, b)
        fork.action_space.seed(actions_seed)
        for _ in range(steps):
            actions = fork.action_space.sample()
            a, b = fork.step(actions), sync.step(actions)
            assert data_equivalence(a, b), (a, b)
    finally:
        fork.close()
        sync.close()


@pytest.mark.parametrize("name", sorted(OBSERVATION_SPACES))
@pytest.mark.parametrize("shared_memory", [True, False])
def test_every_observation_space(name, shared_memory):
    space = OBSERVATION_SPACES[name]
    env_fns = [make_space_env(space) for _ in range(3)]
    if shared_memory and name in SHARED_NOT_POSSIBLE:
        with pytest.raises(ValueError, match="shared_memory=False"):
            ForkVectorEnv(env_fns, shared_memory=True)
        return
    run_both(env_fns, 25, seed=11, shared_memory=shared_memory)


@pytest.mark.parametrize("name", sorted(ACTION_SPACES))
def test_every_action_space(name):
    env_fns = [make_space_env(spaces.Box(0, 1, (2,)), ACTION_SPACES[name]) for _ in range(3)]
    run_both(env_fns, 25, seed=5)


@pytest.mark.parametrize("mode", list(AutoresetMode))
@pytest.mark.parametrize("envs_per_worker", [1, 2])
def test_autoreset_modes(mode, envs_per_worker):
    env_fns = [make_space_env(spaces.Box(-1, 1, (2,)), max_len=4) for _ in range(4)]
    fork = ForkVectorEnv(env_fns, autoreset_mode=mode, envs_per_worker=envs_per_worker)
    sync = SyncVectorEnv(env_fns, autoreset_mode=mode)
    try:
        assert fork.metadata["autoreset_mode"] is mode
        assert data_equivalence(fork.reset(seed=3), sync.reset(seed=3))
        for step in range(40):
            actions = np.array([step % 3] * 4)
            a, b = fork.step(actions), sync.step(actions)
            assert data_equivalence(a, b)
            if mode is AutoresetMode.DISABLED and np.any(a[2] | a[3]):
                mask = a[2] | a[3]
                a = fork.reset(seed=[step] * 4, options={"reset_mask": mask})
                b = sync.reset(seed=[step] * 4, options={"reset_mask": mask})
                assert data_equivalence(a, b)
    finally:
        fork.close()
        sync.close()


def test_seed_lists_options_and_reset_mask():
    env_fns = [make_space_env(spaces.Discrete(100)) for _ in range(3)]
    fork, sync = ForkVectorEnv(env_fns), SyncVectorEnv(env_fns)
    try:
        seeds = [7, None, 9]
        a, b = fork.reset(seed=seeds, options={"note": "x"}), sync.reset(seed=[7, None, 9])
        assert a[1]["note"].tolist() == ["x", "x", "x"]
        assert a[0][0] == b[0][0] and a[0][2] == b[0][2]
        mask = np.array([False, True, False])
        options = {"reset_mask": mask, "note": "y"}
        obs, info = fork.reset(seed=[1, 2, 3], options=options)
        assert "reset_mask" in options, "the caller's options dict must not be mutated"
        assert info["_note"].tolist() == [False, True, False]
        assert obs[0] == a[0][0] and obs[2] == a[0][2]
        with pytest.raises(ValueError, match="length must match"):
            fork.reset(seed=[1, 2])
        with pytest.raises(TypeError, match="numpy array"):
            fork.reset(options={"reset_mask": [True, False, True]})
        with pytest.raises(ValueError, match="at least one True"):
            fork.reset(options={"reset_mask": np.zeros(3, dtype=bool)})
    finally:
        fork.close()
        sync.close()


def test_call_get_attr_set_attr_render():
    env_fns = [make_space_env(spaces.Discrete(3), render_mode="rgb_array") for _ in range(3)]
    envs = ForkVectorEnv(env_fns)
    try:
        envs.reset(seed=0)
        envs.step(np.array([0, 1, 2]))
        assert envs.call("add", 10, y=5) == (16, 16, 16)
        assert envs.get_attr("marker") == ("initial",) * 3
        envs.set_attr("marker", ["a", "b", "c"])
        assert envs.get_attr("marker") == ("a", "b", "c")
        envs.set_attr("marker", "same")
        assert envs.get_attr("marker") == ("same",) * 3
        frames = envs.render()
        assert isinstance(frames, tuple) and len(frames) == 3
        assert all(f.shape == (4, 4, 3) and f[0, 0, 0] == 1 for f in frames)
        assert envs.render_mode == "rgb_array"
        assert len(envs.np_random_seed) == 3
        with pytest.raises(ValueError, match="use `step` directly"):
            envs.call("step", 0)
        with pytest.raises(ValueError, match="length equal to the number"):
            envs.set_attr("marker", ["a"])
    finally:
        envs.close()


def test_copy_false_returns_the_shared_buffer_and_copy_true_does_not():
    env_fns = [make_space_env(spaces.Box(-1, 1, (2,))) for _ in range(2)]
    for copy in (True, False):
        envs = ForkVectorEnv(env_fns, copy=copy)
        try:
            obs1, _ = envs.reset(seed=1)
            snapshot = obs1.copy()
            obs2, *_ = envs.step(np.array([0, 0]))
            assert (obs1 is obs2) == (not copy)
            assert np.array_equal(obs1, snapshot) == copy
        finally:
            envs.close()


# A long run: every step of the first MIN_LONG_STEPS (some 45 episode ends of random
# CartPole over 5 sub-envs), then on up to MAX_LONG_STEPS while LONG_RUN_S lasts (the
# process host gets through all of them; a microVM under TCG, ~100 steps/s, does not).
MIN_LONG_STEPS, MAX_LONG_STEPS, LONG_RUN_S = 200, 1000, 2.0


@pytest.mark.slow  # 2.2 s here
@pytest.mark.parametrize("envs_per_worker", [1, 3, 8])
def test_cartpole_matches_sync_over_a_long_run(envs_per_worker):
    import gymnasium as gym

    env_fns = [lambda: gym.make("CartPole-v1") for _ in range(5)]
    fork = ForkVectorEnv(env_fns, envs_per_worker=envs_per_worker)
    sync = SyncVectorEnv(env_fns)
    try:
        assert data_equivalence(fork.reset(seed=42), sync.reset(seed=42))
        rng = np.random.default_rng(0)
        ends = 0
        started = time.monotonic()
        for step in range(MAX_LONG_STEPS):
            if step >= MIN_LONG_STEPS and time.monotonic() - started > LONG_RUN_S:
                break
            actions = rng.integers(0, 2, 5)
            result = fork.step(actions)
            assert data_equivalence(result, sync.step(actions))
            ends += int(np.sum(result[2] | result[3]))
        assert ends >= 20  # the run went through many autoresets
    finally:
        fork.close()
        sync.close()


class CountingEnv:
    """Counts, in a shared file, how many sub-envs are inside step() at once."""

    def __init__(self, path):
        self.path = path

    def __call__(self):
        import fcntl
        import time

        path = self.path

        class Env(SpaceEnv):
            def __init__(self):
                super().__init__(spaces.Discrete(3), max_len=1000, trunc_prob=0)

            def _bump(self, delta):
                with open(path, "r+") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)
                    now, peak = map(int, f.read().split())
                    now += delta
                    f.seek(0)
                    f.truncate()
                    f.write(f"{now} {max(now, peak)}")

            def step(self, action):
                self._bump(+1)
                time.sleep(0.05)
                self._bump(-1)
                return super().step(action)

        return Env()


@pytest.mark.host_files
@pytest.mark.parametrize("limit", [1, 2, None])
def test_max_concurrency_bounds_sub_envs_stepping_at_once(tmp_path, limit):
    path = tmp_path / "count"
    path.write_text("0 0")
    path.chmod(0o666)  # sandboxes run as an unprivileged uid
    envs = ForkVectorEnv(
        [CountingEnv(str(path))] * 4,
        envs_per_worker=1,
        max_concurrency=limit,
        lineage_log=False,
        private_tmp=False,  # the sub-envs count in a file under this test's tmp_path
    )
    try:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.array([0, 1, 2, 0]))
        peak = int(path.read_text().split()[1])
        if limit is None:
            assert peak >= 2  # 4 sleeping sub-envs overlap without a limit
        else:
            assert peak <= limit
    finally:
        envs.close()


def test_make_vec_matches_gymnasium_make_vec():
    import gymnasium as gym
    from gymnasium.wrappers import RecordEpisodeStatistics

    import gym_fork

    for from_parent in (False, True):
        fork = gym_fork.make_vec(
            "CartPole-v1",
            3,
            wrappers=[RecordEpisodeStatistics],
            from_parent=from_parent,
            vector_kwargs={"lineage_log": False},
            max_episode_steps=20,
        )
        sync = gym.make_vec(
            "CartPole-v1",
            3,
            vectorization_mode="sync",
            wrappers=[RecordEpisodeStatistics],
            max_episode_steps=20,
        )
        try:
            assert data_equivalence(fork.reset(seed=3), sync.reset(seed=3))
            for _ in range(30):
                a = np.array([1, 0, 1])
                (*fa, finfo), (*sa, sinfo) = fork.step(a), sync.step(a)
                for info in (finfo, sinfo):  # the episode's wall-clock time differs
                    info.get("episode", {}).pop("t", None)
                assert data_equivalence(fa, sa) and data_equivalence(finfo, sinfo)
        finally:
            fork.close()
            sync.close()


def test_an_env_registered_with_gym_forks_vector_entry_point_reaches_it_from_make_vec():
    """Gymnasium 1.x: an env that opts in at registration is vectorized by ForkVectorEnv
    from gym.make_vec with no change to the caller; "sync" still gives Gymnasium's."""
    import gymnasium as gym

    import gym_fork

    env_id = "GymForkEntryPointCartPole-v0"
    gym.register(
        env_id,
        entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
        max_episode_steps=25,
        vector_entry_point=gym_fork.vector_entry_point(env_id, lineage_log=False),
    )
    try:
        for mode in (None, "vector_entry_point"):
            fork = gym.make_vec(env_id, num_envs=2, vectorization_mode=mode)
            sync = gym.make_vec(env_id, num_envs=2, vectorization_mode="sync")
            try:
                assert isinstance(fork, ForkVectorEnv) and fork.num_envs == 2
                assert isinstance(sync, gym.vector.SyncVectorEnv)
                assert fork.metadata["autoreset_mode"] == sync.metadata["autoreset_mode"]
                assert data_equivalence(fork.reset(seed=5), sync.reset(seed=5))
                for _ in range(30):  # past the spec's 25-step limit: truncated alike
                    a = np.array([1, 1])
                    assert data_equivalence(fork.step(a)[:4], sync.step(a)[:4])
            finally:
                fork.close()
                sync.close()
        # the env's kwargs reach the sub-envs
        fork = gym.make_vec(env_id, num_envs=1, sutton_barto_reward=True)
        try:
            fork.reset(seed=0)
            assert fork.get_attr("_sutton_barto_reward") == (True,)
        finally:
            fork.close()
    finally:
        del gym.registry[env_id]


@pytest.mark.parametrize("mode", list(AutoresetMode))
def test_metadata_names_the_autoreset_mode_in_every_mode(mode):
    import gymnasium as gym

    def cartpole_fn():
        return gym.make("CartPole-v1")

    envs = ForkVectorEnv([cartpole_fn], autoreset_mode=mode, lineage_log=False)
    try:
        assert envs.metadata["autoreset_mode"] is mode
        if os.environ.get("GYM_FORK_HOST", "process") != "inline":  # inline cannot fork
            envs.reset(seed=0)
            branch = envs.fork("b")
            try:  # a branch: the same
                assert branch.metadata["autoreset_mode"] is mode
            finally:
                branch.close()
        by_name = ForkVectorEnv([cartpole_fn], autoreset_mode=mode.value, lineage_log=False)
        try:  # given as its string, as Gymnasium's own vector envs take it
            assert by_name.metadata["autoreset_mode"] is mode
        finally:
            by_name.close()
    finally:
        envs.close()

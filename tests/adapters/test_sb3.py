"""The Stable-Baselines3 adapter: SB3's VecEnv contract, checked against DummyVecEnv."""

from __future__ import annotations

import functools
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("stable_baselines3", reason="needs the sb3 extra (stable-baselines3)")

from gymnasium.vector import AutoresetMode
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import (
    DummyVecEnv,
    VecCheckNan,
    VecEnv,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
)

from gym_fork import ForkVectorEnv
from gym_fork.adapters import ForkVecEnv, unbatch_infos
from tests.adapters.envs import counting_env, dict_env, short_cartpole

N = 4


@pytest.fixture
def closing():
    """Closes every env handed to it, even when the test fails."""
    envs: list[Any] = []
    yield lambda env: envs.append(env) or env
    for env in reversed(envs):
        env.close()


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Equal values of equal types, arrays with equal dtypes; Monitor's clock ignored."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        ignore = {"t"} if where.endswith("episode") else set()
        assert set(got) - ignore == set(want) - ignore, where
        for key in set(want) - ignore:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray | np.generic):
        assert isinstance(got, np.ndarray | np.generic), where
        assert got.dtype == want.dtype, where
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert type(got) is type(want), f"{where}: {type(got)} vs {type(want)}"
        assert got == want, where


def check_vec_env_output(env: VecEnv, obs, rewards, dones, infos) -> None:
    """What SB3's algorithms and buffers rely on in every step result."""
    space = env.observation_space
    assert len(infos) == env.num_envs and all(isinstance(i, dict) for i in infos)
    assert rewards.shape == (env.num_envs,) and dones.shape == (env.num_envs,)
    assert dones.dtype == np.bool_
    if isinstance(obs, np.ndarray):
        assert obs.shape == (env.num_envs, *space.shape) and obs.dtype == space.dtype
    # VecNormalize moves observations out of the declared space by design, and
    # VecFrameStack declares its bounds in another order than it stacks.
    raw = env.unwrapped is env or isinstance(env, VecMonitor)
    for i in range(env.num_envs):
        single = {k: v[i] for k, v in obs.items()} if isinstance(obs, dict) else obs[i]
        assert not raw or space.contains(single), f"obs of sub-env {i} outside {space}"
        assert "TimeLimit.truncated" in infos[i]
        if dones[i]:
            assert not raw or space.contains(infos[i]["terminal_observation"])


def run_side_by_side(envs: list[VecEnv], steps: int, seed: int = 0) -> int:
    """Seed, reset and step every env with the same random actions; compare all outputs.

    Returns how many episode ends were seen, so callers can check the run covered them.
    """
    for env in envs:
        env.seed(seed)
    first = [env.reset() for env in envs]
    for obs in first[1:]:
        assert_same(obs, first[0], "reset obs")
    for env in envs[1:]:
        assert_same(env.reset_infos, envs[0].reset_infos, "reset_infos")
    rng = np.random.default_rng(seed)
    space = envs[0].action_space
    ends = 0
    for step in range(steps):
        actions = np.array([rng.integers(space.n) for _ in range(envs[0].num_envs)])
        results = [env.step(actions) for env in envs]
        check_vec_env_output(envs[0], *results[0])
        for result, env in zip(results[1:], envs[1:], strict=True):
            names = ("obs", "rew", "done", "infos")
            for got, want, name in zip(result, results[0], names, strict=True):
                assert_same(got, want, f"step {step} {name}")
            assert_same(env.reset_infos, envs[0].reset_infos, f"step {step} reset_infos")
        ends += int(results[0][2].sum())
    return ends


def test_unbatch_infos_follows_masks():
    infos = {
        "a": np.array([1, 0, 3]),
        "_a": np.array([True, False, True]),
        "obj": np.array([None, "x", None], dtype=object),
        "_obj": np.array([False, True, False]),
        "ep": {"r": np.array([0.0, 2.5, 0.0]), "_r": np.array([False, True, False])},
        "_ep": np.array([False, True, False]),
    }
    got = unbatch_infos(infos, 3)
    assert got == [{"a": 1}, {"obj": "x", "ep": {"r": 2.5}}, {"a": 3}]
    assert type(got[0]["a"]) is int and type(got[1]["ep"]["r"]) is float


@pytest.mark.slow  # 3.8 s here
@pytest.mark.parametrize("make_env", [short_cartpole, dict_env], ids=["cartpole", "dict"])
def test_steps_match_dummy_vec_env(make_env, closing):
    fork = closing(ForkVecEnv([make_env] * N))
    dummy = closing(DummyVecEnv([make_env] * N))
    assert fork.vector_env.autoreset_mode == AutoresetMode.SAME_STEP
    assert fork.observation_space == dummy.observation_space
    assert fork.action_space == dummy.action_space
    assert run_side_by_side([dummy, fork], steps=40) >= 5


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED])
def test_wrapping_an_existing_vector_env_in_other_autoreset_modes(mode, closing):
    fork = closing(ForkVecEnv(ForkVectorEnv([dict_env] * N, autoreset_mode=mode)))
    dummy = closing(DummyVecEnv([dict_env] * N))
    assert not fork.bridged
    assert run_side_by_side([dummy, fork], steps=30, seed=7) >= 5
    # Calls reach every sub-env of a ForkVectorEnv built elsewhere: a subset is refused.
    with pytest.raises(NotImplementedError, match="some sub-envs"):
        fork.env_method("add", 1, indices=[0])
    assert fork.env_method("add", 1) == dummy.env_method("add", 1)
    with pytest.raises(TypeError):
        ForkVecEnv(fork.vector_env, copy=False)


@pytest.mark.slow  # 2.5 s here
def test_sub_env_access(closing):
    # trusted=True: get_attr("add") returns a bound method, which only travels pickled.
    fork = closing(ForkVecEnv([counting_env] * N, trusted=True))
    dummy = closing(DummyVecEnv([counting_env] * N))
    for env in (fork, dummy):
        env.seed(3)
        env.set_options([{"note": f"n{i % 2}"} for i in range(N)])  # two distinct options
        env.reset()
        env.step(np.zeros(N, dtype=np.int64))
    assert_same(fork.reset_infos, dummy.reset_infos, "reset_infos")
    assert [info["note"] for info in fork.reset_infos] == ["n0", "n1", "n0", "n1"]

    # env_method and set_attr reach the chosen sub-envs only.
    assert fork.env_method("bump", 5, indices=[1, 3]) == [5, 5]
    assert fork.env_method("bump", k=2, indices=2) == [2]
    assert fork.get_attr("bumps") == [0, 5, 2, 5]
    fork.set_attr("marker", ["a", "list"], indices=[0])
    assert fork.get_attr("marker") == [["a", "list"], "initial", "initial", "initial"]
    fork.set_attr("marker", "all")
    assert fork.get_attr("marker", indices=[3, 0]) == ["all", "all"]
    # A method is returned as SB3 does, not called as Gymnasium's get_attr would.
    assert fork.get_attr("add", indices=[0])[0](1) == dummy.get_attr("add", indices=[0])[0](1)
    assert fork.has_attr("bumps") and not fork.has_attr("no_such_attribute")

    assert fork.env_is_wrapped(Monitor) == [False] * N
    assert fork.env_is_wrapped(gym.Wrapper) == dummy.env_is_wrapped(gym.Wrapper)
    assert fork.get_attr("spec") == dummy.get_attr("spec")

    assert fork.render_mode == "rgb_array"
    assert_same(list(fork.get_images()), list(dummy.get_images()), "images")
    assert_same(fork.render(), dummy.render(), "tiled render")


@pytest.mark.slow  # 4.0 s here
def test_monitor_is_seen_through_the_bridge(closing):
    fork = closing(ForkVecEnv([short_cartpole] * 2))
    assert fork.env_is_wrapped(Monitor) == [True, True]
    assert fork.env_is_wrapped(Monitor, indices=[1]) == [True]


@pytest.mark.parametrize(
    "wrap",
    [
        lambda env: VecMonitor(env),
        lambda env: VecFrameStack(env, n_stack=3),
        lambda env: VecNormalize(env, gamma=0.9),
        lambda env: VecCheckNan(
            VecNormalize(VecFrameStack(VecMonitor(env), 2)), raise_exception=True
        ),
    ],
    ids=["VecMonitor", "VecFrameStack", "VecNormalize", "stacked"],
)
@pytest.mark.slow  # 6.5 s here
def test_under_sb3_wrappers(wrap, closing):
    fork = closing(wrap(ForkVecEnv([short_cartpole] * N)))
    dummy = closing(wrap(DummyVecEnv([short_cartpole] * N)))
    assert run_side_by_side([dummy, fork], steps=30, seed=1) >= N


def test_fork_replays_exactly(closing):
    source = closing(ForkVecEnv([dict_env] * N))
    source.seed(11)
    source.reset()
    rng = np.random.default_rng(0)
    for _ in range(7):
        source.step(rng.integers(3, size=N))
    branch = closing(source.fork("sb3-branch", indices=[1, 3], copies=2))
    assert isinstance(branch, ForkVecEnv) and branch.bridged and branch.num_envs == 4
    assert branch.lineage.parent_branch_id == source.lineage.branch_id
    picked = [1, 1, 3, 3]
    assert_same(branch.reset_infos, [source.reset_infos[i] for i in picked], "reset_infos")
    ends = 0
    for step in range(25):
        actions = rng.integers(3, size=N)
        want = source.step(actions)
        got = branch.step(actions[picked])
        want_obs = {key: value[picked] for key, value in want[0].items()}
        assert_same(got[0], want_obs, f"step {step} obs")
        assert_same(got[1], want[1][picked], f"step {step} rewards")
        assert_same(got[2], want[2][picked], f"step {step} dones")
        assert_same(got[3], [want[3][i] for i in picked], f"step {step} infos")
        ends += int(got[2].sum())
    assert ends >= 3
    assert branch.env_method("add", 1, indices=[0]) == [source.env_method("add", 1)[1]]


@pytest.mark.slow  # 1.8 s here
def test_make_vec_env_builds_it(closing):
    env = closing(make_vec_env("CartPole-v1", n_envs=2, seed=5, vec_env_cls=ForkVecEnv))
    assert isinstance(env, ForkVecEnv) and env.env_is_wrapped(Monitor) == [True, True]
    assert env.reset().shape == (2, 4)


@pytest.mark.slow
def test_ppo_learns_cartpole(closing, tmp_path, monkeypatch):
    """PPO on 8 sandboxed CartPoles reaches a mean return >= 150 within 30k steps."""
    import torch

    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path))  # SB3's logger makes a folder, else in /tmp
    from stable_baselines3 import PPO
    from stable_baselines3.common.evaluation import evaluate_policy

    torch.set_num_threads(1)
    env = closing(make_vec_env("CartPole-v1", n_envs=8, seed=0, vec_env_cls=ForkVecEnv))
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=256,
        n_epochs=20,
        gamma=0.98,
        gae_lambda=0.8,
        learning_rate=1e-3,
        ent_coef=0.0,
        seed=0,
        device="cpu",
    )
    start = time.monotonic()
    model.learn(total_timesteps=30_000)
    elapsed = time.monotonic() - start
    eval_env = closing(make_vec_env("CartPole-v1", n_envs=4, seed=100, vec_env_cls=ForkVecEnv))
    mean_return, _ = evaluate_policy(model, eval_env, n_eval_episodes=12, deterministic=True)
    print(f"PPO CartPole-v1: 30k steps in {elapsed:.1f} s, mean return {mean_return:.1f}")
    assert mean_return >= 150


def test_malformed_sb3_actions_and_indices_are_named(closing):
    from gym_fork.errors import BadActionError
    from tests.adapters.sb3_envs import echo_env

    fork = closing(ForkVecEnv([functools.partial(echo_env, "Dict")] * 2))
    fork.reset()
    sample = fork.action_space.sample()
    with pytest.raises(BadActionError, match="3 SB3 actions for 2 sub-envs"):
        fork.step([sample] * 3)
    # A Gymnasium batch (a dict of arrays) is not SB3's one-action-per-sub-env form.
    with pytest.raises(BadActionError, match=r"one per sub-env .* got a dict"):
        fork.step({key: np.stack([v, v]) for key, v in sample.items()})
    with pytest.raises(BadActionError, match="do not fit the action space"):
        fork.step([sample, {"box": np.zeros(2, np.float32)}])
    obs, *_ = fork.step([sample, sample])  # still usable
    assert obs["discrete"].tolist() == [sample["discrete"]] * 2
    box = closing(ForkVecEnv([echo_env] * 2))
    with pytest.raises(BadActionError, match=r"got shape \(3, 2\)"):
        box.step(np.zeros((3, 2), np.float32))
    # numpy integers are indices too; anything else is named.
    assert box.env_method("whoami", indices=np.int64(-1)) == [None]
    with pytest.raises(TypeError, match=r"must be an int, got 1\.0"):
        box.get_attr("t", indices=[1.0])
    with pytest.raises(TypeError, match="got str"):
        box.get_attr("t", indices="01")


def _stepped(env: VecEnv, steps: int, seed: int = 0) -> VecEnv:
    env.seed(seed)
    env.reset()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        env.step(rng.integers(2, size=env.num_envs))
    return env


@pytest.mark.slow  # 1.8 s here
def test_fork_through_vec_normalize_carries_its_statistics(closing):
    source = closing(_stepped(VecNormalize(ForkVecEnv([short_cartpole] * N)), 9))
    branch = closing(source.fork("normalised", indices=[-1, 0]))
    assert isinstance(branch, VecNormalize) and isinstance(branch.venv, ForkVecEnv)
    assert branch.num_envs == 2 and branch.venv.bridged
    # Copied, not shared.
    assert branch.obs_rms is not source.obs_rms and branch.ret_rms is not source.ret_rms
    np.testing.assert_array_equal(branch.obs_rms.mean, source.obs_rms.mean)
    np.testing.assert_array_equal(branch.obs_rms.var, source.obs_rms.var)
    assert branch.obs_rms.count == source.obs_rms.count
    np.testing.assert_array_equal(branch.returns, source.returns[[N - 1, 0]])
    np.testing.assert_array_equal(branch.get_original_obs(), source.get_original_obs()[[N - 1, 0]])
    # Stepped alike (statistics frozen: in training each updates them with its own
    # batch), the branch normalises its sub-envs as its source does.
    source.training = branch.training = False
    rng = np.random.default_rng(1)
    for step in range(6):
        actions = rng.integers(2, size=N)
        want = source.step(actions)
        got = branch.step(actions[[N - 1, 0]])
        for name, g, w in zip(("obs", "rewards", "dones"), got[:3], want[:3], strict=False):
            np.testing.assert_array_equal(g, w[[N - 1, 0]], err_msg=f"step {step} {name}")
    count = source.obs_rms.count
    source.training = branch.training = True
    branch.step(np.zeros(2, dtype=np.int64))
    assert source.obs_rms.count == count and branch.obs_rms.count == count + 2


@pytest.mark.slow  # 1.7 s here
def test_fork_through_vec_frame_stack_carries_the_stacked_frames(closing):
    source = closing(_stepped(VecFrameStack(ForkVecEnv([short_cartpole] * N), n_stack=3), 5))
    branch = closing(source.fork("stacked", indices=[2], copies=2))
    assert isinstance(branch, VecFrameStack) and branch.num_envs == 2
    stacked = source.stacked_obs.stacked_obs
    np.testing.assert_array_equal(branch.stacked_obs.stacked_obs, stacked[[2, 2]])
    assert branch.stacked_obs.stacked_obs is not stacked
    for step in range(15):  # past an episode end (12 steps): the stack restarts alike
        actions = np.array([step % 2] * N)
        obs, _, dones, _ = source.step(actions)
        b_obs, _, b_dones, _ = branch.step(actions[[2, 2]])
        np.testing.assert_array_equal(b_obs, obs[[2, 2]], err_msg=f"step {step}")
        assert b_dones.tolist() == [dones[2]] * 2


@pytest.mark.slow  # 1.9 s here
def test_fork_through_stacked_wrappers_and_fork_wrapped(closing):
    from gym_fork.sb3 import fork_wrapped

    source = closing(
        _stepped(VecCheckNan(VecNormalize(VecFrameStack(ForkVecEnv([short_cartpole] * N), 2))), 4)
    )
    source.venv.training = False  # the VecNormalize: frozen statistics (see above)
    for k, fork in enumerate((source.fork, functools.partial(fork_wrapped, source))):
        branch = closing(fork(f"nested-{k}", indices=[1]))
        assert [
            type(e) for e in (branch, branch.venv, branch.venv.venv, branch.venv.venv.venv)
        ] == [
            VecCheckNan,
            VecNormalize,
            VecFrameStack,
            ForkVecEnv,
        ]
        obs, *_ = source.step(np.ones(N, dtype=np.int64))
        b_obs, *_ = branch.step(np.ones(1, dtype=np.int64))
        np.testing.assert_allclose(b_obs, obs[[1]], rtol=1e-6)
    # The inner env forks plainly, unwrapped.
    plain = closing(source.unwrapped.fork("plain", indices=[0]))
    assert type(plain) is ForkVecEnv


class _MyNormalize(VecNormalize):
    """A subclass: it may hold state gym_fork does not know."""


@pytest.mark.slow  # 2.6 s here
@pytest.mark.parametrize("wrap", [VecMonitor, _MyNormalize], ids=["VecMonitor", "subclass"])
def test_fork_through_another_wrapper_is_refused_by_name(wrap, closing):
    env = closing(wrap(VecNormalize(ForkVecEnv([counting_env] * 2))))
    env.reset()
    forked = []
    env.unwrapped.fork = lambda *args, **kwargs: forked.append(args)  # a spy
    with pytest.raises(
        TypeError, match=rf"fork\(\) through {wrap.__name__}: .*env\.unwrapped\.fork"
    ):
        env.fork("refused")
    assert forked == []  # refused before anything was forked

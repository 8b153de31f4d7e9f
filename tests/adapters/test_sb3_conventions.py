"""SB3's VecEnv conventions, checked the way SB3's own tests check its vec envs: every
test runs on DummyVecEnv, SubprocVecEnv and gym_fork's ForkVecEnv with the same
assertions, so a difference from SB3's own vec envs fails.

Indices (``stable_baselines3.common.vec_env.base_vec_env.VecEnv._get_indices``): None is
every sub-env, an int one, any iterable those, in its order; negative counts from the
end, a repeated index is called again, out of range is an IndexError. Actions: one per
sub-env, for every space SB3's vec envs carry (Box, Discrete, MultiDiscrete,
MultiBinary, Dict, Tuple).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import pytest

pytest.importorskip("stable_baselines3", reason="needs the sb3 extra (stable-baselines3)")

from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from gym_fork.adapters import ForkVecEnv
from tests.adapters.sb3_envs import ARRAY_SPACES, EPISODE, SB3_SPACES, UnusedWrapper, echo_env
from tests.adapters.test_sb3 import assert_same

N = 4
# SubprocVecEnv with "fork": its default forkserver outlives the test (a leak to the
# leak check); the workers it forks run nothing but SB3's worker loop.
VEC_ENV_CLASSES = {
    "DummyVecEnv": DummyVecEnv,
    "SubprocVecEnv": functools.partial(SubprocVecEnv, start_method="fork"),
    "ForkVecEnv": ForkVecEnv,
}


@pytest.fixture(params=list(VEC_ENV_CLASSES.values()), ids=list(VEC_ENV_CLASSES))
def make_vec_env(request):
    """Builds a vec env of the parametrised class from N EchoEnvs of a space; closes it."""
    built: list[Any] = []

    def make(space_name: str = "Box"):
        env = request.param([functools.partial(echo_env, space_name)] * N)
        built.append(env)
        return env

    yield make
    for env in built:
        env.close()
    # SubprocVecEnv's process objects hold fds until they are collected (leak check).
    built.clear()


# Each case a function, so that a generator is fresh for every call that takes it.
INDEX_CASES = {
    "None": lambda: None,
    "int": lambda: 2,
    "negative int": lambda: -1,
    "first and last": lambda: [0, -1],
    "negative list": lambda: [-2, -3],
    "unordered": lambda: [3, 0, 1],
    "range": lambda: range(1, 3),
    "generator": lambda: (i for i in (2, 0)),
    "numpy array": lambda: np.array([1, 3]),
    "tuple": lambda: (0,),
}


def chosen(case) -> list[int]:
    """The sub-envs an SB3 VecEnv reaches for ``case``: Python's own list indexing."""
    indices = case()
    everyone = list(range(N))
    if indices is None:
        return everyone
    if isinstance(indices, int):
        return [everyone[indices]]
    return [everyone[i] for i in indices]


@pytest.mark.parametrize("case", list(INDEX_CASES.values()), ids=list(INDEX_CASES))
def test_indices_reach_the_sub_envs_sb3_names(make_vec_env, case):
    env = make_vec_env()
    for k in range(N):
        env.set_attr("ident", k, indices=k)
    assert env.get_attr("ident") == list(range(N))
    want = chosen(case)
    assert env.get_attr("ident", indices=case()) == want
    assert env.env_method("whoami", indices=case()) == want
    assert env.env_is_wrapped(UnusedWrapper, indices=case()) == [False] * len(want)
    env.set_attr("mark", "set", indices=case())
    assert env.get_attr("mark") == ["set" if i in want else None for i in range(N)]


def test_a_repeated_index_calls_that_sub_env_again(make_vec_env):
    env = make_vec_env()
    assert env.env_method("bump", indices=[1, 1, 2, -3]) == [1, 2, 1, 3]
    assert env.get_attr("bumps") == [0, 3, 1, 0]
    assert env.get_attr("bumps", indices=[2, 2]) == [1, 1]


@pytest.mark.parametrize("bad", [N, -N - 1, [0, N]])
def test_an_index_out_of_range_is_an_index_error(make_vec_env, bad):
    env = make_vec_env()
    with pytest.raises(IndexError):
        env.env_method("whoami", indices=bad)
    with pytest.raises(IndexError):
        env.get_attr("ident", indices=bad)
    with pytest.raises(IndexError):
        env.set_attr("mark", "x", indices=bad)
    assert env.get_attr("mark") == [None] * N  # nothing was set before the error


def _per_env_formats(space_name: str, samples: list[Any]) -> dict[str, Any]:
    """The shapes SB3 code hands a VecEnv its actions in: a list of per-env actions
    (SB3's own tests), a stacked array for the array spaces (what its policies give),
    a tuple of per-env actions."""
    formats = {"list": samples, "tuple": tuple(samples)}
    if space_name in ARRAY_SPACES:
        formats["array"] = np.stack(samples)
    return formats


def _stacked(space_name: str, samples: list[Any]) -> Any:
    """The observation batch an SB3 vec env returns for these per-env observations."""
    space = SB3_SPACES[space_name]
    if space_name == "Dict":
        return {key: np.stack([s[key] for s in samples]) for key in space.spaces}
    if space_name == "Tuple":
        return tuple(np.stack([s[k] for s in samples]) for k in range(len(space.spaces)))
    return np.stack(samples).astype(space.dtype)


@pytest.mark.parametrize("space_name", list(SB3_SPACES))
def test_actions_of_every_space_reach_their_sub_envs(make_vec_env, space_name):
    env = make_vec_env(space_name)
    env.seed(0)
    env.reset()
    sampler = copy.deepcopy(SB3_SPACES[space_name])
    sampler.seed(1)
    steps = 0
    for _round in range(2):
        samples = [sampler.sample() for _ in range(N)]
        for name, actions in _per_env_formats(space_name, samples).items():
            obs, rewards, dones, infos = env.step(actions)
            steps += 1
            # The EchoEnv observes its action: each sub-env got its own, intact.
            if not dones.any():
                assert_same(obs, _stacked(space_name, samples), f"{name} actions")
            else:  # the sub-envs were reset: the action is the terminal observation
                for i in range(N):
                    assert_same(infos[i]["terminal_observation"], samples[i], f"{name} [{i}]")
            # (float32 from DummyVecEnv, float64 from SubprocVecEnv: only the values agree)
            assert rewards.tolist() == [(steps - 1) % EPISODE + 1.0] * N
            assert dones.tolist() == [steps % EPISODE == 0] * N

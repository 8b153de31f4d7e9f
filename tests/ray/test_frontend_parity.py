"""The same misuse raises the same error (type and message core) on ForkVectorEnv and on
RayForkVectorEnv (one shard on a one-node loopback cluster): both go through
gym_fork.vector.frontend. The Ray cases are skipped, with the reason, without Ray."""

from __future__ import annotations

import contextlib
import importlib.util

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError

from gym_fork import ForkVectorEnv
from tests.helpers import descendants, wait_until

# Module-scoped envs (one build per kind): the module checks its own leftovers.
pytestmark = [pytest.mark.leaks_checked_inside, pytest.mark.timeout(300)]

HAS_RAY = importlib.util.find_spec("ray") is not None
KINDS = [
    "local",
    pytest.param(
        "ray",
        marks=pytest.mark.skipif(
            not HAS_RAY, reason="ray is not installed (pip install 'gym_fork[ray]')"
        ),
    ),
]


def cartpole():
    return gym.make("CartPole-v1")


@pytest.fixture(scope="module")
def stack():
    """Everything the module builds, closed (and checked gone) at its end."""
    before = descendants()
    with contextlib.ExitStack() as resources:
        yield resources
    assert wait_until(lambda: descendants() <= before, timeout=15), (
        f"leaked processes: {descendants() - before}"
    )


@pytest.fixture(scope="module")
def build(stack):
    """build(kind, **kwargs): a 2-sub-env CartPole vector env of that kind."""

    def make(kind: str, **kwargs):
        if kind == "local":
            return ForkVectorEnv([cartpole] * 2, **kwargs)
        from gym_fork.ray import RayForkVectorEnv

        start_ray()
        return RayForkVectorEnv([cartpole] * 2, num_shards=1, lineage_log=False, **kwargs)

    def start_ray() -> None:
        from gym_fork.ray import loopback_cluster

        if not started:
            stack.enter_context(loopback_cluster(num_nodes=1, num_cpus=1))
            started.append(True)

    started: list[bool] = []
    make.start_ray = start_ray
    return make


@pytest.fixture(scope="module", params=KINDS)
def envs(request, build, stack):
    env = build(request.param)
    stack.callback(env.close)
    env.reset(seed=0)
    return env


@pytest.fixture(scope="module", params=KINDS)
def closed(request, build):
    env = build(request.param)
    env.close()
    return env


def _fork(**kwargs):
    return lambda env: env.fork("b", **kwargs)


def _reset(**kwargs):
    return lambda env: env.reset(**kwargs)


MISUSE = {
    "copies=True": (_fork(copies=True), ValueError, "copies must be an int >= 1"),
    "copies=0": (_fork(copies=0), ValueError, "copies must be an int >= 1"),
    "float index": (_fork(indices=[0.0]), TypeError, "fork indices must be ints"),
    "index out of range": (_fork(indices=[2]), ValueError, "fork indices must be in [0, 2)"),
    "indices a str": (_fork(indices="0"), TypeError, "sequence of ints"),
    "negative reseed": (_fork(reseed=-1), ValueError, "seeds must be >= 0"),
    "negative seed in list": (_fork(reseed=[1, -2]), ValueError, "seeds must be >= 0"),
    "reseed too short": (_fork(reseed=[1]), ValueError, "one seed per branch sub-env (2)"),
    "empty branch id": (
        lambda env: env.fork(""),
        TypeError,
        "branch_id must be a non-empty str",
    ),
    "branch id taken": (
        lambda env: env.fork(env.lineage.branch_id),
        ValueError,
        "is already used in this lineage tree",
    ),
    "reset_mask a list": (
        _reset(options={"reset_mask": [True, False]}),
        TypeError,
        "must be a numpy array",
    ),
    "reset_mask wrong dtype": (
        _reset(options={"reset_mask": np.array([1, 0])}),
        TypeError,
        "dtype=np.bool_",
    ),
    "reset_mask wrong shape": (
        _reset(options={"reset_mask": np.array([True])}),
        ValueError,
        "must have shape `(2,)`",
    ),
    "reset_mask all False": (
        _reset(options={"reset_mask": np.array([False, False])}),
        ValueError,
        "at least one True value",
    ),
    "seed list too short": (_reset(seed=[1]), ValueError, "the length must match"),
    "seed a float": (_reset(seed=1.5), TypeError, "seed must be None, an int"),
    "set_attr values": (
        lambda env: env.set_attr("x", [1, 2, 3]),
        ValueError,
        "Got `3` values for 2 environments",
    ),
    "step_wait first": (
        lambda env: env.step_wait(),
        NoAsyncCallError,
        "without any prior call to `step_async`",
    ),
    "reset_wait first": (
        lambda env: env.reset_wait(),
        NoAsyncCallError,
        "without any prior call to `reset_async`",
    ),
    "call_wait first": (
        lambda env: env.call_wait(),
        NoAsyncCallError,
        "without any prior call to `call_async`",
    ),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_same_misuse_same_error(envs, case):
    action, error, core = MISUSE[case]
    with pytest.raises(error) as raised:
        action(envs)
    assert core in str(raised.value)
    assert type(raised.value) is error
    # Still usable: nothing was sent, nothing is pending.
    assert envs.step(np.zeros(2, dtype=np.int64))[1].shape == (2,)


PENDING = {
    "step_async twice": lambda env: env.step_async(np.zeros(2, dtype=np.int64)),
    "reset while stepping": lambda env: env.reset_async(),
    "call while stepping": lambda env: env.call_async("render"),
    "fork while stepping": lambda env: env.fork("pending"),
    "set_attr while stepping": lambda env: env.set_attr("x", 1),
}


@pytest.mark.parametrize("case", list(PENDING))
def test_a_pending_call_is_refused_alike(envs, case):
    envs.step_async(np.zeros(2, dtype=np.int64))
    try:
        with pytest.raises(AlreadyPendingCallError) as raised:
            PENDING[case](envs)
        assert "while waiting for a pending call to `step` to complete" in str(raised.value)
    finally:
        envs.step_wait()


CLOSED = {
    "step": lambda env: env.step(np.zeros(2, dtype=np.int64)),
    "step_wait": lambda env: env.step_wait(),
    "reset": lambda env: env.reset(),
    "fork": lambda env: env.fork("after-close"),
    "call": lambda env: env.call("render"),
    "set_attr": lambda env: env.set_attr("x", 1),
}


@pytest.mark.parametrize("kind", KINDS)
def test_step_before_reset_is_the_sub_envs_error_alike(kind, build):
    env = build(kind)
    try:
        with pytest.raises(gym.error.ResetNeeded, match=r"before calling env\.reset"):
            env.step(np.zeros(2, dtype=np.int64))
        assert env.reset(seed=0)[0].shape == (2, 4)  # and the env is still usable
    finally:
        env.close()


@pytest.mark.parametrize("case", list(CLOSED))
def test_a_closed_env_is_refused_alike(closed, case):
    with pytest.raises(ClosedEnvironmentError, match="after a call to `close"):
        CLOSED[case](closed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("kwargs", "error", "core"),
    [
        ({"envs_per_worker": 0}, ValueError, "envs_per_worker"),
        ({"ring_bytes": 5000}, ValueError, "ring_bytes"),
        ({"worker": print}, ValueError, "custom pipe-based `worker`"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"no_such_option": 1}, TypeError, "no_such_option"),
    ],
)
def test_bad_options_are_refused_alike_before_anything_starts(kind, kwargs, error, core, build):
    if kind == "ray":
        build.start_ray()  # the cluster's processes are not what is checked
    before = descendants()
    with pytest.raises(error, match=core):
        build(kind, **kwargs)
    assert descendants() <= before

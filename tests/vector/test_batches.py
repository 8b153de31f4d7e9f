"""Batch mode (batch_size=k): send/recv as EnvPool users expect, next to step."""

from __future__ import annotations

import multiprocessing
import os
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

from gym_fork import BadActionError, ForkVectorEnv, SubEnvCrashed, SubEnvError, SubEnvTimeout
from tests.helpers import SpaceEnv

NUM_ENVS = 4


class UnevenEnv(SpaceEnv):
    """A SpaceEnv whose steps take a seeded, uneven time (0-8 ms), and that can be told
    to fail or to hang at a given step."""

    def __init__(self, fail_at=None, how="raise"):
        super().__init__(spaces.Box(-1, 1, (3,)), spaces.Discrete(3), max_len=6)
        self.fail_at, self.how, self.steps = fail_at, how, 0

    def step(self, action):
        self.steps += 1
        time.sleep(float(self.np_random.choice([0.0, 0.0005, 0.001, 0.008])))
        if self.steps == self.fail_at:
            if self.how == "raise":
                raise RuntimeError("uneven env failed on purpose")
            if self.how == "exit":
                os._exit(3)
            time.sleep(30)
        return super().step(action)


def fns(n=NUM_ENVS, **kwargs):
    return [lambda: UnevenEnv(**kwargs) for _ in range(n)]


def reference_trajectory(index: int, actions: list[int]) -> list[tuple]:
    """What sub-env ``index`` returns for ``actions`` in a plain synchronous vector env
    (same seed and autoreset mode)."""
    env = gym.vector.SyncVectorEnv([lambda: UnevenEnv()])
    obs, _ = env.reset(seed=index)
    out = [(obs[0].copy(), 0.0, False, False)]
    for a in actions:
        obs, rew, term, trunc, _ = env.step(np.array([a]))
        out.append((obs[0].copy(), float(rew[0]), bool(term[0]), bool(trunc[0])))
    env.close()
    return out


def test_every_result_reaches_its_sub_env_id_as_a_synchronous_run_gives_it():
    envs = ForkVectorEnv(fns(), batch_size=2)
    got: dict[int, list[tuple]] = {i: [] for i in range(NUM_ENVS)}
    actions: dict[int, list[int]] = {i: [] for i in range(NUM_ENVS)}
    try:
        envs.async_reset(seed=0)
        for _ in range(60):
            obs, rew, term, trunc, info = envs.recv()
            ids = info["env_id"].tolist()
            assert len(ids) == 2 and obs.shape == (2, 3)
            for j, i in enumerate(ids):
                got[i].append((obs[j].copy(), float(rew[j]), bool(term[j]), bool(trunc[j])))
            step = [(i * 7 + len(actions[i])) % 3 for i in ids]
            for i, a in zip(ids, step, strict=True):
                actions[i].append(a)
            envs.send(np.array(step), ids)
        while any(len(got[i]) <= len(actions[i]) for i in range(NUM_ENVS)):  # the rest
            obs, rew, term, trunc, info = envs.recv()
            for j, i in enumerate(info["env_id"].tolist()):
                got[i].append((obs[j].copy(), float(rew[j]), bool(term[j]), bool(trunc[j])))
    finally:
        envs.close()
    for i in range(NUM_ENVS):
        want = reference_trajectory(i, actions[i])
        assert len(got[i]) == len(want)
        for (o, r, te, tr), (wo, wr, wte, wtr) in zip(got[i], want, strict=True):
            np.testing.assert_array_equal(o, wo)
            assert (r, te, tr) == (wr, wte, wtr)


def test_step_still_works_once_every_result_is_taken():
    envs = ForkVectorEnv(fns(), batch_size=NUM_ENVS)
    try:
        envs.async_reset(seed=0)
        _obs, _r, _te, _tr, info = envs.recv()
        assert sorted(info["env_id"].tolist()) == list(range(NUM_ENVS))
        obs, *_ = envs.step(np.zeros(NUM_ENVS, dtype=np.int64))
        assert obs.shape == (NUM_ENVS, 3)
    finally:
        envs.close()


def test_misuse_is_named():
    with pytest.raises(ValueError, match="batch_size"):
        ForkVectorEnv(fns(2), batch_size=3)
    with pytest.raises(TypeError, match="batch_size"):
        ForkVectorEnv(fns(2), batch_size=1.5)
    with pytest.raises(ValueError, match="one sandbox per sub-env"):
        ForkVectorEnv(fns(2), batch_size=1, envs_per_worker=2)
    plain = ForkVectorEnv(fns(2))
    try:
        with pytest.raises(ValueError, match="batch_size=k"):
            plain.send(np.zeros(2, dtype=np.int64), [0, 1])
    finally:
        plain.close()
    envs = ForkVectorEnv(fns(), batch_size=2)
    try:
        with pytest.raises(NoAsyncCallError, match="recv"):
            envs.recv()
        with pytest.raises(ValueError, match="env_ids"):
            envs.send(np.zeros(2, dtype=np.int64))  # no recv yet: ids needed
        envs.async_reset(seed=0)
        with pytest.raises(AlreadyPendingCallError, match="recv"):
            envs.step(np.zeros(NUM_ENVS, dtype=np.int64))
        with pytest.raises(ValueError, match=r"\[0, 1, 2, 3\] still owe a result.*forking"):
            envs.fork("not-now")  # the forked sub-envs must be free
        with pytest.raises(ValueError, match="still owe a result"):
            envs.send(np.zeros(1, dtype=np.int64), [0])
        with pytest.raises(ValueError, match="sub-env indices"):
            envs.send(np.zeros(1, dtype=np.int64), [NUM_ENVS])
        _o, _r, _te, _tr, info = envs.recv()
        with pytest.raises(BadActionError, match=r"3 actions|expected 2"):
            envs.send(np.zeros(3, dtype=np.int64), info["env_id"])
    finally:
        envs.close()


def test_a_failing_sub_env_is_named_and_the_others_keep_their_results():
    envs = ForkVectorEnv([lambda: UnevenEnv(fail_at=1), *fns(NUM_ENVS - 1)], batch_size=1)
    try:
        envs.async_reset(seed=0)
        for _ in range(NUM_ENVS):
            envs.recv()
        envs.send(np.zeros(NUM_ENVS, dtype=np.int64), list(range(NUM_ENVS)))
        ids, failed = [], 0
        for _ in range(NUM_ENVS):
            try:
                ids += envs.recv()[4]["env_id"].tolist()
            except SubEnvError as exc:
                failed += 1
                assert "uneven env failed on purpose" in str(exc)
        assert failed == 1 and sorted(ids) == [1, 2, 3]
    finally:
        envs.close()


@pytest.mark.slow  # 2.2 s here
def test_a_crash_and_a_hang_are_named_and_the_finished_results_are_kept():
    crash = [lambda: UnevenEnv(fail_at=1, how="exit")]
    hang = [lambda: UnevenEnv(fail_at=1, how="hang")]
    envs = ForkVectorEnv([*crash, *hang, *fns(2)], batch_size=4, timeout=1.5)
    try:
        envs.async_reset(seed=0)
        envs.recv()
        envs.send(np.zeros(NUM_ENVS, dtype=np.int64), list(range(NUM_ENVS)))
        with pytest.raises(SubEnvCrashed, match="sub-env"):
            envs.recv()
        with pytest.raises(multiprocessing.TimeoutError, match=r"still running"):
            envs.recv(timeout=0.2)  # an explicit timeout kills nothing
        with pytest.raises(SubEnvTimeout):
            envs.recv()  # the env's own timeout kills the hung sandbox
        info = envs.recv()[4]
        assert sorted(info["env_id"].tolist()) == [2, 3]  # answered meanwhile: not lost
        envs.async_reset(seed=0)  # the dead sandboxes are replaced
        assert sorted(envs.recv()[4]["env_id"].tolist()) == list(range(NUM_ENVS))
    finally:
        envs.close()


def test_free_sub_envs_reset_and_fork_while_others_still_run_a_send():
    envs = ForkVectorEnv(
        [lambda: UnevenEnv(fail_at=1, how="hang"), lambda: UnevenEnv()], batch_size=1
    )
    try:
        envs.async_reset(seed=[0, 1])
        taken = {int(envs.recv(timeout=10)[4]["env_id"][0]) for _ in range(2)}
        assert taken == {0, 1}
        envs.send(np.array([0]), [0])  # sub-env 0 hangs in its step
        envs.async_reset(seed=[None, 5], options={"reset_mask": np.array([False, True])})
        _obs, *_rest, infos = envs.recv(timeout=10)
        assert list(infos["env_id"]) == [1]
        with pytest.raises(ValueError, match=r"\[0\] still owe a result.*resetting"):
            envs.async_reset(options={"reset_mask": np.array([True, False])})
        branch = envs.fork("beside-a-send", indices=[1], copies=2)
        try:
            assert branch.batch_size == 1
            branch.send(np.array([1, 1]), [0, 1])
            got = [branch.recv(timeout=10) for _ in range(2)]
            np.testing.assert_array_equal(got[0][0], got[1][0])  # two exact copies
        finally:
            branch.close()
    finally:
        envs.close(terminate=True)

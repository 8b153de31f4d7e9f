"""Bad input, the async state machine, crashes and clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError

from gym_fork import BadActionError, BadObservationError, ForkVectorEnv, SubEnvCrashed
from tests.helpers import SpaceEnv, alive, descendants, wait_until


def cartpoles(n=2, **kwargs):
    kwargs.setdefault("envs_per_worker", 1)
    return ForkVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(n)], **kwargs)


def test_state_machine_errors_match_async():
    envs = cartpoles()
    try:
        with pytest.raises(NoAsyncCallError, match="reset_wait` without any prior"):
            envs.reset_wait()
        with pytest.raises(NoAsyncCallError, match="step_wait` without any prior"):
            envs.step_wait()
        with pytest.raises(NoAsyncCallError, match="call_wait` without any prior"):
            envs.call_wait()
        envs.reset_async(seed=0)
        with pytest.raises(AlreadyPendingCallError, match="pending call to `reset`"):
            envs.step_async(np.array([0, 0]))
        with pytest.raises(AlreadyPendingCallError):
            envs.call_async("render")
        with pytest.raises(AlreadyPendingCallError):
            envs.set_attr("x", 1)
        envs.reset_wait()
        envs.step_async(np.array([0, 0]))
        with pytest.raises(AlreadyPendingCallError, match="pending call to `step`"):
            envs.reset_async()
        envs.step_wait()
    finally:
        envs.close()
    with pytest.raises(ClosedEnvironmentError):
        envs.reset()
    with pytest.raises(ClosedEnvironmentError):
        envs.step(np.array([0, 0]))


@pytest.mark.parametrize("pending", ["reset", "step", "call"])
def test_close_with_a_pending_call(pending):
    envs = cartpoles()
    envs.reset(seed=0)
    {
        "reset": lambda: envs.reset_async(),
        "step": lambda: envs.step_async(np.array([1, 1])),
        "call": lambda: envs.call_async("render"),
    }[pending]()
    with pytest.warns(UserWarning, match=f"pending call to `{pending}`"):
        envs.close()
    assert envs.closed


def test_close_terminate_and_double_close():
    envs = cartpoles()
    pids = envs.worker_pids
    envs.close(terminate=True)
    envs.close()
    assert wait_until(lambda: not (set(pids) & descendants()))


@pytest.mark.parametrize(
    "actions",
    [np.array([0]), np.array([0, 1, 1]), 0, np.zeros((2, 2), dtype=np.int64)],
    ids=["too-few", "too-many", "scalar", "wrong-shape"],
)
def test_bad_action_batches_are_rejected_and_lose_nothing(actions):
    envs = cartpoles()
    try:
        envs.reset(seed=0)
        with pytest.raises(BadActionError):
            envs.step(actions)
        obs, *_ = envs.step(np.array([0, 1]))  # still usable, nothing half-sent
        assert obs.shape == (2, 4)
    finally:
        envs.close()


def test_out_of_space_actions_are_caught_when_asked():
    envs = cartpoles(check_actions=True)
    try:
        envs.reset(seed=0)
        with pytest.raises(BadActionError, match=r"sub-envs \[1\]"):
            envs.step(np.array([0, 5]))
        with pytest.raises(BadActionError, match="sub-env 0"):
            envs.step([7, 0])
        envs.step(np.array([0, 1]))
    finally:
        envs.close()


def broken_env():
    raise RuntimeError("cannot build this one")


def test_an_env_fn_that_fails_to_build_is_named():
    fns = [lambda: gym.make("CartPole-v1"), broken_env, lambda: gym.make("CartPole-v1")]
    with pytest.raises(RuntimeError, match="cannot build this one") as info:
        ForkVectorEnv(fns)
    assert "while building sub-env 1" in "\n".join(info.value.__notes__)


class WrongShapeEnv(SpaceEnv):
    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (3,)))

    def step(self, action):
        _obs, *rest = super().step(action)
        return np.zeros(4, dtype=np.float32), *rest


def test_an_observation_of_the_wrong_shape_is_a_clear_error():
    envs = ForkVectorEnv([WrongShapeEnv, WrongShapeEnv])
    try:
        envs.reset(seed=0)
        with pytest.raises(BadObservationError, match=r"sub-env [01] .*\(3,\)"):
            envs.step(np.array([0, 0]))
    finally:
        envs.close()


class OddInfoEnv(SpaceEnv):
    def __init__(self, payload):
        super().__init__(spaces.Discrete(3))
        self.payload = payload

    def step(self, action):
        obs, reward, term, trunc, _ = super().step(action)
        return obs, reward, term, trunc, {"payload": self.payload()}


def test_infos_msgpack_cannot_carry_fall_back_to_pickle_or_fail_clearly():
    # A set only travels pickled: trusted=True (untrusted, tests/vector/test_untrusted.py).
    envs = ForkVectorEnv([lambda: OddInfoEnv(lambda: {1 + 2j, "x"})], trusted=True)
    try:
        envs.reset(seed=0)
        *_, info = envs.step(np.array([0]))
        assert info["payload"][0] == {1 + 2j, "x"}
    finally:
        envs.close()
    envs = ForkVectorEnv([lambda: OddInfoEnv(lambda: (x for x in ()))])  # a generator
    try:
        envs.reset(seed=0)
        with pytest.raises(TypeError, match="generator"):
            envs.step(np.array([0]))
        envs.reset(seed=0)  # and still usable
    finally:
        envs.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_killed_sandbox_raises_subenv_crashed_and_reset_replaces_it(sig):
    envs = cartpoles(3)
    try:
        envs.reset(seed=0)
        victim = envs.worker_pids[1]
        os.kill(victim, sig)
        assert wait_until(lambda: victim not in descendants())
        with pytest.raises(SubEnvCrashed, match=r"sub-env\(s\) \[1\]") as info:
            envs.step(np.array([0, 0, 0]))
        assert info.value.indices == [1]
        assert info.value.exitcode == -sig
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (3, 4)
        assert envs.worker_pids[1] != victim
        envs.step(np.array([0, 0, 0]))
    finally:
        envs.close()


def test_a_crash_in_a_shared_worker_names_every_sub_env_it_hosted():
    envs = cartpoles(4, envs_per_worker=2)
    try:
        envs.reset(seed=0)
        assert len(envs.worker_pids) == 2
        os.kill(envs.worker_pids[1], signal.SIGKILL)
        with pytest.raises(SubEnvCrashed) as info:
            envs.step(np.array([0, 0, 0, 0]))
        assert info.value.indices == [2, 3]
        envs.reset(seed=0)
        envs.step(np.array([0, 0, 0, 0]))
    finally:
        envs.close()


def test_a_sandbox_dying_mid_step_is_reported_within_its_slice():
    class Suicide(SpaceEnv):
        def __init__(self):
            super().__init__(spaces.Discrete(3))

        def step(self, action):
            if action == 2:
                os._exit(3)
            return super().step(action)

    envs = ForkVectorEnv([Suicide, Suicide], envs_per_worker=1)
    try:
        envs.reset(seed=0)
        start = time.monotonic()
        with pytest.raises(SubEnvCrashed, match="exited with code 3"):
            envs.step(np.array([0, 2]))
        assert time.monotonic() - start < 2.0
        envs.reset(seed=1)
        envs.step(np.array([0, 1]))
    finally:
        envs.close()


def test_sandboxes_die_within_two_seconds_of_a_sigkilled_controller(tmp_path):
    script = tmp_path / "controller.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time, gymnasium as gym
            from gym_fork import ForkVectorEnv
            fns = [lambda: gym.make("CartPole-v1") for _ in range(3)]
            envs = ForkVectorEnv(fns, envs_per_worker=1)
            envs.reset(seed=0)
            print(" ".join(map(str, envs.worker_pids)), flush=True)
            time.sleep(60)
            """
        )
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3
        everything = descendants(proc.pid)
        assert set(pids) <= everything
        proc.kill()
        proc.wait()
        start = time.monotonic()
        assert wait_until(lambda: not (everything & alive(everything)), 2.0)
        assert time.monotonic() - start < 2.0
    finally:
        proc.kill()
        proc.stdout.close()

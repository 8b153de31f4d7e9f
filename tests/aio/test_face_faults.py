"""gym_fork/aio under faults: hung, stopped, crashed and refused sub-envs, closes that
must not wait for what nobody awaits (found by a cold review of the first version)."""

from __future__ import annotations

import asyncio
import fractions
import os
import signal
import time

import pytest
from gymnasium import spaces
from gymnasium.error import ClosedEnvironmentError

from gym_fork import PickleRefused, SubEnvCrashed, SubEnvTimeout
from gym_fork.aio import AsyncForkVectorEnv
from tests.aio.test_face import engine_threads, run, timed
from tests.helpers import SpaceEnv, wait_until
from tests.vector.test_batches import UnevenEnv


class PickyEnv(SpaceEnv):
    """Steps take 50 ms; ``bad``: its info holds what only a pickle carries (refused from
    an untrusted sandbox). Its info keeps keys a vector env would read as its own."""

    def __init__(self, bad: bool = False):
        super().__init__(spaces.Box(-1, 1, (3,)), spaces.Discrete(3), max_len=1000, trunc_prob=0)
        self.bad = bad

    def step(self, action):
        time.sleep(0.05)
        obs, reward, term, trunc, _info = super().step(action)
        info = {"env_id": "agent-7", "_private": 3, "private": 4}
        if self.bad:
            info["frac"] = fractions.Fraction(1, 3)
        return obs, reward, term, trunc, info


@pytest.mark.slow  # 5.5 s here: the timeout itself
def test_the_envs_own_timeout_ends_a_hung_step_and_a_reset_replaces_its_sandbox():
    async def main():
        async with await AsyncForkVectorEnv.open(timed(2, 60.0), timeout=5.0) as envs:
            await asyncio.gather(envs.reset(0), envs.reset(1))
            started = time.monotonic()
            with pytest.raises(SubEnvTimeout, match=r"timeout=5\.0"):
                await asyncio.wait_for(envs.step(0, 0), 40)
            assert time.monotonic() - started < 30
            await envs.reset(0)  # a fresh sandbox for it
            return envs.closed

    assert run(main()) is False


@pytest.mark.slow  # 1.5 s here: a stop is named after 1 s
def test_a_stopped_sandbox_is_resumed_while_its_step_is_awaited():
    async def main():
        async with await AsyncForkVectorEnv.open(timed(1, 0.3)) as envs:
            await envs.reset(0)
            step = asyncio.ensure_future(envs.step(0, 0))
            await asyncio.sleep(0.02)
            os.kill(envs._env.worker_pids[0], signal.SIGSTOP)
            with pytest.warns(UserWarning, match="SIGCONT"):
                result = await asyncio.wait_for(step, 20)
            return result

    assert run(main())[4]["n"] == 1


def test_a_crash_beside_a_reset_of_another_sub_env_fails_its_own_step():
    async def main():
        async with await AsyncForkVectorEnv.open(
            [lambda: UnevenEnv(), lambda: UnevenEnv(fail_at=1, how="exit")]
        ) as envs:
            await asyncio.gather(envs.reset(0), envs.reset(1))
            crashing = asyncio.ensure_future(envs.step(1, 0))
            envs._engine.post(lambda _call: time.sleep(0.3))  # busy: the crash lands first
            await envs.reset(0)  # does not replace the dead sandbox whose step is owed
            with pytest.raises(SubEnvCrashed, match="exit"):
                await asyncio.wait_for(crashing, 20)
            await envs.reset(1)  # now it is replaced (its env would exit again at a step)
            return envs._env.worker_pids[1]

    run(main())


def test_one_refused_reply_fails_its_own_call_and_the_others_get_their_results():
    async def main():
        envs = await AsyncForkVectorEnv.open(
            [lambda: PickyEnv(False), lambda: PickyEnv(True), lambda: PickyEnv(False)],
            trusted=False,
        )
        try:
            await asyncio.gather(*(envs.reset(i) for i in range(3)))
            steps = [asyncio.ensure_future(envs.step(i, 0)) for i in (0, 1)]
            await asyncio.sleep(0)
            envs._engine.post(lambda _call: time.sleep(0.3))  # both replies land meanwhile
            good, bad = await asyncio.gather(*steps, return_exceptions=True)
            assert isinstance(bad, PickleRefused), bad
            assert not isinstance(good, BaseException), good
            assert good[4] == {"env_id": "agent-7", "_private": 3, "private": 4}  # as returned
            third = await asyncio.wait_for(envs.step(2, 0), 20)
            assert third[4]["private"] == 4
            assert envs._engine._thread.is_alive()
        finally:
            await envs.close()
        assert envs.closed and envs._env.closed

    run(main())
    assert wait_until(lambda: not engine_threads()), engine_threads()


def test_a_call_cancelled_while_waiting_for_the_budget_frees_its_sub_env_at_once():
    async def main():
        async with await AsyncForkVectorEnv.open(timed(2, 0.5), max_concurrency=1) as envs:
            await envs.reset(0)
            await envs.reset(1)
            first = asyncio.ensure_future(envs.step(0, 0))
            await asyncio.sleep(0.02)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(envs.step(1, 0), 0.05)  # never sent
            retry = await asyncio.wait_for(envs.step(1, 0), 20)  # not "already running"
            await first
            return retry

    assert run(main())[4]["n"] == 1


def test_leaving_async_with_by_an_error_does_not_wait_for_a_hung_step():
    async def main():
        with pytest.raises(KeyError):
            async with await AsyncForkVectorEnv.open(timed(1, 30.0)) as envs:
                await envs.reset(0)
                hung = asyncio.ensure_future(envs.step(0, 0))
                await asyncio.sleep(0.1)
                raise KeyError("the agent's own bug")
        with pytest.raises(ClosedEnvironmentError):
            await hung  # its sandbox was killed: nobody waited for the 30 s step
        return envs

    started = time.monotonic()
    envs = run(main())
    assert envs.closed and time.monotonic() - started < 15
    assert wait_until(lambda: not engine_threads()), engine_threads()

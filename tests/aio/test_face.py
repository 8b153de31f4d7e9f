"""gym_fork/aio: awaitable reset/step/fork/close, each sub-env at its own pace."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.error import ClosedEnvironmentError

from gym_fork import SubEnvError
from gym_fork.aio import AsyncForkVectorEnv
from tests.helpers import (
    SpaceEnv,
    alive,
    descendants,
    marked_processes,
    wait_until,
    why_no_frozen_layers,
)
from tests.vector.test_batches import UnevenEnv


class TimedEnv(SpaceEnv):
    """Each step sleeps ``seconds`` and reports when it ran (CLOCK_MONOTONIC is one clock
    for every process), and its step count; action 2 raises."""

    def __init__(self, seconds: float = 0.0, trunc_prob: float = 0.05):
        super().__init__(
            spaces.Box(-1, 1, (3,)), spaces.Discrete(3), max_len=1000, trunc_prob=trunc_prob
        )
        self.seconds, self.steps = seconds, 0

    def step(self, action):
        if int(action) == 2:
            raise RuntimeError("timed env refused action 2")
        started = time.monotonic()
        time.sleep(self.seconds)
        self.steps += 1
        obs, reward, term, trunc, info = super().step(action)
        return (
            obs,
            reward,
            term,
            trunc,
            {**info, "ran": (started, time.monotonic()), "n": self.steps},
        )


def timed(n: int, seconds: float = 0.0, trunc_prob: float = 0.05):
    return [lambda: TimedEnv(seconds, trunc_prob) for _ in range(n)]


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gym_fork-aio"]


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = most = 0
    for _t, step in events:
        now += step
        most = max(most, now)
    return most


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_each_episode_is_what_a_synchronous_run_gives_it_whatever_the_pace_of_the_others():
    actions = {i: [int(a) for a in np.random.default_rng(i).integers(0, 3, 12)] for i in range(4)}

    async def episode(envs, i):
        obs, _info = await envs.reset(i, seed=i)
        got = [(obs, 0.0, False, False)]
        for a in actions[i]:
            obs, reward, term, trunc, _info = await envs.step(i, a)
            got.append((obs, reward, term, trunc))
            if term or trunc:
                obs, _info = await envs.reset(i, seed=i)  # gone on with its own reset
                got.append((obs, 0.0, False, False))
        return got

    async def main():
        async with await AsyncForkVectorEnv.open([lambda: UnevenEnv()] * 4) as envs:
            return await asyncio.gather(*(episode(envs, i) for i in range(4)))

    for i, got in enumerate(run(main())):
        want = _alone(i, actions[i])
        assert len(got) == len(want)
        for (o, r, te, tr), (wo, wr, wte, wtr) in zip(got, want, strict=True):
            np.testing.assert_array_equal(o, wo)
            assert (r, te, tr) == (wr, wte, wtr)
    assert wait_until(lambda: not engine_threads()), engine_threads()


def _alone(seed: int, actions: list[int]) -> list[tuple]:
    """The same episode loop on a plain UnevenEnv in this process."""
    env = UnevenEnv()
    obs, _info = env.reset(seed=seed)
    out = [(obs, 0.0, False, False)]
    for a in actions:
        obs, reward, term, trunc, _info = env.step(a)
        out.append((obs, float(reward), term, trunc))
        if term or trunc:
            obs, _info = env.reset(seed=seed)
            out.append((obs, 0.0, False, False))
    return out


@pytest.mark.parametrize("limit", [1, 2, None])
def test_max_concurrency_bounds_the_sub_envs_running_at_once(limit):
    async def main():
        async with await AsyncForkVectorEnv.open(timed(4, 0.15), max_concurrency=limit) as envs:
            await asyncio.gather(*(envs.reset(i) for i in range(4)))
            results = await asyncio.gather(*(envs.step(i, i % 2) for i in range(4)))
            return [info["ran"] for *_rest, info in results]

    most = most_at_once(run(main()))
    if limit is None:
        assert most > 2  # four 0.15 s sleeps sent together: the bound below is the budget's
    else:
        assert most <= limit


@pytest.mark.slow  # 1.2 s here
def test_reset_and_fork_run_beside_a_sub_env_that_is_still_stepping():
    async def main():
        async with await AsyncForkVectorEnv.open(
            [lambda: TimedEnv(0.0), lambda: TimedEnv(1.0)]
        ) as envs:
            await asyncio.gather(envs.reset(0, seed=3), envs.reset(1))
            slow = asyncio.ensure_future(envs.step(1, 0))
            await asyncio.sleep(0.05)  # sub-env 1 is in its 1 s step
            await envs.step(0, 1)
            await envs.reset(0, seed=3)
            branch = await envs.fork("beside-the-slow-one", indices=[0], copies=2)
            assert not slow.done()  # both came while sub-env 1 still ran
            with pytest.raises(ValueError, match=r"\[1\] still owe a result"):
                await envs.fork("not-the-running-one", indices=[1])
            source = await envs.step(0, 1)
            copies = await asyncio.gather(branch.step(0, 1), branch.step(1, 1))
            await branch.close()
            await slow
            return source, copies

    source, copies = run(main())
    for copy in copies:  # a branch replays its source exactly (no reseed)
        np.testing.assert_array_equal(copy[0], source[0])
        assert copy[4]["n"] == source[4]["n"] == 2


def test_a_failing_step_fails_its_own_await_only():
    async def main():
        async with await AsyncForkVectorEnv.open(timed(2)) as envs:
            await asyncio.gather(envs.reset(0), envs.reset(1))
            with pytest.warns(UserWarning, match="refused action 2"):  # as AsyncVectorEnv
                bad, good = await asyncio.gather(
                    envs.step(0, 2), envs.step(1, 1), return_exceptions=True
                )
            assert isinstance(bad, SubEnvError) and "refused action 2" in str(bad)
            assert good[4]["n"] == 1
            again = await envs.step(0, 1)  # the sub-env that raised goes on
            return again

    assert run(main())[4]["n"] == 1


def test_misuse_is_named():
    async def main():
        envs = await AsyncForkVectorEnv.open(timed(2, 0.2))
        await envs.reset(0)
        with pytest.raises(ValueError, match=r"index must be a sub-env index in \[0, 2\)"):
            await envs.step(2, 0)
        first = asyncio.ensure_future(envs.step(0, 0))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="sub-env 0 is already running a call"):
            await envs.step(0, 0)
        await first
        with pytest.raises(ValueError, match="reset_mask"):
            await envs.reset(1, options={"reset_mask": np.ones(2, bool)})
        await envs.close()
        with pytest.raises(ClosedEnvironmentError):
            await envs.step(0, 0)
        await envs.close()  # twice: nothing

    run(main())
    assert wait_until(lambda: not engine_threads()), engine_threads()


def test_a_cancelled_await_drops_its_result_and_the_sub_env_goes_on():
    async def main():
        # never truncated: a truncation at its first step makes the second an autoreset
        async with await AsyncForkVectorEnv.open(timed(1, 0.3, trunc_prob=0.0)) as envs:
            await envs.reset(0)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await envs.step(0, 0)  # sent: it runs to its end in the sub-env
            with pytest.raises(ValueError, match="already running"):
                await envs.step(0, 0)
            await asyncio.sleep(0.4)  # its result came and was dropped
            return await envs.step(0, 0)

    assert run(main())[4]["n"] == 2  # the cancelled step did run


@pytest.mark.slow  # 1.2 s here
def test_a_call_cancelled_before_its_budget_allowed_it_is_never_sent():
    async def main():
        async with await AsyncForkVectorEnv.open(timed(2, 0.3), max_concurrency=1) as envs:
            await envs.reset(0)
            await envs.reset(1)
            first = asyncio.ensure_future(envs.step(0, 0))
            second = asyncio.ensure_future(envs.step(1, 0))
            await asyncio.sleep(0.05)
            second.cancel()  # still waiting for the budget
            await first
            await asyncio.sleep(0.4)
            return await envs.step(1, 0)

    assert run(main())[4]["n"] == 1


def test_cancelling_the_task_mid_step_leaves_no_sandbox_thread_or_branch():
    before = descendants()
    seen: list[set[int]] = []

    async def agent():
        async with await AsyncForkVectorEnv.open(timed(2, 5.0)) as envs:
            await asyncio.gather(envs.reset(0), envs.reset(1))
            async with await envs.fork("cancelled-too", indices=[0], copies=2) as branch:
                steps = [envs.step(0, 0), envs.step(1, 0), branch.step(0, 0), branch.step(1, 0)]
                running = asyncio.gather(*steps)
                await asyncio.sleep(0.2)
                seen.append(descendants() - before)
                await running

    async def main():
        task = asyncio.ensure_future(agent())
        while not seen:
            await asyncio.sleep(0.05)
        task.cancel()  # four 5 s steps are running
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    run(main())
    assert len(seen[0]) >= 4, seen  # root and branch sandboxes (and their warm parent)
    assert not alive(seen[0]), alive(seen[0])  # closed before the task ended
    assert wait_until(lambda: not engine_threads()), engine_threads()
    assert time.monotonic() - started < 60


class WritesItsWorkspace(TimedEnv):
    """A TimedEnv whose reset writes a file into /tmp: its fork freezes that layer."""

    def reset(self, *, seed=None, options=None):
        with open("/tmp/workspace.txt", "w") as f:
            f.write("written\n")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if int(action) != 1:
            return super().step(action)
        from gym_fork.system import layer_slots  # action 1: at once, its layers' count

        obs = self.observation_space.sample()
        return obs, 0.0, False, False, {"layers": len(layer_slots.layer_paths())}


@pytest.mark.skipif(bool(why_no_frozen_layers()), reason=why_no_frozen_layers() or "-")
def test_cancelled_after_forking_a_written_workspace_leaves_no_layer_or_helper():
    """The fork froze the source's /tmp (a layer helper process, mounts in the sandboxes'
    namespaces): a cancelled task leaves neither (the helper is a child of this process:
    the leak check sees it)."""
    seen: list[int] = []

    async def agent():
        async with await AsyncForkVectorEnv.open([lambda: WritesItsWorkspace(5.0)]) as envs:
            await envs.reset(0)
            async with await envs.fork("frozen", indices=[0], copies=1) as branch:
                seen.append((await branch.step(0, 1))[4]["layers"])
                await asyncio.gather(envs.step(0, 0), branch.step(0, 0))

    async def main():
        task = asyncio.ensure_future(agent())
        while not seen:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        task.cancel()  # two 5 s steps are running
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert seen == [1]  # the branch stood on its source's frozen layer
    assert wait_until(lambda: not engine_threads()), engine_threads()


def test_cancelled_while_it_opens_nothing_is_left():
    async def main():
        for delay in (0.0, 0.05, 0.3):
            task = asyncio.ensure_future(AsyncForkVectorEnv.open(timed(2)))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                face = await task
            except asyncio.CancelledError:
                continue
            await face.close()  # it opened before the cancel reached it

    run(main())
    assert wait_until(lambda: not engine_threads(), 5.0), engine_threads()
    assert wait_until(lambda: not marked_processes(), 5.0), marked_processes()


def test_a_script_that_never_closes_leaves_nothing_after_it_exits(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, os, sys
            sys.path.insert(0, os.getcwd())
            from gym_fork.aio import AsyncForkVectorEnv
            from tests.aio.test_face import timed

            async def main():
                envs = await AsyncForkVectorEnv.open(timed(2))
                await envs.reset(0)
                branch = await envs.fork("never-closed", indices=[0], copies=2)
                await branch.step(0, 1)
                print("pid", os.getpid(), flush=True)

            asyncio.run(main())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=os.getcwd(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[1])
    assert wait_until(lambda: not marked_processes(pid), 5.0), marked_processes(pid)
    assert "Traceback" not in done.stderr, done.stderr

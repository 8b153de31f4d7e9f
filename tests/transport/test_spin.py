"""The spin of ring waits follows the steps they wait on (gym_fork/transport/spin.py):
long steps (1 ms or more) make both ends spin LONG_SPIN rounds, short ones keep
GYM_FORK_SPIN's; a polling ring (microVM) keeps its own."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.transport.region import Region
from gym_fork.transport.ring import DEFAULT_SPIN, Ring, ring_bytes
from gym_fork.transport.spin import LONG_AFTER_S, LONG_SPIN, SpinChoice, apply
from gym_fork.worker import protocol as P
from tests.helpers import SpaceEnv
from tests.worker.test_loop import Harness

pytestmark = pytest.mark.skipif(
    LONG_SPIN == DEFAULT_SPIN, reason="GYM_FORK_LONG_SPIN equals GYM_FORK_SPIN here: one spin"
)


def test_long_steps_choose_the_long_spin_and_short_ones_bring_it_back():
    choice = SpinChoice()
    assert choice.observe(LONG_AFTER_S / 10) == DEFAULT_SPIN
    rounds = [choice.observe(3 * LONG_AFTER_S) for _ in range(30)]
    assert rounds[0] == DEFAULT_SPIN  # one long step alone does not switch (an average)
    assert rounds[-1] == LONG_SPIN
    rounds = [choice.observe(LONG_AFTER_S / 100) for _ in range(40)]
    assert rounds[-1] == DEFAULT_SPIN


def test_a_polling_ring_keeps_its_own_spin():
    region = Region(2 * ring_bytes(1 << 12), name="gym_fork-test-spin")
    try:
        futex = Ring(region, 0, 1 << 12, create=True, name="futex")
        polling = Ring(region, ring_bytes(1 << 12), 1 << 12, create=True, name="poll", poll=True)
        before = polling.spin
        apply([futex, polling], LONG_SPIN)
        assert futex.spin == LONG_SPIN
        assert polling.spin == before
    finally:
        region.close()


class SlowStep(SpaceEnv):
    """A step of 3 ms (a Pong-sized one)."""

    def step(self, action):
        time.sleep(0.003)
        return super().step(action)


def test_a_worker_waits_for_its_next_request_spinning_long_after_long_steps():
    fast = Harness([4, 5])
    slow = Harness([4, 5], env_class=SlowStep)
    try:
        for harness in (fast, slow):
            assert harness.channel.recv(5.0)[0] == P.HELLO
            harness.attach()
            harness.request(P.RESET, [[1, None, True], [2, None, True]])
            for _ in range(30):
                harness.request(P.STEP, [0, 0])
        assert fast.worker.channel.inbox.spin == DEFAULT_SPIN
        assert slow.worker.channel.inbox.spin == LONG_SPIN
    finally:
        fast.close()
        slow.close()


class SlowCartPole(gym.Wrapper):
    delay = 0.003

    def step(self, action):
        time.sleep(self.delay)
        return self.env.step(action)


def slow_cartpole():
    return SlowCartPole(gym.make("CartPole-v1"))


def cartpole():
    return gym.make("CartPole-v1")


def reply_spins(envs: ForkVectorEnv) -> set[int]:
    return {worker.channel.inbox.spin for worker in envs.sandboxes.pool.workers}


def waited(envs: ForkVectorEnv) -> float:
    """The controller's moving average of its waits for a step's first reply."""
    return envs.sandboxes.pool._spin.average


def chosen(envs: ForkVectorEnv) -> int:
    """The spin that average calls for: a loaded box makes even CartPole's waits long,
    so the short case is asserted against what the controller measured."""
    return LONG_SPIN if waited(envs) >= LONG_AFTER_S else DEFAULT_SPIN


@pytest.mark.process_only
def test_the_controller_waits_for_long_steps_spinning_long_and_new_sandboxes_too():
    actions = np.zeros(2, dtype=np.int64)
    with (
        contextlib.closing(ForkVectorEnv.from_parent(slow_cartpole, 2)) as slow,
        contextlib.closing(ForkVectorEnv([cartpole] * 2)) as fast,
    ):
        for envs in (slow, fast):
            envs.reset(seed=0)
            for _ in range(30):
                envs.step(actions)
        assert reply_spins(fast) == {chosen(fast)}
        assert waited(slow) >= LONG_AFTER_S
        assert reply_spins(slow) == {LONG_SPIN}
        slow.reset(seed=1)  # reset_mode="clone": new sandboxes, their rings new
        slow.step(actions)
        assert reply_spins(slow) == {LONG_SPIN}
        slow.set_attr("delay", 0.0)  # the same sandboxes' steps become short
        for _ in range(60):
            slow.step(actions)
        assert reply_spins(slow) == {chosen(slow)}


@pytest.mark.parametrize(
    ("given", "long_spin"),
    [
        ({"GYM_FORK_SPIN": "0"}, 0),
        ({"GYM_FORK_SPIN": "9000"}, 9000),
        ({"GYM_FORK_SPIN": "10", "GYM_FORK_LONG_SPIN": "3000"}, 3000),
        ({"GYM_FORK_SPIN": "500", "GYM_FORK_LONG_SPIN": "-5"}, 500),
        ({"GYM_FORK_LONG_SPIN": str(1 << 40)}, 0x7FFFFFFF),
    ],
)
def test_the_long_spin_keeps_a_spin_the_user_set_and_stays_in_range(given, long_spin):
    code = "from gym_fork.transport.spin import LONG_SPIN; print(LONG_SPIN)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYM_FORK_")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == long_spin

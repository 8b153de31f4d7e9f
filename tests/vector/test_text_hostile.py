"""Text values a buggy or hostile sandbox writes: what the controller hands its user.

The envs below reach into their own sandbox's worker (found with ``gc``), as env code
can, to write what the worker would never write for them.
"""

from __future__ import annotations

import gc
import string
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv
from gym_fork.errors import BadObservationError
from gym_fork.transport.space_codec import space_from_data, space_to_data
from gym_fork.vector.spaces import empty_buffer

LETTERS = string.ascii_lowercase


def _sandbox_objects(kind_name: str) -> list:
    return [o for o in gc.get_objects() if type(o).__name__ == kind_name]


class RowFlippingEnv(gym.Env):
    """Its first step starts a thread that rewrites its slab row without end, between a
    valid code and one far past the charset."""

    observation_space = spaces.Text(256, min_length=0, charset=LETTERS)
    action_space = spaces.Discrete(2)

    def __init__(self, hostile: bool) -> None:
        self.hostile = hostile
        self.started = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "abc", {}

    def step(self, action):
        if self.hostile and not self.started:
            self.started = True
            rows = [leaf.array for leaf in _sandbox_objects("_TextLeaf") if leaf.array is not None]
            threading.Thread(target=self._flip, args=(rows,), daemon=True).start()
        return "abc", 0.0, False, False, {}

    @staticmethod
    def _flip(rows) -> None:
        while True:
            for row in rows:
                row[:] = 0
                row[:] = 1 << 30


class RingTextEnv(gym.Env):
    """Resets to "a", then returns ``value`` from step, with observations in ring
    records (what a sandbox sends there is the controller's to check)."""

    observation_space = spaces.Text(8, min_length=0, charset="abc")
    action_space = spaces.Discrete(2)

    def __init__(self, value) -> None:
        self.value = value

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "a", {}

    def step(self, action):
        return self.value, 0.0, False, False, {}


def test_a_row_rewritten_while_the_controller_reads_it_still_gives_texts_of_the_space() -> None:
    # Read twice from shared memory (the mask, then the codes), a code changed in
    # between indexed past the charset: a bare IndexError lost every sub-env's step.
    envs = ForkVectorEnv([lambda: RowFlippingEnv(True), lambda: RowFlippingEnv(False)])
    try:
        envs.reset(seed=0)
        space = envs.single_observation_space
        deadline, steps = time.monotonic() + 1.5, 0
        while time.monotonic() < deadline or steps < 50:
            obs, *_ = envs.step([0, 0])
            assert all(space.contains(o) for o in obs), [o[:20] for o in obs]
            assert obs[1] == "abc"
            steps += 1
        branch = envs.fork("from-the-flipping-one", indices=[0], copies=2)
        try:
            assert all(space.contains(o) for o in branch.step([0, 0])[0])
        finally:
            branch.close()
    finally:
        envs.close()


@pytest.mark.parametrize(
    "value, problem",
    [(5, "expected a str"), ("a" * 9, "9 characters"), ("abz", "'z' is not in its charset")],
)
def test_texts_in_ring_records_are_checked_as_slab_rows_are(value, problem) -> None:
    envs = ForkVectorEnv(
        [lambda: RingTextEnv(value), lambda: RingTextEnv("ab")], shared_memory=False
    )
    try:
        envs.reset(seed=0)
        with pytest.raises(BadObservationError, match=f"sub-env 0's sandbox sent .*{problem}"):
            envs.step([0, 0])
    finally:
        envs.close()
    # A trusted vector env's sandboxes may send any object: handed over as Async does.
    envs = ForkVectorEnv(
        [lambda: RingTextEnv(value)], shared_memory=False, trusted=True, lineage_log=False
    )
    try:
        envs.reset(seed=0)
        assert envs.step([0])[0] == (value,)
    finally:
        envs.close()


def test_in_batch_mode_a_bad_text_leaves_the_other_results_for_the_next_recv() -> None:
    envs = ForkVectorEnv(
        [lambda: RingTextEnv("ab"), lambda: RingTextEnv("zz")], shared_memory=False, batch_size=2
    )
    try:
        envs.async_reset(seed=0)
        envs.recv()
        envs.send(np.array([0, 0]), [0, 1])
        with pytest.raises(BadObservationError, match="sub-env 1's sandbox sent"):
            envs.recv()  # both results taken: sub-env 0's is not lost with it
        obs, _rew, _term, _trunc, info = envs.recv()
        assert info["env_id"].tolist() == [0] and obs == ("ab",)
    finally:
        envs.close()


def test_a_declared_min_length_costs_the_controller_nothing_at_construction() -> None:
    # Gymnasium's empty batch writes min_length characters per entry: 2**30 of them cost
    # 1 GiB of the controller per sub-env, whatever the env later returns.
    huge = spaces.Text(1 << 26, min_length=1 << 26, charset="ab")
    nested = spaces.Dict(
        {
            "t": huge,
            "n": spaces.Tuple([huge, spaces.Discrete(3)]),
            "s": spaces.Sequence(huge, stack=True),
        }
    )
    batch = empty_buffer(nested, 2)
    texts = [*batch["t"], *batch["n"][0], *(t for (t,) in batch["s"])]
    assert [len(t) for t in texts] == [0] * 6
    assert batch["n"][1].shape == (2,) and batch["n"][1].dtype == spaces.Discrete(3).dtype


def test_a_text_space_keeps_its_charset_order_through_the_codec() -> None:
    # Sent as a set's join, the order (and every seeded sample) changed per interpreter.
    space = spaces.Text(6, charset="zyxabc")
    back = space_from_data(space_to_data(space), trusted=False)
    assert back.character_list == tuple("zyxabc")
    space.seed(3)
    back.seed(3)
    assert [space.sample() for _ in range(5)] == [back.sample() for _ in range(5)]

"""gym_fork.vector.frontend without sandboxes: fork planning, seeds, reset_mask, set_attr
values and the async state machine (milliseconds)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError

from gym_fork.vector.frontend import (
    AsyncFrontEnd,
    AsyncState,
    plan_fork,
    reset_mask,
    seeds_per_env,
    values_per_env,
)


def test_plan_fork_orders_by_source_then_copy():
    plan = plan_fork("b", [3, 1], 2, None, 4)
    assert plan.indices == [3, 1] and plan.copies == 2
    assert plan.sources == [3, 3, 1, 1]
    assert plan.seeds == [None] * 4 and not plan.reseeded


def test_plan_fork_defaults_to_every_sub_env_and_takes_numpy_ints():
    assert plan_fork("b", None, 1, None, 3).sources == [0, 1, 2]
    plan = plan_fork("b", np.array([2, 0]), np.int64(1), np.int64(5), 3)
    assert plan.sources == [2, 0] and plan.seeds == [5, 6] and plan.reseeded
    assert all(type(i) is int for i in plan.sources + plan.seeds)


def test_plan_fork_reseed_forms():
    assert plan_fork("b", [0], 3, 10, 1).seeds == [10, 11, 12]
    assert plan_fork("b", [0], 2, [7, None], 1).seeds == [7, None]
    assert plan_fork("b", [0], 2, [None, None], 1).reseeded


@pytest.mark.parametrize(
    ("args", "error", "text"),
    [
        (("", None, 1, None), TypeError, "branch_id must be a non-empty str"),
        ((3, None, 1, None), TypeError, "branch_id"),
        (("b", "01", 1, None), TypeError, "sequence of ints"),
        (("b", 0, 1, None), TypeError, "sequence of ints"),
        (("b", [], 1, None), ValueError, "at least one sub-env"),
        (("b", [0.0], 1, None), TypeError, "must be ints, got [0.0]"),
        (("b", [True], 1, None), TypeError, "must be ints"),
        (("b", [4], 1, None), ValueError, "in [0, 4), got [4]"),
        (("b", [-1], 1, None), ValueError, "in [0, 4), got [-1]"),
        (("b", [0], True, None), ValueError, "copies must be an int >= 1, got True"),
        (("b", [0], 0, None), ValueError, "copies"),
        (("b", [0], 1.0, None), ValueError, "copies"),
        (("b", [0], 2, [1]), ValueError, "one seed per branch sub-env (2), got 1"),
        (("b", [0], 1, [1.5]), TypeError, "reseed must hold ints or None"),
        (("b", [0], 1, "7"), TypeError, "reseed must be None, an int"),
        (("b", [0], 1, 2.0), TypeError, "reseed must be None, an int"),
        (("b", [0], 1, -1), ValueError, "seeds must be >= 0, got [-1]"),
        (("b", [0], 2, [3, -4]), ValueError, "seeds must be >= 0, got [-4]"),
    ],
)
def test_plan_fork_names_the_bad_argument(args, error, text):
    with pytest.raises(error) as raised:
        plan_fork(*args, 4)
    assert text in str(raised.value)


def test_plan_fork_checks_the_sandbox_ceiling_with_what_is_held(monkeypatch):
    monkeypatch.setenv("GYM_FORK_MAX_SANDBOXES", "10")
    plan_fork("b", [0], 10, None, 1)
    with pytest.raises(ValueError, match="fork\\('b'\\) asks for 11 sandboxes; the ceiling is 10"):
        plan_fork("b", [0], 10, None, 1, held=1)
    with pytest.raises(ValueError, match="ceiling"):
        plan_fork("b", [0], 10**9, None, 1)


def test_seeds_per_env():
    assert seeds_per_env(None, 3) == [None] * 3
    assert seeds_per_env(5, 3) == [5, 6, 7]
    assert seeds_per_env(np.int32(5), 2) == [5, 6]
    assert seeds_per_env([1, None], 2) == [1, None]
    with pytest.raises(ValueError, match="the length must match num_envs=2 but got length=1"):
        seeds_per_env([1], 2)
    with pytest.raises(TypeError, match="seed must be None, an int"):
        seeds_per_env(1.5, 2)


def test_values_per_env():
    assert values_per_env(7, 3) == [7, 7, 7]
    assert values_per_env((1, 2), 2) == (1, 2)
    with pytest.raises(ValueError, match="Got `1` values for 2 environments"):
        values_per_env([1], 2)


def test_reset_mask_is_taken_out_of_the_options():
    options = {"reset_mask": np.array([True, False]), "x": 1}
    rest, mask = reset_mask(options, 2)
    assert rest == {"x": 1} and mask.tolist() == [True, False]
    assert "reset_mask" in options  # the caller's dict is not changed
    rest, mask = reset_mask(None, 3)
    assert rest is None and mask.tolist() == [True] * 3
    rest, mask = reset_mask({"y": 2}, 2)
    assert rest == {"y": 2} and mask.all()


@pytest.mark.parametrize(
    ("mask", "error", "text"),
    [
        ([True, False], TypeError, "must be a numpy array"),
        (np.array([1, 0]), TypeError, "dtype=np.bool_"),
        (np.array([True]), ValueError, "shape `(2,)`"),
        (np.array([[True, True]]), ValueError, "shape `(2,)`"),
        (np.array([False, False]), ValueError, "at least one True value"),
    ],
)
def test_reset_mask_refusals_match_async_vector_env(mask, error, text):
    with pytest.raises(error) as raised:
        reset_mask({"reset_mask": mask}, 2)
    assert text in str(raised.value)


class Machine(AsyncFrontEnd):
    """The state machine alone: ``*_wait`` of a pending call returns or times out."""

    def __init__(self, wait_raises: BaseException | None = None) -> None:
        self.num_envs = 2
        self.closed = False
        self._state = AsyncState.DEFAULT
        self.waited: list[float | None] = []
        self.wait_raises = wait_raises

    def step_wait(self, timeout=None):
        self.waited.append(timeout)
        self._state = AsyncState.DEFAULT
        if self.wait_raises is not None:
            raise self.wait_raises


def test_the_state_machine_refuses_like_async_vector_env():
    env = Machine()
    with pytest.raises(
        NoAsyncCallError, match="`step_wait` without any prior call to `step_async`"
    ):
        env._not_waiting(AsyncState.WAITING_STEP)
    env._state = AsyncState.WAITING_STEP
    with pytest.raises(AlreadyPendingCallError, match=r"pending call to `step` to complete\.") as e:
        env._begin("call_async")
    assert e.value.name == "step"
    with pytest.raises(AlreadyPendingCallError, match=r"to complete$"):
        env._plan_reset(None, None)  # AsyncVectorEnv's reset message has no full stop
    env.closed = True
    with pytest.raises(ClosedEnvironmentError, match="Trying to operate on `Machine`"):
        env._begin("step_async")
    with pytest.raises(ClosedEnvironmentError):
        env._not_waiting(AsyncState.WAITING_RESET)


def test_reset_checks_come_in_async_vector_envs_order():
    env = Machine()
    env._state = AsyncState.WAITING_STEP
    with pytest.raises(ValueError, match="length must match"):  # seeds before the state
        env._plan_reset([1], None)
    env._state = AsyncState.DEFAULT
    seeds, options, mask = env._plan_reset(3, {"reset_mask": np.array([False, True])})
    assert seeds == [3, 4] and options == {} and mask.tolist() == [False, True]


def test_close_waits_for_a_pending_call():
    env = Machine()
    assert env._finish_pending(1.0) is False and env.waited == []
    env._state = AsyncState.WAITING_STEP
    with pytest.warns(UserWarning, match="pending call to `step`"):
        assert env._finish_pending(2.5) is False
    assert env.waited == [2.5]


def test_close_after_a_timed_out_pending_call_asks_to_kill():
    env = Machine(multiprocessing.TimeoutError("late"))
    env._state = AsyncState.WAITING_STEP
    with pytest.warns(UserWarning):
        assert env._finish_pending(0) is True


def test_close_after_a_failed_pending_call_goes_on():
    env = Machine(ValueError("sub-env failed"))
    env._state = AsyncState.WAITING_STEP
    with pytest.warns(UserWarning, match="Pending call failed while closing: ValueError"):
        assert env._finish_pending(None) is False

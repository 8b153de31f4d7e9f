"""The front-end both vector envs share (``ForkVectorEnv`` and ``RayForkVectorEnv``).

Gymnasium's async state machine (:class:`AsyncFrontEnd`) and the checks of what a caller
passes (seeds, ``reset_mask``, ``set_attr`` values, fork arguments), with
AsyncVectorEnv's exception types and messages. Everything here is pure: nothing starts,
nothing is allocated, so a misuse is refused the same way by both envs.
"""

from __future__ import annotations

import multiprocessing
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState

from gym_fork import notices

from .config import check_sandbox_count

if TYPE_CHECKING:
    from gym_fork.lineage import Lineage

__all__ = [
    "SENDING",
    "AsyncFrontEnd",
    "AsyncState",
    "ForkPlan",
    "plan_fork",
    "reset_mask",
    "seeds_per_env",
    "values_per_env",
]


def is_int(value: Any) -> TypeGuard[int]:
    """An integer (numpy's included: an int to the type checker) that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _is_sequence(value: Any) -> TypeGuard[Sequence[Any] | np.ndarray]:
    return isinstance(value, Sequence | np.ndarray) and not isinstance(value, str | bytes)


class Sending:
    """The async state while sub-envs run a ``send``/``async_reset`` whose results are not
    all taken: Gymnasium's calls are refused until ``recv`` took them (their error names
    ``recv``)."""

    value = "recv"


SENDING = Sending()


# -- reset and set_attr ---------------------------------------------------------------
def seeds_per_env(seed: int | list[int | None] | None, num_envs: int) -> list[int | None]:
    """One seed per sub-env: None, ``seed + i``, or the caller's list (checked)."""
    if seed is None:
        return [None] * num_envs
    if is_int(seed):
        return [int(seed) + i for i in range(num_envs)]
    if _is_sequence(seed):
        if len(seed) != num_envs:
            raise ValueError(
                "If seeds are passed as a list the length must match "
                f"num_envs={num_envs} but got length={len(seed)}."
            )
        return list(seed)
    raise TypeError(f"seed must be None, an int or one seed per sub-env, got {seed!r}")


def values_per_env(values: Any, num_envs: int) -> list[Any] | tuple[Any, ...]:
    """One value per sub-env for set_attr: the caller's list/tuple, or one value for all."""
    if not isinstance(values, list | tuple):
        return [values] * num_envs
    if len(values) != num_envs:
        raise ValueError(
            "Values must be a list or tuple with length equal to the number of "
            f"environments. Got `{len(values)}` values for {num_envs} environments."
        )
    return values


def reset_mask(
    options: dict[str, Any] | None, num_envs: int
) -> tuple[dict[str, Any] | None, np.ndarray]:
    """(options without ``reset_mask``, the mask), checked as AsyncVectorEnv checks it."""
    mask = np.ones(num_envs, dtype=np.bool_)
    if options is None or "reset_mask" not in options:
        return options, mask
    options = dict(options)
    mask = options.pop("reset_mask")
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(mask)}")
    if mask.shape != (num_envs,):
        raise ValueError(
            f"`options['reset_mask']` must have shape `({num_envs},)`, got {mask.shape}"
        )
    if mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {mask.dtype}")
    if not np.any(mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one "
            f"True value, got reset_mask={mask}"
        )
    return options, mask


# -- fork -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ForkPlan:
    """A checked fork request: branch sub-env j continues source sub-env ``sources[j]``
    with seed ``seeds[j]`` (None: the source's randomness, continued)."""

    branch_id: str
    indices: list[int]
    copies: int
    sources: list[int]
    seeds: list[int | None]
    reseeded: bool  # the caller passed ``reseed``


def plan_fork(
    branch_id: Any, indices: Any, copies: Any, reseed: Any, num_envs: int, held: int = 0
) -> ForkPlan:
    """Check a fork's arguments (TypeError/ValueError naming the bad one) and the
    sandbox ceiling (``held``: sandboxes this controller holds already), before anything
    is allocated."""
    if not isinstance(branch_id, str) or not branch_id:
        raise TypeError(f"branch_id must be a non-empty str, got {branch_id!r}")
    if indices is None:
        indices = range(num_envs)
    elif not _is_sequence(indices):
        raise TypeError(f"fork indices must be a sequence of ints, got {indices!r}")
    if len(indices) == 0:
        raise ValueError("fork indices must name at least one sub-env")
    bad = [i for i in indices if not is_int(i)]
    if bad:
        raise TypeError(f"fork indices must be ints, got {bad[:5]!r}")
    indices = [int(i) for i in indices]
    outside = [i for i in indices if not 0 <= i < num_envs]
    if outside:
        raise ValueError(f"fork indices must be in [0, {num_envs}), got {outside[:5]}")
    if not is_int(copies) or copies < 1:
        raise ValueError(f"copies must be an int >= 1, got {copies!r}")
    copies = int(copies)
    n = len(indices) * copies
    check_sandbox_count(held + n, f"fork({branch_id!r})")
    if reseed is None:
        seeds: list[int | None] = [None] * n
    elif is_int(reseed):
        seeds = [int(reseed) + j for j in range(n)]
    elif _is_sequence(reseed):
        if len(reseed) != n:
            raise ValueError(f"reseed needs one seed per branch sub-env ({n}), got {len(reseed)}")
        wrong = [s for s in reseed if s is not None and not is_int(s)]
        if wrong:
            raise TypeError(f"reseed must hold ints or None, got {wrong[:5]!r}")
        seeds = [None if s is None else int(s) for s in reseed]
    else:
        raise TypeError(f"reseed must be None, an int or one seed per sub-env, got {reseed!r}")
    negative = [s for s in seeds if s is not None and s < 0]
    if negative:
        raise ValueError(f"seeds must be >= 0, got {negative[:5]}")
    sources = [i for i in indices for _ in range(copies)]
    return ForkPlan(branch_id, indices, copies, sources, seeds, reseed is not None)


# -- the state machine ----------------------------------------------------------------
class AsyncFrontEnd:
    """Gymnasium's async state machine and argument checks, for a vector env that sets
    ``num_envs``, ``closed``, ``_state`` (an :class:`AsyncState`, or :data:`SENDING`)
    and ``_lineage``."""

    num_envs: int
    closed: bool
    _state: AsyncState | Sending
    _lineage: Lineage | None  # recorded when the env opened

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def _assert_idle(self, what: str, stop: str = "") -> None:
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{what}` while waiting for a pending call to "
                f"`{self._state.value}` to complete{stop}",
                str(self._state.value),
            )

    def _begin(self, what: str) -> None:
        """Before sending a request: open, and no call pending."""
        self._assert_is_running()
        self._assert_idle(what, ".")

    def _not_waiting(self, state: AsyncState) -> None:
        """Raise for a ``*_wait`` while the env is not in ``state`` (closed first)."""
        self._assert_is_running()
        raise NoAsyncCallError(
            f"Calling `{state.value}_wait` without any prior call to `{state.value}_async`.",
            state.value,
        )

    def _plan_reset(
        self, seed: Any, options: dict[str, Any] | None, beside_sends: bool = False
    ) -> tuple[list[int | None], dict[str, Any] | None, np.ndarray]:
        """reset_async's checks, in AsyncVectorEnv's order: (seeds, options, mask).
        ``beside_sends`` (batch mode): other sub-envs may be running; the caller checks
        that the reset ones are free."""
        self._assert_is_running()
        seeds = seeds_per_env(seed, self.num_envs)
        if not beside_sends:
            self._assert_idle("reset_async")
        options, mask = reset_mask(options, self.num_envs)
        return seeds, options, mask

    def _plan_set_attr(self, values: Any) -> list[Any] | tuple[Any, ...]:
        self._assert_is_running()
        values = values_per_env(values, self.num_envs)
        self._assert_idle("set_attr", ".")
        return values

    def _plan_fork(
        self,
        branch_id: Any,
        indices: Any,
        copies: Any,
        reseed: Any,
        held: int = 0,
        beside_sends: bool = False,
    ) -> ForkPlan:
        """fork's checks: open, idle (``beside_sends``, batch mode: other sub-envs may be
        running; the caller checks that the forked ones are free), arguments, and a
        branch id new in the tree."""
        self._assert_is_running()
        if not beside_sends:
            self._assert_idle("fork", ".")
        plan = plan_fork(branch_id, indices, copies, reseed, self.num_envs, held)
        assert self._lineage is not None  # an open env has its lineage
        self._lineage.tree.check_free(plan.branch_id)
        return plan

    def _finish_pending(self, timeout: float | None) -> bool:
        """At close: wait for a pending call (warned about); True when it timed out, so
        that the sandboxes are killed rather than closed."""
        if self._state is AsyncState.DEFAULT:
            return False
        notices.warn(
            f"Calling `close` while waiting for a pending call to `{self._state.value}` to "
            "complete."
        )
        try:
            getattr(self, f"{self._state.value}_wait")(timeout)
        except multiprocessing.TimeoutError:
            return True
        except Exception as exc:  # a pending call that failed must not stop the close
            notices.warn(f"Pending call failed while closing: {exc!r}")
        return False

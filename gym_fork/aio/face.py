"""``AsyncForkVectorEnv``: awaitable reset, step, fork and close, one sub-env at a time.

For agent loops in which each episode goes at its own pace (a tool call that takes a
second beside one that takes a millisecond): ``await envs.step(3, action)`` returns
sub-env 3's result as soon as it has it, whatever the others do. Underneath is a
ForkVectorEnv in batch mode (``batch_size=1``: one sandbox per sub-env), run by one
thread per family (gym_fork/aio/engine.py), so the event loop never blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium import Env
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector.utils import batch_space, concatenate, iterate

from gym_fork.vector.frontend import is_int
from gym_fork.vector.spaces import empty_buffer

from .engine import Budget, Call, Engine, later


class AsyncForkVectorEnv:
    """A ForkVectorEnv whose sub-envs are reset, stepped and forked one at a time, each
    call awaited on its own. Make one with ``await AsyncForkVectorEnv.open(env_fns)`` (or
    :meth:`open_from_parent`), best as ``async with``: leaving the block closes it, also
    when the task is cancelled.

    ``max_concurrency``: at most this many of its sub-envs run a reset or a step at once
    (the others wait, in order). A step or reset whose ``await`` is cancelled still runs in
    its sub-env if it was sent (its result is dropped); one not yet sent is not sent.
    """

    def __init__(self, _engine: Engine, _env: Any, _budget: Budget) -> None:
        # Made by open(), open_from_parent() and fork(): not by hand.
        self._engine, self._env, self._budget = _engine, _env, _budget
        self.closed = False
        self.num_envs: int = _env.num_envs
        self.single_observation_space = _env.single_observation_space
        self.single_action_space = _env.single_action_space
        self.max_concurrency = _budget.limit
        self._action_batch = batch_space(_env.single_action_space, 1)
        self._obs_batch = batch_space(_env.single_observation_space, 1)

    # -- opening ------------------------------------------------------------------------
    @classmethod
    async def open(
        cls, env_fns: Sequence[Callable[[], Env]], *, max_concurrency: int | None = None, **kwargs
    ) -> AsyncForkVectorEnv:
        """Start a ForkVectorEnv of ``env_fns`` (its other keyword arguments as the
        constructor's; ``batch_size`` is 1 here) and return its asyncio face."""
        from gym_fork.vector.fork_vector_env import ForkVectorEnv

        return await cls._start(
            lambda: ForkVectorEnv(env_fns, max_concurrency=max_concurrency, batch_size=1, **kwargs),
            max_concurrency,
        )

    @classmethod
    async def open_from_parent(
        cls,
        env_fn: Callable[[], Env],
        num_envs: int,
        *,
        max_concurrency: int | None = None,
        **kwargs: Any,
    ) -> AsyncForkVectorEnv:
        """``ForkVectorEnv.from_parent`` (one env prepared once, cloned ``num_envs``
        times), as an asyncio face."""
        from gym_fork.vector.fork_vector_env import ForkVectorEnv

        return await cls._start(
            lambda: ForkVectorEnv.from_parent(
                env_fn, num_envs, max_concurrency=max_concurrency, batch_size=1, **kwargs
            ),
            max_concurrency,
        )

    @classmethod
    async def _start(cls, build: Callable[[], Any], limit: int | None) -> AsyncForkVectorEnv:
        engine = Engine("gym_fork-aio")

        def job(_call: Call) -> AsyncForkVectorEnv:
            return cls._adopt(engine, build(), limit)

        # Cancelled before the job ran: nothing is built; while it ran: the face is closed
        # when it comes (the orphan). Either way the thread ends with its last face.
        return await engine.submit(job, orphan=_close_orphan)

    @classmethod
    def _adopt(cls, engine: Engine, env: Any, limit: int | None) -> AsyncForkVectorEnv:
        """In the thread: a face for ``env``, known to ``engine``."""
        face = cls(engine, env, Budget(limit))
        engine.faces.add(face)
        return face

    async def __aenter__(self) -> AsyncForkVectorEnv:
        return self

    async def __aexit__(self, kind: Any, *_rest: Any) -> None:
        # Left by an exception (a cancellation included): nobody wants what runs, so the
        # sandboxes are killed, not waited for.
        await self.close(terminate=kind is not None)

    # -- what the env is ----------------------------------------------------------------
    @property
    def lineage(self) -> Any:
        """The branch's lineage record (as ForkVectorEnv.lineage)."""
        return self._env.lineage

    @property
    def isolation(self) -> dict[str, Any]:
        """The isolation the sandboxes achieved (as ForkVectorEnv.isolation)."""
        return self._env.isolation

    # -- calls in one sub-env -----------------------------------------------------------
    async def reset(
        self, index: int, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset sub-env ``index`` (with ``seed``, ``options``); returns (obs, info)."""
        index = self._index(index)
        if options is not None and "reset_mask" in options:
            raise ValueError("reset(index) resets that sub-env: options must not hold reset_mask")
        seeds: list[int | None] = [None] * self.num_envs
        seeds[index] = seed
        mask = np.zeros(self.num_envs, dtype=np.bool_)
        mask[index] = True
        opts = {**(options or {}), "reset_mask": mask}
        obs, _r, _te, _tr, info = await self._in_sub_env(
            index, lambda: self._env.async_reset(seed=seeds, options=opts), "reset"
        )
        return obs, info

    async def step(self, index: int, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Step sub-env ``index`` with ``action`` (one of ``single_action_space``);
        returns (obs, reward, terminated, truncated, info) as a Gymnasium env does."""
        index = self._index(index)
        batch = concatenate(
            self.single_action_space, [action], empty_buffer(self.single_action_space, 1)
        )
        return await self._in_sub_env(index, lambda: self._env.send(batch, [index]), "step")

    async def fork(
        self,
        branch_id: str,
        indices: Sequence[int] | None = None,
        copies: int = 1,
        reseed: int | Sequence[int | None] | None = None,
        shared_memory: str = "warn",
    ) -> AsyncForkVectorEnv:
        """Branch sub-envs between their calls (as ForkVectorEnv.fork; the forked ones
        must not be running a reset or step): an AsyncForkVectorEnv of the branch, with
        this one's ``max_concurrency``. The others go on running meanwhile."""
        self._check_open()
        engine, limit = self._engine, self._budget.limit

        def job(_call: Call) -> AsyncForkVectorEnv:
            self._check_open()
            branch = self._env.fork(branch_id, indices, copies, reseed, shared_memory)
            return type(self)._adopt(engine, branch, limit)

        return await engine.submit(job, orphan=_close_orphan)

    async def close(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close the sub-envs and their sandboxes. Calls not yet answered fail with
        ClosedEnvironmentError; if any sub-env is still running one, nobody will take
        its result, so the sandboxes are killed rather than closed (as with
        ``terminate``). Else each sub-env's ``close()`` runs, up to ``timeout``. Runs to
        its end even if the awaiting task is cancelled; while it runs, the other envs of
        the family wait (one thread runs them all)."""
        if self.closed:
            return
        try:
            future = self._engine.submit(
                lambda _call: self._close_now(timeout, terminate), always=True
            )
        except ClosedEnvironmentError:  # the family's thread has ended: nothing runs
            self._close_now(0.0, terminate=True)
            return
        await future

    # -- inside -------------------------------------------------------------------------
    def _index(self, index: Any) -> int:
        self._check_open()
        if not is_int(index) or not 0 <= index < self.num_envs:
            raise ValueError(
                f"index must be a sub-env index in [0, {self.num_envs}), got {index!r}"
            )
        return int(index)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError("Trying to operate on an AsyncForkVectorEnv after close.")

    async def _in_sub_env(self, index: int, send: Callable[[], None], what: str) -> Any:
        """Send a call to sub-env ``index`` (when the budget allows) and await its result,
        unbatched."""
        engine, budget, env = self._engine, self._budget, self._env

        def job(call: Call) -> Any:
            self._check_open()
            busy = index in engine.owed.get(env, {})
            waiting = [(go, c) for go, c in budget.waiting if not c.future.cancelled()]
            budget.waiting.clear()
            budget.waiting.extend(waiting)  # a cancelled one will never be sent: forgotten
            if busy or any(go.index == index for go, _call in waiting):
                raise ValueError(f"sub-env {index} is already running a call: await it first")

            def go() -> None:
                try:
                    send()
                except BaseException as exc:
                    engine.settle(call, error=exc)
                    return
                engine.owe(env, index, call, budget, what)

            go.index = index  # type: ignore[attr-defined]
            if budget.limit is not None and budget.running >= budget.limit:
                budget.waiting.append((go, call))
            else:
                go()
            return later()

        result, info = await engine.submit(job)
        obs, rewards, terminations, truncations, _infos = result
        (one,) = iterate(self._obs_batch, obs)
        return one, float(rewards[0]), bool(terminations[0]), bool(truncations[0]), info

    def _close_now(self, timeout: float | None, terminate: bool = False) -> None:
        """In the thread: fail what waits, close the env, forget this face."""
        if self.closed:
            return
        self.closed = True
        engine, closed = self._engine, ClosedEnvironmentError("the vector env was closed")
        while self._budget.waiting:
            _send, call = self._budget.waiting.popleft()
            engine.settle(call, error=closed)
        try:
            running = engine.owed.pop(self._env, {})
            for owed in running.values():
                owed.budget.running -= 1
                engine.settle(owed.call, error=closed)
            self._env.close(timeout=timeout, terminate=terminate or bool(running))
        finally:
            engine.faces.discard(self)


def _close_orphan(face: AsyncForkVectorEnv) -> None:
    """A face made for a future nobody awaits any more: closed in its thread."""
    face._engine.post(lambda _call: face._close_now(None))

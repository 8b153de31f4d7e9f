"""Batch mode (``batch_size=k``): ``send`` to some sub-envs, ``recv`` the first k done.

EnvPool's asynchronous interface, next to the unchanged Gymnasium ``step``: with step
times that vary, waiting for every sub-env (a synchronous step) leaves the fast ones
idle behind the slowest; here each sub-env runs on as soon as its result is taken.

One sandbox per sub-env (so worker k is sub-env k). ``send`` puts each action inside its
sub-env's request record; ``recv`` takes the replies in finish order, waiting with the
pool's wait on all the sub-envs still running (WorkerPool.wait_any: the rings polled
with a shared-counter read each, the liveness checks of every wait).
A reset's result has reward 0 and no termination or truncation, as EnvPool's.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from typing import Any

import numpy as np
from gymnasium.error import NoAsyncCallError
from gymnasium.vector import VectorEnv
from gymnasium.vector.utils import batch_space, concatenate, iterate

from gym_fork.errors import BadActionError, BadObservationError
from gym_fork.transport.codec import pack
from gym_fork.worker import protocol as P

from .faults import errors_exception, timed_out
from .frontend import SENDING, AsyncFrontEnd, AsyncState, is_int
from .pool import Watching
from .spaces import check_ring_observations, empty_batch
from .waits import Deadline, WaitTimeout


class Batches:
    """Which sub-envs are running, and the results that came and are not taken yet."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.running: dict[int, int] = {}  # sub-env -> the op it runs (RESET or STEP)
        self.done: deque[tuple[int, int, Any, list]] = deque()  # (index, op, result, errors)
        self.last_ids: list[int] | None = None
        self.watch = Watching()  # the liveness clocks of a poller's short waits (_recv_one)

    def busy(self) -> bool:
        """True while results are owed to the caller."""
        return bool(self.running or self.done)


def send_requests(env: Any, batches: Batches, op: int, args: dict[int, Any]) -> None:
    """Send ``op`` with ``args[i]`` to each sub-env i (already checked free)."""
    pool = env.sandboxes.pool
    for index, arg in args.items():
        worker = pool.workers[index]
        seq = pool._next_seq()
        worker.awaiting = seq
        pool._send_record(worker, pack([op, seq, arg]), op)
        batches.running[index] = op  # only once sent: a failed send owes nothing


def check_ids(env: Any, batches: Batches, env_ids: Any, count: int | None) -> list[int]:
    """``env_ids`` as a list of free sub-env indices (None: those of the last recv)."""
    if env_ids is None:
        if batches.last_ids is None:
            raise ValueError("send() without env_ids needs a recv() first: pass env_ids")
        ids = list(batches.last_ids)
    else:
        if is_int(env_ids):
            env_ids = [env_ids]
        ids = [int(i) if is_int(i) else i for i in np.asarray(env_ids).ravel().tolist()]
        bad = [i for i in ids if not is_int(i) or not 0 <= i < env.num_envs]
        if bad:
            raise ValueError(f"env_ids must be sub-env indices in [0, {env.num_envs}), got {bad}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"env_ids repeat a sub-env: {ids}")
    check_free(batches, ids, "sending them again")
    if count is not None and count != len(ids):
        raise BadActionError(f"{count} actions for {len(ids)} env_ids {ids}")
    return ids


def check_free(batches: Batches, ids: Any, what: str) -> None:
    """ValueError naming those of ``ids`` that are running or owe a result."""
    taken = [i for i in ids if i in batches.running or any(d[0] == i for d in batches.done)]
    if taken:
        raise ValueError(f"sub-env(s) {taken} still owe a result: recv() it before {what}")


def actions_for(env: Any, actions: Any, count: int) -> list[Any]:
    """One action per sub-env of a batch of ``count`` (checked against the space)."""
    space = batch_space(env.single_action_space, count)
    if isinstance(actions, np.ndarray) and space.shape and actions.shape[:1] != (count,):
        raise BadActionError(
            f"expected {count} actions of {env.single_action_space}, got an array of "
            f"shape {actions.shape}"
        )
    try:
        per_env = list(iterate(space, actions))
    except (TypeError, ValueError, KeyError) as exc:
        raise BadActionError(f"actions do not fit {space}: {exc}") from exc
    if len(per_env) != count:
        raise BadActionError(f"expected {count} actions, got {len(per_env)}")
    if env.config.check_actions:
        outside = [k for k, a in enumerate(per_env) if not env.single_action_space.contains(a)]
        if outside:
            raise BadActionError(f"actions {outside} are outside {env.single_action_space}")
    return per_env


def wait(env: Any, batches: Batches, timeout: float | None, poll: bool = False) -> None:
    """Until ``batch_size`` results (or every running one) came; the deadline is
    ``timeout``, else the vector env's own (then the silent sandboxes are killed).
    ``poll``: one of a poller's short waits (its liveness clocks carry over)."""
    pool = env.sandboxes.pool
    own = env.config.timeout
    own_deadline = timeout is None and own is not None
    deadline = Deadline(own if own_deadline else timeout)
    wanted = min(batches.batch_size, len(batches.running) + len(batches.done))

    def take_ready(ready: list[int]) -> bool:
        for index in ready:
            op = batches.running.pop(index)
            batches.watch.stalls.pop(index, None)
            worker = pool.workers[index]
            # Its reply is there, or it is dead: what it published before it died is
            # taken, else its crash is raised at once.
            try:
                _op, _seq, result, errors = pool.receive(
                    worker, Deadline(0) if worker.dead else deadline, op
                )
            except WaitTimeout:  # only the late reply of an abandoned call: it runs on
                batches.running[index] = op
                continue
            batches.done.append((index, op, result, errors or []))
        return len(batches.done) >= wanted

    if len(batches.done) >= wanted:
        return
    try:
        pool.wait_any(batches.running, deadline, take_ready, batches.watch if poll else None)
    except WaitTimeout:
        what = "recv"
        if own_deadline:
            op = next(iter(batches.running.values()), P.STEP)
            error = pool.kill_unanswered(op, what, own)
            batches.running.clear()
            raise error from None
        raise multiprocessing.TimeoutError(
            f"The call to `{what}` has timed out after {timeout} second(s): "
            f"sub-envs {sorted(batches.running)} are still running."
        ) from None


def take(env: Any, batches: Batches) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict]:
    """The first ``batch_size`` results that came, as (obs, rewards, terminations,
    truncations, infos) with ``infos["env_id"]``; a sub-env's error is raised (the
    others stay, for the next recv)."""
    count = min(batches.batch_size, len(batches.done))
    taken = [batches.done.popleft() for _ in range(count)]
    errors = [e for _index, _op, _result, errs in taken for e in errs]
    if errors:
        for entry in reversed([t for t in taken if not t[3]]):
            batches.done.appendleft(entry)
        raise errors_exception(errors, trusted=env.config.trusted)
    for k, (index, _op, result, _errs) in enumerate(taken if env._ring_texts is not None else ()):
        try:
            check_ring_observations(env._ring_texts, result[0][:1], [index])
        except BadObservationError:  # the others stay, for the next recv
            for entry in reversed(taken[:k] + taken[k + 1 :]):
                batches.done.appendleft(entry)
            raise
    slabs = env.sandboxes.slabs.slabs
    single = env.single_observation_space
    rewards = np.zeros(count, dtype=np.float64)
    terminations = np.zeros(count, dtype=np.bool_)
    truncations = np.zeros(count, dtype=np.bool_)
    observations = []
    infos: dict[str, Any] = {}
    batch_infos = VectorEnv.__new__(VectorEnv)  # Gymnasium's info batching, for `count`
    batch_infos.num_envs = count
    for j, (index, op, result, _errors) in enumerate(taken):
        obs_list, info_list = result
        slab = slabs[index]
        if env._obs_in_slab:
            observations.append(slab.observations.read(0))
        else:
            observations.append(obs_list[0])
        if op == P.STEP:
            rewards[j] = slab.rewards[0]
            terminations[j] = slab.terminations[0]
            truncations[j] = slab.truncations[0]
        if info_list is not None and info_list[0]:
            infos = batch_infos._add_info(infos, info_list[0], j)
    ids = [t[0] for t in taken]
    batches.last_ids = ids
    infos["env_id"] = np.array(ids, dtype=np.int32)
    obs = concatenate(single, observations, empty_batch(single, count))
    return obs, rewards, terminations, truncations, infos


def drain(env: Any, batches: Batches, timeout: float | None) -> None:
    """Wait for every running sub-env and drop all results (before a close)."""
    batches.batch_size = len(batches.running) + len(batches.done)
    try:
        if batches.running:
            wait(env, batches, timeout)
    finally:
        batches.running.clear()
        batches.done.clear()


class BatchMode(AsyncFrontEnd):
    """``async_reset``/``send``/``recv`` on the front-end's state machine, for a vector
    env made with ``batch_size=k`` (ForkVectorEnv: its sandboxes, config, ``_batches``)."""

    sandboxes: Any
    config: Any
    _batches: Batches | None

    def async_reset(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Batch mode: reset every sub-env (or ``options["reset_mask"]``'s) without
        waiting; :meth:`recv` returns them as they finish (reward 0, not done). Other
        sub-envs may still be running a :meth:`send` (the reset ones must be free)."""
        batches = self._batch_mode("async_reset")
        seeds, options, mask = self._plan_reset(seed, options, beside_sends=True)
        resetting = [i for i in range(self.num_envs) if mask[i]]
        check_free(batches, resetting, "resetting them")
        # Only the reset ones: a dead sandbox still owing a step is wait()'s to report.
        self.sandboxes.replace_dead(resetting)
        if self.config.reset_mode == "clone":
            self.sandboxes.reset_by_clone(mask)
        args = {i: [[seeds[i], options, True]] for i in range(self.num_envs) if mask[i]}
        self._state = SENDING
        send_requests(self, batches, P.RESET, args)

    def send(self, actions: Any, env_ids: Any = None, *, env_id: Any = None) -> None:
        """Batch mode: step sub-envs ``env_ids`` (default: those the last :meth:`recv`
        returned) with ``actions``, one each, without waiting. ``env_id`` is EnvPool's
        name for ``env_ids``."""
        if env_id is not None:
            if env_ids is not None:
                raise TypeError("send() takes env_ids or EnvPool's env_id, not both")
            env_ids = env_id
        batches = self._batch_mode("send")
        if self._state is not SENDING:
            self._begin("send")
        ids = check_ids(self, batches, env_ids, None)
        per_env = actions_for(self, actions, len(ids))
        self._state = SENDING
        send_requests(self, batches, P.STEP, {i: [a] for i, a in zip(ids, per_env, strict=True)})

    def recv(self, timeout: float | None = None):
        """Batch mode: (obs, rewards, terminations, truncations, infos) of the first
        ``batch_size`` sub-envs that finished (fewer if fewer are running), their
        indices in ``infos["env_id"]``."""
        batches = self._batch_mode("recv")
        if self._state is not SENDING or not batches.busy():
            raise NoAsyncCallError(
                "Calling `recv` without any prior call to `send` or `async_reset`.", "recv"
            )
        try:
            wait(self, batches, timeout)
            return take(self, batches)
        finally:
            if not batches.busy():
                self._state = AsyncState.DEFAULT

    def _recv_one(self, timeout: float) -> tuple[int, Any, dict] | None:
        """Batch mode with ``batch_size=1`` (gym_fork/aio): the next finished sub-env's
        index, its ``recv`` result (or the exception its call raised) and the info dict
        its env returned (as it was: no ``env_id`` added, no ``_key`` read as a mask);
        None when none finished within ``timeout`` s or none is running. Other errors
        of the wait (a crash it could not place) are raised."""
        batches = self._batch_mode("recv")
        if self._state is not SENDING or not batches.busy():
            return None
        try:
            try:
                wait(self, batches, timeout, poll=True)
            except multiprocessing.TimeoutError:
                return None
            index, _op, result, _errors = batches.done[0]
            infos = result[1] if isinstance(result, list | tuple) and len(result) > 1 else None
            info = dict(infos[0]) if infos and isinstance(infos[0], dict) else {}
            try:
                return index, take(self, batches), info
            except Exception as exc:  # the sub-env's own error: its caller's to raise
                return index, exc, {}
        finally:
            if not batches.busy():
                self._state = AsyncState.DEFAULT

    def _kill_overdue(self, index: int, what: str, timeout: float) -> BaseException:
        """Batch mode (gym_fork/aio): sub-env ``index`` ran ``what`` past the vector env's
        ``timeout``: kill its sandbox (a reset replaces it) and return the SubEnvTimeout."""
        batches = self._batch_mode(what)
        pool = self.sandboxes.pool
        worker = pool.workers[index]
        tree = pool.tree_note()  # who is stopped, before the kill
        worker.kill()
        worker.watch.wait_dead(1.0)
        batches.running.pop(index, None)
        batches.watch.stalls.pop(index, None)
        if not batches.busy():
            self._state = AsyncState.DEFAULT
        detail = pool.crashed(worker, f"during {what}").args[0]
        return timed_out(what, timeout, [detail], [worker], tree)

    def _batch_mode(self, what: str) -> Batches:
        self._assert_is_running()
        if self._batches is None:
            raise ValueError(f"`{what}` needs batch mode: ForkVectorEnv(..., batch_size=k)")
        return self._batches

    def _drain_batches(self, timeout: float | None) -> bool:
        """At close, sub-envs still running a send: wait for them and drop their results;
        True when that failed (a timeout or a crash: kill, not close, the sandboxes)."""
        if self._state is not SENDING or self._batches is None:
            return False
        try:
            drain(self, self._batches, timeout)
        except Exception:  # reported by killing: the sandboxes are not closed in order
            return True
        finally:
            self._state = AsyncState.DEFAULT
        return False

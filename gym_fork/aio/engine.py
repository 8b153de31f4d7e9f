"""The thread that owns a family of batch-mode vector envs for the asyncio face.

ForkVectorEnv is not thread-safe, and its waits block: an event loop must never run them.
One :class:`Engine` thread per family (a root env and the branches forked from it) runs
every call on those envs, in the order the loop submitted them, and settles the loop's
futures with ``loop.call_soon_threadsafe``.

A call that runs in a sub-env (``reset``, ``step``) is *sent* (batch mode's ``send`` or
``async_reset`` for that one sub-env) and settled when its result comes; in between the
thread polls the envs that owe results (``_recv_one``): with one such env it waits on its
rings for up to :data:`SLICE_S`, with several it looks at each and then waits for a new
job for up to :data:`POLL_S`. With no result owed it sleeps on its job queue.

Each face has a concurrency budget (``max_concurrency``): calls past it wait here, in
order, and are sent as earlier ones finish; a call whose future was cancelled before it
was sent is never sent, and the result of one cancelled after it was sent is dropped when
it comes (the sub-env did run it).

Nothing is orphaned: a face opened or forked for a future that was cancelled meanwhile is
closed here; the thread ends once every face of its family is closed, and at interpreter
exit (``atexit``) whatever is still open is closed.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gymnasium.error import ClosedEnvironmentError

from gym_fork import notices

# Longest a job submitted while a result is awaited waits for the thread (one env
# owing): SLICE_S at first, twice as long after each wait that found nothing, up to
# SLICE_MAX_S (a sub-env that takes seconds costs the controller next to nothing).
SLICE_S = 0.001
SLICE_MAX_S = 0.008
# The same with several envs owing results (each is looked at, then the queue is waited on).
POLL_S = 0.0002
# At interpreter exit: how long each family's close may take before its sandboxes are killed.
EXIT_CLOSE_S = 10.0

_LATER = object()  # a job's return: its call is settled when the sub-env's result comes
_STOP = object()
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@dataclass
class Call:
    """One awaited call: the loop's future, and what to do with a value nobody awaits."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    orphan: Callable[[Any], None] | None = None  # e.g. close a face opened for nobody
    always: bool = False  # run even if cancelled before it ran (a close)


@dataclass
class Owed:
    """A call a sub-env runs: whose it is, since when, and what it is (for its error)."""

    call: Call
    budget: Budget
    what: str
    sent: float = field(default_factory=time.monotonic)


@dataclass
class Budget:
    """A face's calls in sub-envs: how many run, the most that may, those waiting."""

    limit: int | None
    running: int = 0
    waiting: collections.deque = field(default_factory=collections.deque)


class Engine:
    """The thread running every call on one family of vector envs (see the module doc)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self.faces: set[Any] = set()  # the family's open faces (touched in the thread only)
        self.owed: dict[Any, dict[int, Owed]] = {}  # env -> sub-env index -> its call
        self._slice = SLICE_S
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _ENGINES.add(self)

    # -- the loop's side ----------------------------------------------------------------
    def submit(
        self,
        job: Callable[[Call], Any],
        orphan: Callable[[Any], None] | None = None,
        always: bool = False,
    ) -> asyncio.Future:
        """Run ``job(call)`` in the thread; returns the future its result settles."""
        loop = asyncio.get_running_loop()
        call = Call(loop, loop.create_future(), orphan, always)
        self.post(job, call)
        return call.future

    def post(self, job: Callable[[Any], Any], call: Call | None = None) -> None:
        """Queue ``job`` for the thread (from any thread); no future when ``call`` is None."""
        with self._lock:
            if self._stopped:
                raise ClosedEnvironmentError("this vector env family is closed")
            self._jobs.put((job, call))

    # -- the thread's side --------------------------------------------------------------
    def settle(self, call: Call, value: Any = None, error: BaseException | None = None) -> None:
        """Hand ``value`` (or ``error``) to ``call``'s future, in its loop."""
        try:
            call.loop.call_soon_threadsafe(_settle, call, value, error)
        except RuntimeError:  # its loop is closed: nobody will take the value
            if error is None and call.orphan is not None:
                call.orphan(value)

    def owe(self, env: Any, index: int, call: Call, budget: Budget, what: str) -> None:
        """``env``'s sub-env ``index`` runs ``call``: settled when its result comes."""
        self.owed.setdefault(env, {})[index] = Owed(call, budget, what)
        budget.running += 1

    def fail_owed(self, env: Any, error: BaseException) -> None:
        """Every call owed by ``env`` gets ``error``."""
        for owed in self.owed.pop(env, {}).values():
            owed.budget.running -= 1
            self.settle(owed.call, error=error)

    def _deliver(self, env: Any, index: int, outcome: Any, info: dict | None = None) -> None:
        owed = self.owed[env].pop(index)
        owed.budget.running -= 1
        if isinstance(outcome, BaseException):
            self.settle(owed.call, error=outcome)
        else:
            self.settle(owed.call, (outcome, info or {}))
        _send_waiting(owed.budget)

    def _run(self) -> None:
        try:
            while True:
                job = self._next_job()
                if job is _STOP:
                    return
                if job is not None:
                    self._slice = SLICE_S
                    self._do(job)
                    if not self.faces:  # the family's last face was closed
                        return
        except BaseException as exc:  # a defect here: nothing may be left running
            notices.warn(f"gym_fork.aio: the engine thread failed ({exc!r}); its envs are killed")
            raise
        finally:
            with self._lock:
                self._stopped = True
            self._drain()

    def _next_job(self) -> Any:
        owing = [env for env, calls in self.owed.items() if calls]
        if not owing:
            return self._jobs.get()
        with contextlib.suppress(queue.Empty):
            return self._jobs.get_nowait()
        came = False
        for env in owing:
            came = self._take_results(env, 0.0) or came
            self._end_overdue(env)
        if came:
            self._slice = SLICE_S
            return None
        if len(owing) == 1:
            if not self._take_results(owing[0], self._slice):
                self._slice = min(SLICE_MAX_S, self._slice * 2)
            return None
        try:
            return self._jobs.get(timeout=POLL_S)
        except queue.Empty:
            return None

    def _take_results(self, env: Any, timeout: float) -> bool:
        """Settle the calls whose results ``env`` has (waiting up to ``timeout`` for the
        first); True when one came."""
        came = False
        while self.owed.get(env):
            try:
                got = env._recv_one(timeout)
            except Exception as exc:  # the wait failed on sub-envs it took off the run
                batches = env._batches
                placed = set(batches.running) | {d[0] for d in batches.done}
                lost = set(self.owed[env]) - placed
                if not lost:  # it names none of them: the env cannot be trusted on
                    self._abandon(env, exc)
                    return True
                for index in lost:
                    self._deliver(env, index, exc)
                return True
            if got is None:
                return came
            self._deliver(env, *got)
            came, timeout = True, 0.0
        return came

    def _end_overdue(self, env: Any) -> None:
        """Calls past the vector env's own ``timeout``: their sandboxes are killed and
        the SubEnvTimeout is theirs (ForkVectorEnv(timeout=...))."""
        limit = env.config.timeout
        if limit is None or not self.owed.get(env):
            return
        now = time.monotonic()
        for index, owed in list(self.owed[env].items()):
            if now - owed.sent > limit and index in env._batches.running:
                self._deliver(env, index, env._kill_overdue(index, owed.what, limit))

    def _abandon(self, env: Any, error: BaseException) -> None:
        """``env`` failed in a way no call owns: its calls get ``error``, it is killed."""
        self.fail_owed(env, error)
        for face in list(self.faces):
            if face._env is env:
                face._close_now(0.0, terminate=True)

    def _do(self, job: tuple[Callable[[Call], Any], Call]) -> None:
        work, call = job
        if call is None:  # nobody awaits it (an orphan's close)
            try:
                work(None)
            except Exception as exc:
                notices.warn(f"gym_fork.aio: closing a vector env nobody awaited failed: {exc!r}")
            return
        if call.future.cancelled() and not call.always:
            return
        try:
            value = work(call)
        except BaseException as exc:  # the caller's to see, in its own task
            self.settle(call, error=exc)
            return
        if value is not _LATER:
            self.settle(call, value)

    def _drain(self) -> None:
        """After the thread's last job: no future is left waiting, no face open."""
        closed = ClosedEnvironmentError("the vector env was closed")
        for env in list(self.owed):
            self.fail_owed(env, closed)
        for face in list(self.faces):  # only where the thread failed
            with contextlib.suppress(Exception):
                face._close_now(0.0, terminate=True)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP and job[1] is not None:
                self.settle(job[1], error=closed)

    def close_all(self, timeout: float) -> None:
        """Close every open face of the family, then end the thread (interpreter exit)."""

        def close_everything() -> None:
            for face in list(self.faces):
                face._close_now(timeout)

        with self._lock:
            if self._stopped:
                return
            faces = len(self.faces)
            self._jobs.put((lambda _call: close_everything(), None))
            self._jobs.put(_STOP)
        self._thread.join(timeout * (faces + 1) + 5.0)  # each face's close may take timeout


def _send_waiting(budget: Budget) -> None:
    """Send the calls waiting for ``budget`` while it allows (cancelled ones dropped)."""
    while budget.waiting and (budget.limit is None or budget.running < budget.limit):
        send, call = budget.waiting.popleft()
        if not call.future.cancelled():
            send()


def later() -> Any:
    """What a job returns when its call is settled later (by a sub-env's result)."""
    return _LATER


def _settle(call: Call, value: Any, error: BaseException | None) -> None:
    future = call.future
    if future.done():  # cancelled while it ran: a face made for it is nobody's
        if error is None and call.orphan is not None:
            call.orphan(value)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


@atexit.register
def _close_at_exit() -> None:
    for engine in list(_ENGINES):
        engine.close_all(EXIT_CLOSE_S)

"""The worker pool: requests out, replies in, every wait bounded.

The step pipeline, end to end:
  actions -> the slab's action rows (or, while a worker still owes the reply of an
  abandoned call, inside the request record itself, so that a late request never reads
  the next step's actions) -> one STEP record per worker (beyond ``max_concurrency``
  sub-envs, held back and sent as earlier workers answer) -> each worker steps its
  sub-envs and writes observations, rewards and flags into its own rows -> a reply
  record ``[op, seq, infos, errors]`` -> collected in worker order, late replies of
  abandoned calls dropped by sequence number -> the batch is read from the slab.

Concurrency: a pool is used from the controller's calling thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gym_fork import notices
from gym_fork.errors import (
    PeerGone,
    PickleRefused,
    RingTimeout,
    SubEnvCrashed,
    TransportError,
)
from gym_fork.hosts.base import Host, WorkerHandle
from gym_fork.transport.codec import pack, pack_bare_request
from gym_fork.transport.ring import DEFAULT_SPIN, SLICE, AnyRing, wait
from gym_fork.transport.spin import SpinChoice
from gym_fork.transport.spin import apply as apply_spin
from gym_fork.worker import protocol as P

from .faults import corrupted, crashed, errors_exception, timed_out
from .stalls import MAX_STOPS, Stall, stopped_error, stopped_note, tree_note
from .waits import Deadline, WaitTimeout


@dataclass
class Watching:
    """What :meth:`WorkerPool.wait_any` keeps between the short waits of one poller: when
    it last checked liveness, and the stopped-sandbox clock of each position."""

    checked: float = float("-inf")
    stalls: dict[int, Stall | None] = field(default_factory=dict)


class WorkerPool:
    """The worker handles of one vector env and the records in flight to them."""

    workers: list[WorkerHandle]
    host: Host
    max_concurrency: int | None
    trusted: bool
    label: str  # the branch id, for error messages
    send_timeout: float | None

    def __init__(
        self,
        host: Host,
        *,
        max_concurrency: int | None = None,
        trusted: bool = False,
        send_timeout: float | None = None,
    ) -> None:
        self.workers = []
        self.host = host
        self.max_concurrency = max_concurrency
        self.trusted = trusted
        self.label = "?"
        self.send_timeout = send_timeout
        self._seq = 0
        self._spin = SpinChoice()  # the spin of the waits for step replies
        self._spinning_long = False
        self._held: list[tuple[WorkerHandle, bytes]] = []
        self._watched: WorkerHandle | None = None  # the wait receive() is in: worker,
        self._watched_op = 0  # op,
        self._stall: Stall | None = None  # and its Stall (None: the first slice)

    # -- sending --------------------------------------------------------------------
    def behind(self) -> bool:
        """True while some worker still owes the reply of a call that was abandoned."""
        return any(w.awaiting for w in self.workers)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def send_same(self, op: int, arg: Any) -> None:
        """The same request to every worker (one encode)."""
        self._seq += 1
        seq = self._seq
        record = pack_bare_request(op, seq) if arg is None else pack([op, seq, arg])
        if self.max_concurrency is None:  # the hot path of a step: no list, no holding
            self._held = []
            for worker in self.workers:
                worker.awaiting = seq
                self._send_record(worker, record, op)
            return
        self._dispatch(op, seq, [record] * len(self.workers))

    def send_each(self, op: int, args: list[Any]) -> None:
        """One request per worker, ``args`` in worker order."""
        seq = self._next_seq()
        self._dispatch(op, seq, [pack([op, seq, arg]) for arg in args])

    def _dispatch(self, op: int, seq: int, records: list[bytes]) -> None:
        """Send one record per worker; with ``max_concurrency``, resets and steps beyond
        the limit wait in ``_held`` and go out as earlier sub-envs answer."""
        self._held = []
        budget = None
        if self.max_concurrency is not None and op in (P.RESET, P.STEP):
            budget = self.max_concurrency
        running = 0
        for worker, record in zip(self.workers, records, strict=True):
            worker.awaiting = seq
            if budget is None or running == 0 or running + len(worker.indices) <= budget:
                self._send_record(worker, record, op)
                running += len(worker.indices)
            else:
                self._held.append((worker, record))

    def _send_record(self, worker: WorkerHandle, record: bytes, op: int) -> None:
        try:
            worker.channel.send_raw(record, self.send_timeout, alive=worker.alive)
        except PeerGone:
            raise self.crashed(worker, f"before {P.NAMES[op]}") from None
        except RingTimeout:
            worker.kill()  # it has not read a request for the whole timeout: hung
            raise self.crashed(
                worker, f"before {P.NAMES[op]}: its request ring stayed full"
            ) from None
        except TransportError as exc:
            worker.kill()
            raise corrupted(worker, exc) from exc

    def _release_held(self) -> None:
        if self._held:
            worker, record = self._held.pop(0)
            self._send_record(worker, record, P.STEP)

    # -- receiving ------------------------------------------------------------------
    def receive(self, worker: WorkerHandle, deadline: Deadline, op: int) -> list[Any]:
        """The reply ``worker`` owes for ``op``; earlier, abandoned replies are dropped.

        Raises WaitTimeout at the deadline, SubEnvCrashed when the worker dies, and
        TransportError (after killing it) when it sends what is not a valid reply.
        The wait is the ring's (gym_fork.transport.ring.wait), with this pool's
        liveness check (:meth:`_watch`) between its slices."""
        inbox = worker.channel
        # The check between slices is one bound method made once (no closure per
        # reply on the hot path); it reads the wait's worker, op and Stall from here.
        self._watched, self._watched_op, self._stall = worker, op, None
        while True:
            try:
                reply = inbox.recv(deadline.left(), self._between)
            except PeerGone:  # died, possibly in the middle of a multi-part reply
                raise self.crashed(worker, f"during {P.NAMES[op]}") from None
            except RingTimeout:
                raise WaitTimeout from None
            except TransportError as exc:
                worker.kill()
                raise corrupted(worker, exc) from exc
            if not (
                type(reply) is list
                and len(reply) == 4
                and type(reply[1]) is int
                and (reply[3] is None or type(reply[3]) is list)
            ):
                worker.kill()
                raise corrupted(
                    worker, TransportError(f"malformed reply {reply!r:.80}", reason="shape")
                )
            if op == P.HELLO or reply[1] == worker.awaiting:
                if reply[0] != op:
                    worker.kill()
                    raise corrupted(
                        worker,
                        TransportError(
                            f"a {P.NAMES.get(reply[0], reply[0])!r} reply to a "
                            f"{P.NAMES[op]!r} request",
                            reason="shape",
                        ),
                    )
                worker.awaiting = 0
                if inbox.refused and not inbox.allow_pickle:
                    raise self._refused(worker, op, inbox.refused)
                return reply

    def _between(self) -> bool:
        """:meth:`receive`'s liveness check (the ``alive`` of its channel's wait)."""
        worker = self._watched
        assert worker is not None  # set by receive() before its wait
        self._stall = self._watch(worker, self._watched_op, self._stall)
        return self._stall is not None

    def _watch(self, worker: WorkerHandle, op: int, stall: Stall | None) -> Stall | None:
        """The liveness check between two slices of a wait for ``worker``'s ``op`` reply:
        None once it is dead, else the wait's Stall (made at the first check: the first
        slice has passed), which from then on watches for it being stopped
        (:meth:`_check_stopped`: resumed and named, or killed)."""
        if not worker.alive():
            return None
        if stall is None:
            return Stall()
        if stall.due():
            self._check_stopped(worker, stall, op)
        return stall

    def wait_any(
        self,
        ops: dict[int, int],
        deadline: Deadline,
        take: Callable[[list[int]], bool],
        watch: Watching | None = None,
    ) -> None:
        """Until ``take(positions)`` returns True: it gets the positions (in ``workers``)
        among ``ops`` (position -> the op it runs) whose worker has a reply there or is
        found dead, and removes from ``ops`` those it took. WaitTimeout at ``deadline``.
        The wait and its checks are :meth:`receive`'s, on all of them at once.

        ``watch``: for a caller that polls in short waits (gym_fork/aio): the liveness
        checks and the stopped-sandbox clocks carry over from one wait to the next, and a
        wait runs a check only once one is due (not at every poll's end)."""
        rings = AnyRing({k: self.workers[k].channel.inbox for k in ops})

        def taken(ready: list[int]) -> bool | None:
            done = take(ready)
            for k in ready:
                if k not in ops:
                    rings.drop(k)
            return done or None

        ready = rings.ready()
        if ready and taken(ready):  # the replies were there: no wait at all
            return
        if watch is None:
            started = time.monotonic()  # the first liveness check comes a slice from now
            stalls: dict[int, Stall | None] = {}
        else:
            started, stalls = watch.checked, watch.stalls

        def between() -> bool | None:
            if watch is not None:
                watch.checked = time.monotonic()
            dead = []
            for k, op in ops.items():
                stalls[k] = self._watch(self.workers[k], op, stalls.get(k))
                if stalls[k] is None:
                    dead.append(k)
            return taken(dead) if dead else None

        def attempt(ns: int) -> bool | None:
            ready = rings.within(ns)
            return None if ready is None else taken(ready)

        due = watch is None or time.monotonic() - started >= SLICE
        if not wait(attempt, deadline.end, between if due else None, checked=started):
            raise WaitTimeout

    def collect(self, op: int, timeout: float | None, *, building: bool = False) -> list[Any]:
        """Every worker's result for ``op``, in worker order; a sub-env's error is
        raised once all have answered (the vector env stays usable)."""
        deadline = Deadline(timeout)
        results, errors = [], []
        started = time.perf_counter()
        first = 0.0  # the wait for the first reply: a step's length, whatever the count
        for worker in self.workers:
            try:
                _op, _seq, result, worker_errors = self.receive(worker, deadline, op)
                if not first:
                    first = time.perf_counter() - started
            except BaseException:
                for held, _record in self._held:  # never sent: nothing to wait for
                    held.awaiting = 0
                self._held = []
                raise
            if self._held:
                self._release_held()
            results.append(result)
            if worker_errors:
                errors.extend(worker_errors)
        if op == P.STEP:  # long steps: wait for the next replies spinning longer
            rounds = self._spin.observe(first)
            if rounds != DEFAULT_SPIN or self._spinning_long:  # (new workers start short)
                self._spinning_long = rounds != DEFAULT_SPIN
                apply_spin([w.channel.inbox for w in self.workers], rounds)
        if errors:
            raise errors_exception(errors, building=building, trusted=self.trusted)
        return results

    def ask(self, worker: WorkerHandle, op: int, arg: Any, timeout: float | None) -> Any:
        """One request to one worker, its result (its error raised)."""
        return self.ask_later(worker, op, arg, timeout)()

    def ask_later(
        self, worker: WorkerHandle, op: int, arg: Any, timeout: float | None
    ) -> Callable[[], Any]:
        """Send one request to one worker now; the function returned waits for its
        result (its error raised; past ``timeout`` from now the worker is killed)."""
        seq = self._next_seq()
        worker.awaiting = seq
        self._send_record(worker, pack([op, seq, arg]), op)
        deadline = Deadline(timeout)

        def result() -> Any:
            try:
                _op, _seq, value, errors = self.receive(worker, deadline, op)
            except WaitTimeout:
                worker.kill()
                raise self.crashed(
                    worker, f"during {P.NAMES[op]}: no answer within {timeout} s"
                ) from None
            if errors:
                raise errors_exception(errors, trusted=self.trusted)
            return value

        return result

    # -- faults ---------------------------------------------------------------------
    def _refused(self, worker: WorkerHandle, op: int, sizes: list[int]) -> PickleRefused:
        """A reply of an untrusted sandbox held pickles: read whole, not loaded, refused
        (the channel stays in step and the sandbox lives on)."""
        error = PickleRefused(
            f"the {P.NAMES[op]} reply of sub-env(s) {worker.indices} held {len(sizes)} "
            f"pickled value(s) ({sum(sizes)} bytes), refused: an untrusted sandbox's "
            "pickles are never loaded. Send plain data (numbers, str, bytes, lists, dicts, "
            "numpy arrays) or pass trusted=True.",
            worker=worker.name,
        )
        error.indices = worker.indices
        return error

    def _check_stopped(self, worker: WorkerHandle, stall: Stall, op: int) -> None:
        """A stopped sandbox passes the pidfd liveness check and would be waited for
        forever: stopped for STOPPED_FOR s, it gets SIGCONT and a warning naming it and
        the suspects (every other sandbox of its tree); the MAX_STOPS-th time in one
        wait it is killed and SubEnvStopped raised (``reset()`` replaces it)."""
        state = worker.stopped()
        if not stall.seen(state):
            return
        when = f"while the controller waited for its {P.NAMES[op]} reply"
        suspects: list[tuple[WorkerHandle, bool]] = []
        if self.host.tree():  # sandboxes that can signal one another (a shared kernel)
            suspects = [(w, mine) for w, mine in self._tree() if w is not worker]
        if stall.stops >= MAX_STOPS:
            worker.kill()
            worker.watch.wait_dead(1.0)
            raise stopped_error(worker, state, stall.stops, suspects, when, self.label)
        worker.resume()
        notices.warn(stopped_note(worker, state, stall.stops, suspects, when, self.label))

    def _tree(self) -> list[tuple[WorkerHandle, bool]]:
        """The live sandboxes of this pool's tree, each with whether it is one of this
        pool's: this pool's own, and the other sandboxes of the warm parent that can
        signal them (the host's ``tree()``; none where sandboxes cannot: VMs, inline)."""
        mine = [w for w in self.workers if w.alive()]
        ours = {id(w) for w in self.workers}
        others = [w for w in self.host.tree() if id(w) not in ours]
        return [(w, True) for w in mine] + [(w, False) for w in others]

    def tree_note(self) -> str:
        """For a timeout's error: every sandbox of the tree of those that did not answer
        and whether it is stopped (read before any is killed)."""
        if not any(w.awaiting for w in self.workers):
            return ""
        return tree_note([(w, mine, w.stopped()) for w, mine in self._tree()])

    def crashed(self, worker: WorkerHandle, when: str) -> SubEnvCrashed:
        """The error for a worker found dead (its exit status from the host)."""
        worker.dead = True
        return crashed(worker, self.host.exit_code(worker), when, self.label)

    def kill_unanswered(self, op: int, what: str, timeout: float):
        """The vector env's own ``timeout`` passed: kill the sandboxes that did not
        answer and return the SubEnvTimeout that names them."""
        hung = []
        for worker in self.workers:
            if not worker.awaiting:
                continue
            try:
                self.receive(worker, Deadline(0), op)  # answered just now?
            except (WaitTimeout, SubEnvCrashed, TransportError):
                hung.append(worker)
        tree = self.tree_note()  # who is stopped, before the kills
        for worker in hung:
            worker.kill()
        details = []
        for worker in hung:
            worker.watch.wait_dead(1.0)
            details.append(self.crashed(worker, f"during {what}").args[0])
        return timed_out(what, timeout, details, hung, tree)

    def dead_positions(self) -> list[int]:
        """Positions (in ``workers``) of the sandboxes known or found dead."""
        return [k for k, w in enumerate(self.workers) if not w.alive()]

"""How a host makes many sandboxes at once: spawns in batches, forks overlapped, and the
kill-and-release of those a failed call made."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from gym_fork.hosts.base import CloneOrder, ForkJob, WorkerHandle, WorkerSpec, release_all
from gym_fork.system.held_signals import held


def spawn_in_batches(
    specs: Sequence[WorkerSpec],
    slab_fds: Sequence[int],
    batch: int,
    make: Callable[[list[WorkerSpec], list[int]], list[WorkerHandle]],
) -> list[WorkerHandle]:
    """``make(specs, slab_fds)`` per ``batch`` specs (what one request can carry); if a
    batch fails, the sandboxes of the earlier ones are killed and released."""
    handles: list[WorkerHandle] = []
    try:
        for start in range(0, len(specs), batch):
            end = start + batch
            handles += make(list(specs[start:end]), list(slab_fds[start:end]))
    except BaseException:
        release_all(handles)
        raise
    return handles


class Finishing(NamedTuple):
    """A fork asked for: ``wait()`` for the source's answer (interruptible), then
    ``adopt(answer)``: the clones' handles, made while signals are held (a Ctrl-C
    between the two would leave clones no handle holds); or ``let_go()`` of it unanswered
    (a second Ctrl-C)."""

    wait: Callable[[], Any]
    adopt: Callable[[Any], list[WorkerHandle]]
    let_go: Callable[[], None]  # never waited for: its clones' ends closed


# ``start(job, orders, slab_fds, keep)``: ask the job's source for the clones of ``orders``
# now, and hand its Finishing to ``keep`` (signals held) once asked: from then on the
# caller takes its answer, whatever comes; before, ``start`` gives the fork up itself.
StartFork = Callable[[ForkJob, list[CloneOrder], list[int], Callable[[Finishing], None]], None]


def fork_overlapped(
    jobs: Sequence[ForkJob],
    batch: int,
    start: StartFork,
    meanwhile: Callable[[], None] | None = None,
) -> list[list[WorkerHandle]]:
    """The clones of each job, ``batch`` orders per request, every source asked before
    any answer is awaited so that the sources fork at once (hosts whose clones can
    overlap). A source takes one request at a time: its next batch is asked for once the
    last one is answered. If one fails, every answer already asked for is still taken (a
    source must not be left with a stale one) and every clone made is released."""
    batches = [list(range(0, len(job.orders), batch)) for job in jobs]
    pending: deque[tuple[int, Finishing]] = deque()
    made: list[list[WorkerHandle]] = [[] for _ in jobs]

    def start_next(k: int) -> None:
        if batches[k]:
            first = batches[k][0]
            job, last = jobs[k], first + batch
            # Not held: a start given up midway waits for its source's answer, which
            # a Ctrl-C must be able to cut short. Kept as soon as it is asked.
            start(
                job,
                job.orders[first:last],
                job.slab_fds[first:last],
                lambda finishing: pending.append((k, finishing)),
            )
            batches[k].pop(0)

    try:
        for k in range(len(jobs)):
            start_next(k)
        if meanwhile is not None:  # every source is forking now
            meanwhile()
        while pending:
            k, finishing = pending[0]  # left there until adopted: a Ctrl-C meanwhile
            answer = finishing.wait()  # finds it (its wait() answers again)
            with held():  # the clones exist: their handles kept before a Ctrl-C comes
                pending.popleft()
                made[k] += finishing.adopt(answer)
            start_next(k)
    except BaseException:
        try:
            while pending:  # asked for: take the answers, then release them
                k, finishing = pending.popleft()
                try:
                    answer = finishing.wait()
                    with held():
                        made[k] += finishing.adopt(answer)
                except Exception:
                    continue
                except BaseException:  # a second Ctrl-C: the rest are let go of unanswered
                    for _k, rest in pending:
                        with contextlib.suppress(Exception):
                            rest.let_go()
                    raise
        finally:  # a second Ctrl-C while answers are taken still releases what was made
            release_all(h for handles in made for h in handles)
        raise
    return made

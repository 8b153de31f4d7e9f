"""A wait that outlasts its first slices: a sandbox found stopped (SIGSTOP), and the
words that name it and its tree's other sandboxes in warnings and errors."""

from __future__ import annotations

import signal
import time

from gym_fork.errors import SubEnvStopped
from gym_fork.hosts.base import WorkerHandle

from .waits import LIVENESS_SLICE

# A stopped sandbox (SIGSTOP from another sandbox of its tree: a stopped process passes
# the pidfd liveness check): a wait that outlasts its first slices reads the waited-for
# sandbox's state every STATE_EVERY seconds (a reply that comes in time never does);
# stopped for STOPPED_FOR seconds, it is sent SIGCONT and named; found stopped for the
# MAX_STOPS-th time in one wait, it is killed (SubEnvStopped).
STATE_EVERY = 0.5
STOPPED_FOR = 1.0
MAX_STOPS = 3

_STATES = {"T": "stopped by a signal", "t": "held in a tracing stop"}
# Sandboxes a message lists by name at most (the rest are counted).
MAX_NAMED = 32


class Stall:
    """A wait that outlasted its first liveness slice: when to read the waited-for
    sandbox's state next, since when it is seen stopped, and how often it was."""

    __slots__ = ("next_read", "since", "stops")

    def __init__(self) -> None:
        # The first slice has passed already: the first read comes STATE_EVERY into it.
        self.next_read = time.perf_counter() + STATE_EVERY - LIVENESS_SLICE
        self.since: float | None = None
        self.stops = 0

    def due(self) -> bool:
        return time.perf_counter() >= self.next_read

    def seen(self, state: str) -> bool:
        """Note the state just read; True once it has been stopped for STOPPED_FOR s (a
        stop found: counted, and its clock restarted)."""
        now = time.perf_counter()
        self.next_read = now + STATE_EVERY
        if not state:
            self.since = None
            return False
        if self.since is None:
            self.since = now
            return False
        if now - self.since < STOPPED_FOR:
            return False
        self.since = None
        self.stops += 1
        return True


def describe_state(state: str) -> str:
    """A process state letter (``/proc/<pid>/stat``) in words: stopped or not."""
    return f"STOPPED ({_STATES[state]}, state {state})" if state in _STATES else "not stopped"


def who(worker: WorkerHandle, mine: bool) -> str:
    """A sandbox as a message names it: its sub-envs (of this vector env or another one
    of the same warm parent) and its host pid."""
    if mine:
        return f"sub-env(s) {worker.indices} (pid {worker.pid})"
    return f"{worker.name} of another vector env of the same warm parent (pid {worker.pid})"


def _suspects(suspects: list[tuple[WorkerHandle, bool]]) -> str:
    if not suspects:
        return (
            "no other sandbox shares its tree, so it stopped itself (an env can signal "
            "its own process) or was stopped from outside gym_fork"
        )
    return (
        "the suspects are its own sub-envs (a process can stop itself) and the other "
        "sandboxes of its tree (one warm parent: one pid namespace, one uid; without "
        "Landlock's signal scoping each can signal the others): "
        + ", ".join(who(w, mine) for w, mine in suspects[:MAX_NAMED])
        + (f" and {len(suspects) - MAX_NAMED} more" if len(suspects) > MAX_NAMED else "")
    )


def _stopped(worker: WorkerHandle, state: str, branch: str) -> str:
    return (
        f"the sandbox of sub-env(s) {worker.indices} of branch {branch!r} (pid "
        f"{worker.pid}) was {_STATES.get(state, 'stopped')} (state {state})"
    )


_WHO_STOPS = (
    "A stop comes from a signal (the sandbox's own, or another sandbox's of its tree "
    "where Landlock does not scope signals) and the kernel does not say who sent it"
)


def stopped_note(
    worker: WorkerHandle,
    state: str,
    stops: int,
    suspects: list[tuple[WorkerHandle, bool]],
    when: str,
    branch: str,
) -> str:
    """The warning for a sandbox found stopped while the controller waited (it was
    sent SIGCONT)."""
    return (
        f"{_stopped(worker, state, branch)} for over {STOPPED_FOR:g} s {when}; it was "
        f"sent SIGCONT. {_WHO_STOPS}: {_suspects(suspects)}. Found stopped {stops} "
        f"time(s) in this wait; at "
        f"{MAX_STOPS} it is killed (SubEnvStopped)."
    )


def stopped_error(
    worker: WorkerHandle,
    state: str,
    stops: int,
    suspects: list[tuple[WorkerHandle, bool]],
    when: str,
    branch: str,
) -> SubEnvStopped:
    """A sandbox stopped again and again in one wait: the caller has killed it."""
    return SubEnvStopped(
        f"{_stopped(worker, state, branch)} {stops} times {when} (resumed with SIGCONT "
        f"after each of the first {stops - 1}) and was killed. {_WHO_STOPS}: "
        f"{_suspects(suspects)}. Call reset() to replace it with a fresh sandbox.",
        indices=worker.indices,
        pid=worker.pid,
        exitcode=-signal.SIGKILL,
        suspects=[w.pid for w, _mine in suspects],
        stops=stops,
    )


def tree_note(states: list[tuple[WorkerHandle, bool, str]]) -> str:
    """Every sandbox of the stalled ones' tree and whether it is stopped (for a
    timeout's error: a stopped sandbox does not answer, and any sandbox of the tree
    can have stopped it)."""
    if not states:
        return ""
    stopped = sum(state in _STATES for _w, _mine, state in states)
    # The stopped ones first, then those that did not answer: what a long list cuts off
    # is sandboxes that are neither.
    shown = sorted(states, key=lambda s: (s[2] not in _STATES, not (s[1] and s[0].awaiting)))
    lines = [
        f"    {who(w, mine)}{', no answer yet' if mine and w.awaiting else ''}: "
        + describe_state(state)
        for w, mine, state in shown[:MAX_NAMED]
    ]
    if len(shown) > MAX_NAMED:
        lines.append(f"    and {len(shown) - MAX_NAMED} more")
    return (
        "\nThe sandboxes of their tree (one warm parent: one pid namespace, one uid, so "
        "each can signal the others), "
        + (f"{stopped} of them stopped" if stopped else "none of them stopped")
        + ":\n"
        + "\n".join(lines)
    )

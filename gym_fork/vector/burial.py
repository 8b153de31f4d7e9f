"""The release of killed sandboxes, once their exit is seen.

A teardown SIGKILLs the sandboxes it closes; the kernel still tears their memory down
after that (~2 ms of a core for a 36 MB clone). Their handles (pidfds, scratch paths) are
released only once each exit is seen: at once when the vector env was the warm parent's
last user, else later (the next teardown or fork of the tree, or interpreter exit).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

from gym_fork.hosts.base import Host, WorkerHandle

# Per warm parent: sandboxes a teardown killed whose exit the controller has not seen yet
# (see bury()).
_DYING: weakref.WeakKeyDictionary[Host, list[WorkerHandle]] = weakref.WeakKeyDictionary()
_DYING_LOCK = threading.RLock()  # branches of one tree may be closed from two threads


def burial_lock() -> threading.RLock:
    """The lock over the killed sandboxes still listed (re-entrant: bury takes it too)."""
    return _DYING_LOCK


def _forget_in_forked_child() -> None:
    """In a fork of the controller: the parent's killed sandboxes are not ours."""
    global _DYING_LOCK
    _DYING_LOCK = threading.RLock()
    _DYING.clear()


os.register_at_fork(after_in_child=_forget_in_forked_child)


def bury_all() -> None:
    """At interpreter exit: wait for every listed killed sandbox and release it."""
    for host in list(_DYING):
        with contextlib.suppress(Exception):
            bury(host, wait=True)


def bury(host: Host, killed: list[WorkerHandle] | None = None, *, wait: bool) -> None:
    """Release the sandboxes of ``host`` that were killed (``killed``, and those earlier
    teardowns left) once their exit is seen: with ``wait``, all of them (each waited for
    up to 1 s); without, those gone already, the others kept for later.

    A killed sandbox runs no code again, but the kernel still tears its memory down
    (~2 ms of a core for a 36 MB clone). While another vector env uses the warm parent,
    close() returns without waiting for that: the next teardown or fork of the tree, the
    close of its last user, or the interpreter's exit sees them gone."""
    with _DYING_LOCK:
        dying = _DYING.setdefault(host, [])
        dying += killed or []
        waiting = list(dying)
    release_gone(waiting, wait, dying)  # the waits outside the lock
    with _DYING_LOCK:
        if not dying and _DYING.get(host) is dying:
            del _DYING[host]


def release_gone(
    killed: list[WorkerHandle], wait: bool, listed: list[WorkerHandle] | None = None
) -> None:
    """Release those of ``killed`` whose exit is seen (with ``wait``: every one, after
    up to 1 s each), each taken out of ``listed`` (shared: under the lock) once released;
    one another caller released already is skipped, and an interruption leaves the
    others listed (they are SIGKILLed already)."""
    for worker in killed:
        if not (worker.watch.wait_dead(1.0 if wait else 0) or wait):
            continue
        if listed is not None:
            with _DYING_LOCK:
                if worker not in listed:
                    continue
                listed.remove(worker)
        worker.release()

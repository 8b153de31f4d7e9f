"""A sandbox's own env code held off while its /tmp is not final for the clones it forks.

From a FORK until its clones can no longer see what it writes (its new /tmp layer taken,
or, where none is frozen, every clone's copy of its /tmp made), a source must not run env
code in its main thread: a Python signal handler or a finalizer the collector runs could
write /tmp, and the write would land in no layer its clones hold (a single-threaded
source forks while the helper swaps its /tmp: a write between the new /tmp's mount and
the fork is in the new layer, which its clones, forked on the old one, never copy), in
the frozen one (a lookup begun before that mount; read-only once sealed: EROFS), or in
their copies (a branch starting after its fork point). :func:`hold` blocks every signal
in the calling thread (their handlers run once :func:`release` unblocks them) and turns
the collector off. A clone forked meanwhile inherits the hold and releases it after its
set-up; a process another thread forks meanwhile is released at once.

What it does not hold: the source's other threads, and a signal one of them takes (its
Python handler still runs in the main thread, at its next bytecode). Swapping every
handler for a recorder was tried and taken out: it lost the handlers' C-level settings
(SA_RESTART, a library's own handler) and asyncio's wakeup fd still reached the
clones (docs/benchmarks-notebook.md, "Small things off a fork's path").
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

from gym_fork.system.linux import block_signals, restore_signals


class _Hold:
    """What :func:`hold` changed, and in which thread."""

    def __init__(self, mask: Any, collecting: bool) -> None:
        self.mask = mask
        self.collecting = collecting
        self.thread = threading.get_ident()


_held: _Hold | None = None


def held() -> bool:
    """Is env code held off in this process now?"""
    return _held is not None


def hold() -> None:
    """Hold env code off until :func:`release` (nothing more where it is held already)."""
    global _held
    if _held is not None:
        return
    mask, collecting = None, gc.isenabled()
    try:  # a handler run meanwhile (another thread took its signal) may raise: all undone
        mask = block_signals()
        gc.disable()
        _held = _Hold(mask, collecting)
    except BaseException:
        _held = None
        if collecting:
            gc.enable()
        if mask is not None:
            restore_signals(mask)
        raise


def release() -> None:
    """Undo :func:`hold` (nothing where none is held): the collector on again where it
    was, the mask restored (the handlers of signals that came meanwhile run now)."""
    global _held
    holding, _held = _held, None
    if holding is not None:
        if holding.collecting:
            gc.enable()
        restore_signals(holding.mask)


def _in_forked_child() -> None:
    """A process forked during a hold by another thread than the holder's (an env's
    thread running a subprocess or multiprocessing): no clone, nothing to hold; its
    collector on again where it was (the mask is its forking thread's)."""
    global _held
    holding = _held
    if holding is not None and holding.thread != threading.get_ident():
        _held = None
        if holding.collecting:
            gc.enable()


os.register_at_fork(after_in_child=_in_forked_child)

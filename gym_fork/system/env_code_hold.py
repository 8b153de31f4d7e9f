"""A sandbox's own env code held off while its /tmp is not final for the clones it forks.

From a FORK until its clones can no longer see what it writes (its new /tmp layer taken,
or, where none is frozen, every clone's copy of its /tmp made), a source must not run env
code in its main thread: a Python signal handler or a finalizer the collector runs could
write /tmp, and the write would land in no layer its clones hold (a single-threaded
source forks while the helper swaps its /tmp: a write between the new /tmp's mount and
the fork is in the new layer, which its clones, forked on the old one, never copy), in
the frozen one (a lookup begun before that mount; read-only once sealed: EROFS), or in
their copies (a branch starting after its fork point). :func:`hold` blocks every
signal in this thread, swaps every Python-level signal handler for a recorder (a signal
another thread of the process takes still has its handler run in the main thread, at
its next bytecode) and turns the collector off; :func:`release` undoes it and, in the
source, runs the handlers of the signals that came, in order. A clone forked meanwhile
inherits the hold and releases it after its set-up without running them (they were its
source's).

Main thread only (Python runs signal handlers there; a hold elsewhere holds nothing).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # ints, no enums: see held_signals
import gc
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from gym_fork.system.linux import block_signals, restore_signals

_SIGNALS = tuple(sorted(_signal.valid_signals()))

_Handler = Callable[[int, FrameType | None], Any]


class _Hold:
    """What :func:`hold` changed: the mask, the collector, the handlers it replaced,
    and the signals that came since."""

    def __init__(self) -> None:
        self.mask: Any = None
        self.collecting = False
        self.replaced: dict[int, _Handler] = {}
        self.came: list[tuple[int, FrameType | None]] = []

    def record(self, signum: int, frame: FrameType | None) -> None:
        self.came.append((signum, frame))


_held: _Hold | None = None


def held() -> bool:
    """Is env code held off in this process now?"""
    return _held is not None


def hold() -> None:
    """Hold env code off until :func:`release` (nothing more where it is held already)."""
    global _held
    if _held is not None or threading.current_thread() is not threading.main_thread():
        return
    holding = _Hold()
    holding.mask = block_signals()
    holding.collecting = gc.isenabled()
    gc.disable()
    _held = holding
    for signum in _SIGNALS:
        try:
            current = _signal.getsignal(signum)
            if callable(current):
                _signal.signal(signum, holding.record)
                holding.replaced[signum] = current
        except (OSError, ValueError):
            continue  # a signal no handler can be set for


def release(replay: bool = True) -> None:
    """Undo :func:`hold` (nothing where none is held): the handlers put back, the
    collector on again where it was, the mask restored; with ``replay`` the handlers
    of the signals that came meanwhile run now, in order (a clone: not)."""
    global _held
    holding, _held = _held, None
    if holding is None:
        return
    try:
        for signum, handler in holding.replaced.items():
            if _signal.getsignal(signum) == holding.record:  # env code may not swap it
                _signal.signal(signum, handler)
        if holding.collecting:
            gc.enable()
        # Before the mask: those blocked meanwhile came after these (the first handler
        # that raises ends it, as a signal's would).
        for signum, frame in holding.came if replay else ():
            holding.replaced[signum](signum, frame)
    finally:
        restore_signals(holding.mask)

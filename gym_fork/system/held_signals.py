"""Signals held back while a hand-over must not be cut in two.

A Ctrl-C raises KeyboardInterrupt at whatever bytecode the main thread is on. Where a
resource passes from one holder to the next (a frozen layer's fd from the layer helper's
answer to the fork that sends it to its source, a request sent and recorded as sent), an
exception between the two steps loses it. :func:`held` keeps the signals whose Python
handlers raise (SIGINT, SIGTERM, SIGHUP, SIGALRM) for the length of a ``with`` block and
runs their handlers, in the order they came, once the block has ended: the hand-over
completes, then the exception comes, as it would have a moment later.

Only where the wait inside is bounded by its own deadline: a held Ctrl-C waits for it.
Signal handlers run in the main thread only, so a ``with held():`` elsewhere holds
nothing, and needs to (no KeyboardInterrupt is raised there). Nested blocks hold once,
to the outermost block's end.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # the C functions under signal (why: HELD)
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

# As ints, for _signal: signal's wrappers turn every number and handler into an enum, a
# failed lookup (an exception) for each Python handler: ~20 us a block, ~2 with these
# (a fork takes ~10 blocks).
HELD = tuple(
    int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM) if s is not None
)

_Handler = Callable[[int, FrameType | None], Any]


class _Holding:
    """The outermost block's state: the handlers it replaced, the signals that came."""

    def __init__(self) -> None:
        self.replaced: dict[int, _Handler] = {}
        self.came: list[tuple[int, FrameType | None]] = []

    def record(self, signum: int, frame: FrameType | None) -> None:
        if _holding is self:
            self.came.append((signum, frame))
        else:  # left installed by a block whose exit was itself cut short: pass it on
            self.replaced[signum](signum, frame)

    def restore(self) -> None:
        """Put back the handlers it replaced (where no one replaced it meanwhile)."""
        for signum, handler in self.replaced.items():
            if _signal.getsignal(signum) == self.record:
                _signal.signal(signum, handler)


_holding: _Holding | None = None


def _in_forked_child() -> None:
    """A fork made while a block held signals (from another thread): the child never
    reaches that block's end, so it gets its handlers back now."""
    global _holding
    holding, _holding = _holding, None
    if holding is not None:
        holding.restore()


os.register_at_fork(after_in_child=_in_forked_child)


class held:
    """``with held():`` the signals in :data:`HELD` whose handlers are Python callables
    wait for the block's end (main thread; elsewhere, and inside another block, it does
    nothing)."""

    __slots__ = ("_outermost",)

    def __enter__(self) -> held:
        global _holding
        self._outermost: _Holding | None = None
        if _holding is not None or threading.current_thread() is not threading.main_thread():
            return self
        holding = _Holding()
        self._outermost = holding
        try:
            _holding = holding  # before any swap: a signal meanwhile runs its own handler
            for signum in HELD:
                current = _signal.getsignal(signum)
                if callable(current):
                    holding.replaced[signum] = current
                    _signal.signal(signum, holding.record)
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._outermost is not None:
            self._release()

    def _release(self) -> None:
        """Put the handlers back, then run each for the signals that came meanwhile (the
        first that raises ends it: the rest were the same wish to stop)."""
        global _holding
        holding = self._outermost
        assert holding is not None
        self._outermost = None
        try:
            holding.restore()  # signals meanwhile are still recorded
        finally:
            _holding = None  # from here on, a recorder left installed hands signals on
        for signum, frame in holding.came:
            holding.replaced[signum](signum, frame)

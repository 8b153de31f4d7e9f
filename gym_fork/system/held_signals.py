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

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

HELD = tuple(
    s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM) if s is not None
)

_Handler = Callable[[int, FrameType | None], Any]


class _Holding:
    """The outermost block's state: the handlers it replaced, the signals that came."""

    def __init__(self) -> None:
        self.active = True
        self.replaced: dict[int, _Handler] = {}
        self.came: list[tuple[int, FrameType | None]] = []

    def record(self, signum: int, frame: FrameType | None) -> None:
        if self.active:
            self.came.append((signum, frame))
        else:  # left installed by a block whose exit was itself cut short: pass it on
            self.replaced[signum](signum, frame)


_holding: _Holding | None = None


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
                current = signal.getsignal(signum)
                if callable(current):
                    holding.replaced[signum] = current
                    signal.signal(signum, holding.record)
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
        holding.active = False  # from here on, its recorder hands each signal straight on
        for signum, handler in holding.replaced.items():
            if signal.getsignal(signum) == holding.record:
                signal.signal(signum, handler)
        _holding = None
        for signum, frame in holding.came:
            holding.replaced[signum](signum, frame)

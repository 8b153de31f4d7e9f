"""The deadline of a wait on a sandbox, and how often it checks the sandbox is alive."""

from __future__ import annotations

import time

from gym_fork.transport.ring import SLICE

# How often a wait checks that the worker it waits on is still alive: the ring's slice.
LIVENESS_SLICE = SLICE


class Deadline:
    """A point in time (``time.monotonic()``) a wait must not pass (None: no deadline)."""

    __slots__ = ("end",)

    def __init__(self, timeout: float | None) -> None:
        self.end = None if timeout is None else time.monotonic() + timeout

    def slice(self) -> float:
        """Seconds to wait before the next liveness check; 0 when past the deadline."""
        if self.end is None:
            return LIVENESS_SLICE
        return max(0.0, min(LIVENESS_SLICE, self.end - time.monotonic()))

    def left(self) -> float | None:
        """Seconds to the deadline, 0 once past it (None: no deadline)."""
        end = self.end
        return None if end is None else max(0.0, end - time.monotonic())


class WaitTimeout(Exception):
    """A wait reached its deadline (the caller turns it into the user's error)."""

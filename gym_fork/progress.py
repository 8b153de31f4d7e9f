"""Progress bars for long work: kernel download, image build, first microVM boot, large
fan-outs and benchmark runs.

Shown on stderr only when it is a terminal; ``GYM_FORK_PROGRESS=0`` silences them,
``GYM_FORK_PROGRESS=1`` forces them on (a pipe or a log file then gets the bar's
terminal codes), and every entry point takes ``quiet=True``. All bars of a process share
one live display (rich allows one at a time), so nested or concurrent tasks stack::

    from gym_fork import progress

    with progress.task("cloning 64 sandboxes", total=64) as bar:
        for _ in range(64):
            ...
            bar.advance()

    for item in progress.track(items, "measuring"):
        ...
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

from gym_fork import knobs

ENV_VAR = "GYM_FORK_PROGRESS"
_OFF = {"0", "false", "no", "off", "never"}
_ON = {"1", "true", "yes", "on", "always", "force"}

T = TypeVar("T")


def setting() -> bool | None:
    """``GYM_FORK_PROGRESS`` read as True (forced on), False (off) or None (automatic)."""
    value = knobs.read(ENV_VAR).strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return None


def enabled(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """Whether progress is shown: not ``quiet``, not switched off by ``GYM_FORK_PROGRESS``,
    and ``stream`` (default stderr) is a terminal unless ``GYM_FORK_PROGRESS`` forces it."""
    if quiet:
        return False
    forced = setting()
    if forced is not None:
        return forced
    stream = stream if stream is not None else sys.stderr
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class _Display:
    """The one rich live display of this process, started with its first shown task and
    stopped with its last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.progress: Any = None
        self.shown = 0

    def add(self, description: str, total: float | None, completed: float) -> int:
        with self.lock:
            if self.progress is None:
                self.progress = _new_progress(sys.stderr, force=setting() is True)
            task_id = self.progress.add_task(description, total=total, completed=completed)
            self.shown += 1
            if self.shown == 1:
                # After add_task, so that the first frame already shows the task.
                self.progress.start()
            return task_id

    def update(self, task_id: int, **fields: Any) -> None:
        with self.lock:
            if self.progress is not None:
                self.progress.update(task_id, **fields)

    def remove(self, task_id: int) -> None:
        with self.lock:
            if self.progress is None:
                return
            self.progress.remove_task(task_id)
            self.shown -= 1
            if self.shown == 0:
                self.progress.stop()
                self.progress = None


_DISPLAY = _Display()


def _forget_display() -> None:
    # A forked child has no refresh thread; it starts over with a display of its own.
    global _DISPLAY
    _DISPLAY = _Display()


os.register_at_fork(after_in_child=_forget_display)


def _new_progress(stream: TextIO, *, force: bool) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.text import Text

    class CountColumn(MofNCompleteColumn):
        """``done/total``, or nothing for a spinner (no total)."""

        def render(self, task: Any) -> Text:
            return super().render(task) if task.total is not None else Text("")

    console = Console(file=stream, force_terminal=True if force else None)
    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        CountColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        # A library must not swap the user's sys.stdout/sys.stderr under them.
        redirect_stdout=False,
        redirect_stderr=False,
    )


class Task:
    """One unit of long work: ``advance()`` as it goes; shown (after ``delay`` seconds)
    while the ``with`` block runs, and a no-op object where progress is off."""

    def __init__(
        self, description: str, total: float | None = None, *, quiet: bool = False, delay: float = 0
    ) -> None:
        self.description = description
        self.total = total
        self.completed: float = 0
        self.delay = delay
        self.active = enabled(quiet)
        self._lock = threading.Lock()
        self._task_id: int | None = None
        self._display: _Display | None = None
        self._timer: threading.Timer | None = None
        self._closed = False
        self.started = time.perf_counter()

    def __enter__(self) -> Task:
        self.started = time.perf_counter()
        if self.active:
            if self.delay > 0:
                # A short task never draws anything (no flashing bar on a quick fan-out).
                self._timer = threading.Timer(self.delay, self._show)
                self._timer.daemon = True
                self._timer.start()
            else:
                self._show()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _show(self) -> None:
        with self._lock:
            if self._closed or self._task_id is not None:
                return
            self._display = _DISPLAY
            self._task_id = self._display.add(self.description, self.total, self.completed)

    def advance(self, amount: float = 1) -> None:
        """Count ``amount`` more units done."""
        self.update(completed=self.completed + amount)

    def update(
        self,
        *,
        completed: float | None = None,
        total: float | None = None,
        description: str | None = None,
    ) -> None:
        """Set how much is done, the total, or the description."""
        with self._lock:
            fields: dict[str, Any] = {}
            if completed is not None:
                self.completed = fields["completed"] = completed
            if total is not None:
                self.total = fields["total"] = total
            if description is not None:
                self.description = fields["description"] = description
            if self._task_id is not None and self._display is not None and fields:
                self._display.update(self._task_id, **fields)

    def track(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from ``iterable``, advancing by one after each item."""
        for item in iterable:
            yield item
            self.advance()

    def close(self) -> None:
        """Remove the bar (if it was shown); later calls do nothing."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            task_id, display = self._task_id, self._display
            self._task_id = None
        if task_id is not None and display is not None:
            display.remove(task_id)

    @property
    def elapsed(self) -> float:
        """Seconds since the task started."""
        return time.perf_counter() - self.started


def task(
    description: str, total: float | None = None, *, quiet: bool = False, delay: float = 0
) -> Task:
    """A progress bar for ``with``: ``total`` units (None: a spinner with elapsed time),
    drawn only if the work lasts longer than ``delay`` seconds."""
    return Task(description, total, quiet=quiet, delay=delay)


def track(
    iterable: Iterable[T],
    description: str,
    total: float | None = None,
    *,
    quiet: bool = False,
    delay: float = 0,
) -> Iterator[T]:
    """Iterate over ``iterable`` with a progress bar (total: ``len(iterable)`` if it has one)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with task(description, total, quiet=quiet, delay=delay) as bar:
        yield from bar.track(iterable)

"""Fault translation: what went wrong in a sandbox, as the exception the user gets.

No I/O here: callers hand in what they observed (a worker's error records, its exit
code, its last stderr lines) and raise what these functions build.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import cloudpickle
from gymnasium import logger

from gym_fork.errors import (
    SubEnvCrashed,
    SubEnvError,
    SubEnvTimeout,
    TransportError,
    like_builtin,
)
from gym_fork.hosts.base import WorkerHandle
from gym_fork.system.linux import describe_status

# Lines of a dead sandbox's stderr quoted in SubEnvCrashed.
STDERR_LINES = 10

# How often a wait checks that the worker it waits on is still alive.
LIVENESS_SLICE = 0.1


class Deadline:
    """A point in time a wait must not pass (None: no deadline), in liveness slices."""

    def __init__(self, timeout: float | None) -> None:
        self.end = None if timeout is None else time.perf_counter() + timeout

    def slice(self) -> float:
        """Seconds to wait before the next liveness check; 0 when past the deadline."""
        if self.end is None:
            return LIVENESS_SLICE
        return max(0.0, min(LIVENESS_SLICE, self.end - time.perf_counter()))

    def expired(self) -> bool:
        """True once the deadline has passed."""
        return self.end is not None and time.perf_counter() >= self.end


class WaitTimeout(Exception):
    """A wait reached its deadline (the caller turns it into the user's error)."""


def _text(value: Any, limit: int = 64 * 1024) -> str:
    return value[:limit] if isinstance(value, str) else repr(value)[:limit]


def worker_exception(
    record: dict[str, Any], *, building: bool = False, trusted: bool = True
) -> BaseException:
    """The exception a worker's error record stands for, with the worker's traceback as
    a note. Only a trusted sandbox's pickled exception is unpickled."""
    if not isinstance(record, dict):
        return TransportError(f"malformed error record {record!r:.200}", reason="shape")
    index = record.get("index")
    type_name = _text(record.get("type"), 200)
    message = _text(record.get("message"))
    trace = _text(record.get("traceback"))
    exc = None
    pickled = record.get("pickled")
    if trusted and isinstance(pickled, bytes):
        try:
            exc = cloudpickle.loads(pickled)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        if trusted:
            exc = RuntimeError(f"{type_name}: {message}")
        else:
            bases = record.get("bases")
            bases = tuple(_text(b, 200) for b in bases[:32]) if isinstance(bases, list) else ()
            exc = like_builtin(SubEnvError, type_name, bases)(
                f"{type_name}: {message}", index=index, type_name=type_name, traceback=trace
            )
    what = "while building" if building else "in"
    exc.add_note(f"[gym_fork] raised {what} sub-env {index}; the worker's traceback:\n{trace}")
    exc.gym_fork_index = index
    return exc


def _record_index(record: Any) -> int:
    index = record.get("index") if isinstance(record, dict) else None
    return index if type(index) is int else -1


def errors_exception(
    records: list[Any], *, building: bool = False, trusted: bool = True
) -> BaseException:
    """One exception for a call's error records: the one of the highest sub-env index
    (as AsyncVectorEnv raises the last), every record logged with its traceback."""
    ordered = sorted(records, key=_record_index)
    exc: BaseException | None = None
    for record in ordered:
        exc = worker_exception(record, building=building, trusted=trusted)
        if isinstance(record, dict):
            # AsyncVectorEnv's three-part log (error, traceback, last line), except that
            # its "Worker-N - Shutting it down" would be false here: nothing is shut down.
            logger.error(
                f"sub-env {record.get('index')} raised {_text(record.get('type'), 200)}: "
                f"{_text(record.get('message'), 2000)} (its sandbox keeps serving)"
            )
            logger.error(_text(record.get("traceback")))
    logger.error("Raising the last exception back to the main process.")
    return exc


def crashed(worker: WorkerHandle, exit_code: int | None, when: str, branch: str) -> SubEnvCrashed:
    """A sandbox died: name it, its exit status and its last stderr lines."""
    worker.dead = True
    tail = worker.output_tail("stderr").rstrip().splitlines()[-STDERR_LINES:]
    stderr = "\n".join("    " + line for line in tail) if tail else "    (nothing)"
    error = SubEnvCrashed(
        f"the sandbox of sub-env(s) {worker.indices} of branch {branch!r} "
        f"(pid {worker.pid}) died {when}: {describe_status(exit_code)}. Call reset() to "
        f"replace it with a fresh sandbox. Its last stderr lines:\n{stderr}",
        indices=worker.indices,
        pid=worker.pid,
        exitcode=exit_code,
    )
    error.stderr_tail = "\n".join(tail)
    return error


def corrupted(worker: WorkerHandle, exc: TransportError) -> TransportError:
    """A sandbox wrote bytes that are not a valid reply: it cannot be trusted any more.
    The caller has killed it (reset() replaces it)."""
    error = TransportError(
        f"sub-env(s) {worker.indices} (pid {worker.pid}) sent a corrupt record and were "
        f"killed; call reset() to replace them. {exc}",
        worker=worker.name,
        reason=getattr(exc, "reason", ""),
    )
    error.indices = worker.indices
    return error


def timed_out(what: str, timeout: float, details: list[str], hung: list[WorkerHandle]):
    """The vector env's own ``timeout`` passed and the sandboxes ``hung`` were killed."""
    return SubEnvTimeout(
        f"{what} took longer than timeout={timeout} s; the sandboxes that did not "
        f"answer were killed:\n" + "\n".join(details),
        indices=[i for w in hung for i in w.indices],
        pid=hung[0].pid if hung else None,
        exitcode=-signal.SIGKILL,
    )

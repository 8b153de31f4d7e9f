"""Fault translation: what went wrong in a sandbox, as the exception the user gets
(waits: gym_fork/vector/waits.py; stopped sandboxes: gym_fork/vector/stalls.py).

No I/O here: callers hand in what they observed (a worker's error records, its exit
code, its last stderr lines) and raise what these functions build.
"""

from __future__ import annotations

import logging
import re
import signal
from typing import Any

import cloudpickle

from gym_fork import notices
from gym_fork.errors import (
    SubEnvCrashed,
    SubEnvError,
    SubEnvTimeout,
    TransportError,
    like_builtin,
)
from gym_fork.hosts.base import WorkerHandle
from gym_fork.system.linux import describe_status
from gym_fork.text_safety import escape_controls

# Every sub-env's traceback goes here at DEBUG; the user sees one line per distinct error.
log = logging.getLogger("gym_fork.vector")

# Characters of an error's message in its one-line summary.
SUMMARY_TEXT = 300
# Other distinct errors of one call whose tracebacks the raised exception's note quotes.
MAX_NOTED = 4

# Lines of a dead sandbox's stderr quoted in SubEnvCrashed.
STDERR_LINES = 10


def _text(value: Any, limit: int = 64 * 1024) -> str:
    """A string field of a sandbox's record, bounded and with control characters
    escaped (error texts are shown later, on whatever stream)."""
    return escape_controls(value[:limit] if isinstance(value, str) else repr(value)[:limit])


def worker_exception(
    record: dict[str, Any], *, building: bool = False, trusted: bool = False
) -> BaseException:
    """The exception a worker's error record stands for, with the worker's traceback as
    a note. Only a ``trusted`` sandbox's pickled exception is unpickled."""
    if not isinstance(record, dict):
        return TransportError(f"malformed error record {record!r:.200}", reason="shape")
    index = _record_index(record)  # the sandbox's word: an int, or -1
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
    hint = sandbox_default_hint(exc, message)
    if hint:
        exc.add_note(hint)
    _mark(exc, gym_fork_index=index)
    return exc


def _mark(exc: BaseException, **attributes: Any) -> None:
    """Set gym_fork's own attributes (``gym_fork_index``, ``gym_fork_errors``, ...) on
    an exception of any type (the user's own, as raised in the sandbox)."""
    for name, value in attributes.items():
        setattr(exc, name, value)


# errno values (as the message of an OSError shows them) that a default of the sandbox
# causes, and the option that lifts it.
_DEFAULT_HINTS = {
    30: "[gym_fork] sandboxes see the host's files read-only (EROFS): pass "
    "writable_paths=[...] to ForkVectorEnv for directories an env must write (relative "
    'to your working directory, where sandboxes start: writable_paths=["."] for it), '
    "or private_tmp=False for the host's /tmp.",
    13: "[gym_fork] sandboxes run env code as an unprivileged uid of their own (EACCES): "
    "what only its owner (root) may read or write is closed to them. Make it readable "
    "(or writable) by other users, or pass sandbox_user='root' to ForkVectorEnv.",
    75: "[gym_fork] sandboxes run env code as an unprivileged uid of their own (EOVERFLOW): "
    "a directory of the host owned by root cannot be copied into a sandbox's private "
    "/tmp. Write into a directory the env makes (tempfile.mkdtemp()), pass "
    "private_tmp=False for the host's /tmp, or sandbox_user='root'.",
    101: "[gym_fork] sandboxes have no network by default (ENETUNREACH): pass network=True.",
    -2: "[gym_fork] sandboxes have no network by default (no name resolution): pass network=True.",
    -3: "[gym_fork] sandboxes have no network by default (no name resolution): pass network=True.",
}
_ERRNO_IN_MESSAGE = re.compile(r"\[Errno (-?\d+)\]")


def sandbox_default_hint(exc: BaseException, message: str) -> str | None:
    """The note naming the option that lifts the sandbox default an OSError came from
    (read-only host, no network), or None."""
    if not isinstance(exc, OSError) and "Error" not in type(exc).__name__:
        return None
    code = exc.errno if isinstance(exc, OSError) and exc.errno is not None else None
    if code is None:
        found = _ERRNO_IN_MESSAGE.search(message)
        code = int(found.group(1)) if found else None
    return _DEFAULT_HINTS.get(code) if code is not None else None


def _record_index(record: Any) -> int:
    index = record.get("index") if isinstance(record, dict) else None
    return index if type(index) is int else -1


def index_ranges(indices: list[int]) -> str:
    """Sub-env indices as short ranges, in order: ``[9, 7, 0, 1, 2, 3, 8]`` -> ``"0-3, 7-9"``,
    ``[4, 5]`` -> ``"4, 5"``."""
    parts: list[str] = []
    ordered = sorted(i for i in set(indices) if i >= 0)
    start = 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            if last - first >= 2:
                parts.append(f"{first}-{last}")
            else:
                parts.extend(str(i) for i in range(first, last + 1))
            start = i
    if any(i < 0 for i in indices):  # a record that named no valid index
        parts.append("?")
    return ", ".join(parts)


def _line(text: str, limit: int = SUMMARY_TEXT) -> str:
    """The first line of a sandbox's text, shortened, without control characters (it is
    printed to the user's terminal and a sandbox's text is not trusted)."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    first = "".join(c if c.isprintable() else repr(c)[1:-1] for c in first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


def _summary(key: tuple[str, str], indices: list[int], building: bool) -> str:
    what = f"sub-env{'s' if len(indices) > 1 else ''} {index_ranges(indices)}"
    return f"{key[0]}: {key[1]} ({what}{', while being built' if building else ''}"


def errors_exception(
    records: list[Any], *, building: bool = False, trusted: bool = False
) -> BaseException:
    """One exception for a call's error records: the one of the highest sub-env index
    (as AsyncVectorEnv raises the last). One error line is logged per distinct error
    (type and message) naming its sub-envs; every traceback is on the exception
    (``gym_fork_tracebacks``: index -> text; ``gym_fork_errors``: index -> exception)
    and logged at DEBUG by the ``gym_fork`` logger."""
    ordered = sorted(records, key=_record_index)
    errors: dict[int, BaseException] = {}
    tracebacks: dict[int, str] = {}
    groups: dict[tuple[str, str], list[int]] = {}
    exc: BaseException | None = None
    for record in ordered:
        exc = worker_exception(record, building=building, trusted=trusted)
        index = _record_index(record)
        if isinstance(record, dict):
            key = (_line(_text(record.get("type"), 200), 200), _line(_text(record.get("message"))))
            trace = _text(record.get("traceback"))
        else:
            key, trace = (type(exc).__name__, _line(str(exc))), ""
        groups.setdefault(key, []).append(index)
        errors[index], tracebacks[index] = exc, trace
        log.debug(
            "sub-env %s raised %s%s: %s; its traceback:\n%s",
            index,
            key[0],
            " while being built" if building else "",
            key[1],
            trace,
        )
    if exc is None:
        raise ValueError("errors_exception needs at least one error record")
    raised = _record_index(ordered[-1])
    for key, indices in groups.items():
        line = _summary(key, indices, building)
        if raised in indices and len(ordered) > 1:
            line += (
                f"; sub-env {raised}'s is raised, with every traceback as its "
                "gym_fork_tracebacks; logger 'gym_fork' logs them at DEBUG"
            )
        notices.error(line + ")")
    if len(ordered) > 1:
        exc.add_note(_call_note(groups, raised, tracebacks, building))
    _mark(exc, gym_fork_errors=errors, gym_fork_tracebacks=tracebacks)
    return exc


def _call_note(
    groups: dict[tuple[str, str], list[int]],
    raised: int,
    tracebacks: dict[int, str],
    building: bool,
) -> str:
    """The raised exception's note on the other failures of the same call: which
    sub-envs raised the same error, and each other distinct error with its first
    sub-env's traceback (the first MAX_NOTED of them)."""
    same = next(indices for indices in groups.values() if raised in indices)
    parts = [
        f"[gym_fork] {sum(map(len, groups.values()))} sub-envs failed in this call; every "
        "traceback: exc.gym_fork_tracebacks[index]"
    ]
    if len(same) > 1:
        parts.append(f"the same error in sub-envs {index_ranges(same)}")
    others = [(key, indices) for key, indices in groups.items() if indices is not same]
    for key, indices in others[:MAX_NOTED]:
        parts.append(
            f"{_summary(key, indices, building)}); sub-env {indices[0]}'s traceback:\n"
            + tracebacks[indices[0]].rstrip()
        )
    if len(others) > MAX_NOTED:
        rest = [i for _key, indices in others[MAX_NOTED:] for i in indices]
        parts.append(f"and {len(others) - MAX_NOTED} more errors (sub-envs {index_ranges(rest)})")
    return "\n".join(parts)


def crashed(worker: WorkerHandle, exit_code: int | None, when: str, branch: str) -> SubEnvCrashed:
    """A sandbox died: name it, its exit status and its last stderr lines, control
    characters escaped (the caller marks the worker dead)."""
    tail = escape_controls(worker.output_tail("stderr")).rstrip().split("\n")[-STDERR_LINES:]
    stderr = "\n".join("    " + line for line in tail) if tail else "    (nothing)"
    return SubEnvCrashed(
        f"the sandbox of sub-env(s) {worker.indices} of branch {branch!r} "
        f"(pid {worker.pid}) died {when}: {describe_status(exit_code)}. Call reset() to "
        f"replace it with a fresh sandbox. Its last stderr lines:\n{stderr}",
        indices=worker.indices,
        pid=worker.pid,
        exitcode=exit_code,
    )


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


def timed_out(
    what: str, timeout: float, details: list[str], hung: list[WorkerHandle], tree: str = ""
):
    """The vector env's own ``timeout`` passed and the sandboxes ``hung`` were killed;
    ``tree``: the states of their tree's sandboxes (:func:`tree_note`)."""
    return SubEnvTimeout(
        f"{what} took longer than timeout={timeout} s; the sandboxes that did not "
        f"answer were killed:\n" + "\n".join(details) + tree,
        indices=[i for w in hung for i in w.indices],
        pid=hung[0].pid if hung else None,
        exitcode=-signal.SIGKILL,
    )

"""The append-only lineage log: one JSON object per line, one line per event.

The controller may run as root while a sandbox reaches the log's directory, so the log
is a path the controller does not trust. It is opened without following a symlink
(``O_NOFOLLOW``) or blocking on a FIFO (``O_NONBLOCK``), inside a directory owned by
this user (or root) that others cannot write unless it is sticky (as /tmp), and written
only when it is a regular file with a single link owned by this user. Anything else is
left alone with a warning that names the path and the reason: the provenance line is
lost, the user's run is not (nothing raises inside a step). A missing directory is made
with mode 0700.

Read back, every line is parsed and typed (:func:`event_problem`): an id is a str, a
count an int, a time a finite number, ... A line that is not such an event (bad JSON, a
wrong type, a line longer than :data:`MAX_LINE`) is skipped and counted:
``read_log(path).skipped``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gym_fork import knobs

from . import rotation

ENV_VAR = "GYM_FORK_LINEAGE_LOG"
# The longest line read back (a root record with its baseline inputs is a few KB).
MAX_LINE = 16 << 20


def default_log_path() -> Path | None:
    """$GYM_FORK_LINEAGE_LOG ("" disables), else $XDG_STATE_HOME/gym_fork/lineage.jsonl."""
    configured = knobs.given(ENV_VAR)
    if configured is not None:
        return Path(configured) if configured else None
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(state) / "gym_fork" / "lineage.jsonl"


class LogRefused(OSError):
    """A lineage log (or its directory) that is not safe to write or read."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return f"of mode {mode:o}"


def _check_file(st: os.stat_result, *, writing: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise LogRefused(f"not a regular file ({_kind(st.st_mode)})")
    if writing:
        if st.st_uid != os.geteuid():
            raise LogRefused(f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
        if st.st_nlink != 1:
            raise LogRefused(f"it has {st.st_nlink} hard links (a link to another file?)")


def _check_directory(st: os.stat_result) -> None:
    if st.st_uid not in (os.geteuid(), 0):
        raise LogRefused(f"its directory is owned by uid {st.st_uid}")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise LogRefused("its directory is writable by others and not sticky")


def _refusal(exc: OSError, what: str) -> OSError:
    """The errors a planted path gives on open, said plainly."""
    if exc.errno == errno.ELOOP:
        return LogRefused(f"{what} is a symlink; not followed")
    if exc.errno == errno.ENXIO:
        return LogRefused(f"{what} is not a regular file (a FIFO with no reader)")
    if exc.errno == errno.EISDIR:
        return LogRefused(f"{what} is not a regular file (a directory)")
    return exc


_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY


def _open_directory(path: Path) -> int:
    """An fd of the log's directory (made 0700 if missing), refused if others may plant
    files in it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_directory(os.fstat(directory))
    except BaseException:
        os.close(directory)
        raise
    return directory


def _open_in(directory: int, name: str) -> int:
    """An fd to append to ``name`` in ``directory`` (see the module docstring for what
    is refused)."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _FLAGS, 0o644, dir_fd=directory)
    except OSError as exc:
        raise _refusal(exc, "it") from None
    try:
        _check_file(os.fstat(fd), writing=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class LineageLog:
    """Appends events to a JSONL file; each event is one ``write`` on an O_APPEND fd, so
    concurrent writers (several controllers) never interleave within a line. A log it
    may not write (see the module docstring) gets a warning and no line. A log that
    would grow past ``max_bytes`` (default: :func:`~gym_fork.lineage.rotation.max_bytes`)
    is rotated first (:mod:`gym_fork.lineage.rotation`)."""

    def __init__(self, path: str | os.PathLike | None, *, max_bytes: int | None = None) -> None:
        self.path = Path(path) if path else None
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def append(self, event: dict[str, Any]) -> None:
        """Write one event as one line (or warn and write nothing)."""
        if self.path is None:
            return
        line = (json.dumps(event, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            try:
                fd = self._open(len(line))
            except OSError as exc:
                self._warn(exc)
                return
            try:
                os.write(fd, line)
            except OSError as exc:
                self._warn(exc)
            finally:
                os.close(fd)

    def _open(self, adding: int) -> int:
        """An fd of the log with room for ``adding`` bytes, rotating a full one."""
        assert self.path is not None
        limit = self.max_bytes or rotation.max_bytes()
        directory = _open_directory(self.path)
        try:
            for _attempt in range(3):  # another writer may rotate between our steps
                fd = _open_in(directory, self.path.name)
                size = os.fstat(fd).st_size
                if size == 0 or size + adding <= limit:
                    return fd
                try:
                    moved = rotation.rotate(fd, directory, self.path.name)
                except OSError as exc:
                    self._warn(exc, "not rotated, written as it is")
                    return fd
                if not moved:
                    return fd
                os.close(fd)
            return _open_in(directory, self.path.name)
        finally:
            os.close(directory)

    def _warn(self, exc: OSError, outcome: str = "not written") -> None:
        reason = str(exc) if isinstance(exc, LogRefused) else (exc.strerror or str(exc))
        lost = "; this event is not recorded" if outcome == "not written" else ""
        warnings.warn(
            f"gym_fork lineage log {self.path}: {outcome} ({reason}){lost}",
            stacklevel=3,
        )


# -- reading back ---------------------------------------------------------------------

_INT_LIMIT = 1 << 128  # ids, counts, pids, seeds: far beyond any honest one


def _int(value: Any) -> bool:
    return type(value) is int and -_INT_LIMIT < value < _INT_LIMIT


def _count(value: Any) -> bool:
    return _int(value) and value >= 0


def _number(value: Any) -> bool:
    return _int(value) or (type(value) is float and math.isfinite(value))


def _str(value: Any) -> bool:
    return type(value) is str


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: type(value) is list and all(check(v) for v in value)


def _dict_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: (
        type(value) is dict and all(type(k) is str and check(v) for k, v in value.items())
    )


def _any(_value: Any) -> bool:
    return True


# The run record of a root (gym_fork.lineage.runs.current_run): who made it, where, when.
RUN_FIELDS: dict[str, Callable[[Any], bool]] = {
    "id": _str,
    "started": _number,
    "pid": _int,
    "hostname": _str,
    "argv": _list_of(_str),
    "cwd": _optional(_str),
    "env_ids": _list_of(_str),
    "makers": _list_of(_str),
}


def _run_record(value: Any) -> bool:
    return type(value) is dict and all(
        check(value[name]) for name, check in RUN_FIELDS.items() if name in value
    )


# The fields gym_fork writes, and the type each must have when present. Other fields
# (those of events such as "replaced") are kept as parsed and never rendered.
FIELDS: dict[str, Callable[[Any], bool]] = {
    "event": _str,
    "branch_id": _str,
    "parent_branch_id": _optional(_str),
    "baseline_id": _optional(_str),
    "num_envs": _count,
    "source_indices": _list_of(_count),
    "copies": _count,
    "seeds": _optional(_list_of(_optional(_int))),
    "created": _optional(_number),
    "closed": _optional(_number),
    "time": _optional(_number),
    "exit_status": _optional(_str),
    "timings": _dict_of(_number),
    "pids": _list_of(_int),
    "isolation": _optional(_dict_of(_any)),
    "baseline_inputs": _optional(_dict_of(_any)),
    "gpu_memory": _optional(_int),
    "gpu_memory_created": _optional(_int),
    "gpu_memory_closed": _optional(_int),
    "run": _optional(_run_record),
}
# Events that make or close a branch must name it.
NEEDS_BRANCH = ("root_ready", "branch_created", "closed")


def event_problem(event: Any) -> str | None:
    """Why ``event`` is not a lineage event gym_fork could have written (None: it is)."""
    if type(event) is not dict:
        return f"not a JSON object but {type(event).__name__}"
    if "event" not in event:
        return "no 'event' field"
    for name, check in FIELDS.items():
        if name in event and not check(event[name]):
            return f"field {name!r} has the wrong type or range: {event[name]!r:.60}"
    if event["event"] in NEEDS_BRANCH and "branch_id" not in event:
        return f"a {event['event']!r} event without a branch_id"
    return None


def valid_events(events: Any) -> list[dict[str, Any]]:
    """The events of ``events`` that pass :func:`event_problem`, in order."""
    return [e for e in events if event_problem(e) is None]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a lineage log holds")


def parse_event(line: bytes | str) -> dict[str, Any] | None:
    """One log line as a typed event, or None if it is not one."""
    try:
        event = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, a 5000-digit int, nesting
        return None
    return event if event_problem(event) is None else None


class Events(list):
    """The events of a log, in order; ``skipped`` counts its malformed lines, ``refused``
    says which rotated files were not read and why."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.skipped = 0
        self.refused: list[str] = []


def read_log(path: str | os.PathLike) -> Events:
    """All events of a lineage log, each typed (:func:`event_problem`); a malformed line
    (a torn last line of a killed writer too) is skipped and counted in ``.skipped``.

    Raises FileNotFoundError for a missing log and :class:`LogRefused` for one that is a
    symlink (not followed) or not a regular file (a FIFO is never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | _FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _refusal(exc, str(path)) from None
    try:
        _check_file(os.fstat(fd), writing=False)
    except LogRefused as exc:
        os.close(fd)
        raise LogRefused(f"{path} is {exc}") from None
    with os.fdopen(fd, "rb") as f:
        events = Events()
        while True:
            line = f.readline(MAX_LINE + 1)
            if not line:
                break
            if len(line) > MAX_LINE:  # skip the rest of an overlong line
                events.skipped += 1
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                continue
            line = line.strip()
            if not line:
                continue
            event = parse_event(line)
            if event is None:
                events.skipped += 1
            else:
                events.append(event)
    return events


def read_logs(path: str | os.PathLike) -> Events:
    """The events of a log and of its rotated files (:func:`read_log` each), oldest
    first. A rotated file that is missing is passed over; one that is refused (a
    symlink, a FIFO, ...) too, named in ``.refused``. Raises as :func:`read_log` for the
    log itself, FileNotFoundError only when neither it nor a rotated file exists."""
    events = Events()
    found = False
    for rotated in rotation.rotated_paths(path):
        try:
            part = read_log(rotated)
        except FileNotFoundError:
            continue
        except OSError as exc:
            events.refused.append(str(exc))
            continue
        found = True
        events.extend(part)
        events.skipped += part.skipped
    try:
        part = read_log(path)
    except FileNotFoundError:
        if not found:
            raise
        return events
    events.extend(part)
    events.skipped += part.skipped
    return events

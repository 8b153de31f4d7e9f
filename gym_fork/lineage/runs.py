"""Runs: the lineage records of one controller process, told apart by host name, pid
and the process's start time (together the run's ``id``).

Each root (a vector env not made by ``fork``) records its run (:func:`current_run`):
when the process started, its argv (the script and its arguments), its working dir, the
host name, the pid and the env ids of its sub-envs (or the names of their env
factories). Readers group the roots of a log by run (:func:`group_runs`), newest last,
and pick the runs to show (:func:`select_runs`): the latest, the last N, those since a
time, or the one holding a branch. A root with no run record (a log written before
gym_fork kept them, or a branch whose root is not in the log) is a run of its own.

The log is not trusted: a run record read back is typed (``log.RUN_FIELDS``), every
string of it is clipped here and made printable where shown.
"""

from __future__ import annotations

import datetime
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from .log import Events
from .nodes import BranchNode, branch_nodes, local_time, printable, tree_of

# Bounds of what one run record holds (written and read back alike).
MAX_ARGV = 32  # argv entries kept; more are counted in a last "... +N more" entry
MAX_TEXT = 256  # characters of one argv entry, the cwd, the host name, an env id
MAX_ENV_IDS = 8

_STARTED: dict[int, float] = {}  # pid -> its start time (a forked child is a new run)


def _clip(text: str, width: int = MAX_TEXT) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _bounded(values: Iterable[Any], limit: int) -> list[str]:
    """At most ``limit`` distinct non-empty strings, each clipped."""
    out: list[str] = []
    for value in values:
        if isinstance(value, str) and value and _clip(value) not in out:
            out.append(_clip(value))
        if len(out) == limit:
            break
    return out


def _argv(argv: list[Any]) -> list[str]:
    kept = [_clip(str(a)) for a in argv[:MAX_ARGV]]
    if len(argv) > MAX_ARGV:
        kept.append(f"... +{len(argv) - MAX_ARGV} more")
    return kept


def process_start_time(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, as a Unix time to about 10 ms
    (from /proc: its start in clock ticks since boot against the uptime now; None where
    that cannot be read)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
    except (OSError, ValueError, IndexError):
        return None
    return now - max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def current_run(env_ids: Iterable[str | None] = (), makers: Iterable[Any] = ()) -> dict[str, Any]:
    """The run record of a root made now by this process: ``env_ids`` from the env
    specs (where known), ``makers`` the env factories (their names are kept)."""
    pid = os.getpid()
    started = _STARTED.get(pid)
    if started is None:
        started = _STARTED[pid] = process_start_time() or time.time()
    try:
        cwd: str | None = _clip(os.getcwd(), 4 * MAX_TEXT)
    except OSError:  # its working dir was removed
        cwd = None
    hostname = _clip(socket.gethostname())
    names = (getattr(m, "__qualname__", None) or type(m).__name__ for m in makers)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(started))
    return {
        "id": f"{hostname}-{pid}-{stamp}",
        "started": started,
        "pid": pid,
        "hostname": hostname,
        "argv": _argv(list(sys.argv)),
        "cwd": cwd,
        "env_ids": _bounded(env_ids, MAX_ENV_IDS),
        "makers": _bounded(names, MAX_ENV_IDS),
    }


@dataclass
class Run:
    """One run of a log: its roots (in log order) and what its first root recorded."""

    key: tuple[Any, ...]
    started: float | None
    recorded: bool
    argv: list[str] = field(default_factory=list)
    cwd: str | None = None
    hostname: str | None = None
    pid: int | None = None
    env_ids: list[str] = field(default_factory=list)
    makers: list[str] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, root: BranchNode) -> Run:
        """The run of a root, from its run record (already typed by the reader)."""
        record = root.run or {}
        if "started" not in record or "pid" not in record:
            return cls(("unrecorded", root.branch_id), root.created, False)
        return cls(
            (record.get("hostname"), record["pid"], record["started"]),
            record["started"],
            True,
            argv=_argv(record.get("argv") or []),
            cwd=_clip(record["cwd"], 4 * MAX_TEXT) if record.get("cwd") else None,
            hostname=_clip(record.get("hostname") or "") or None,
            pid=record["pid"],
            env_ids=_bounded(record.get("env_ids") or [], MAX_ENV_IDS),
            makers=_bounded(record.get("makers") or [], MAX_ENV_IDS),
        )

    def process_gone(self) -> bool:
        """Whether its process is known to have ended: recorded on this host, and no
        process with its pid started when it did (a pid reused later is not it). A
        vector env it left open then will never be closed (a kill -9, a crash)."""
        if not self.recorded or self.pid is None or self.started is None:
            return False
        if self.hostname != _clip(socket.gethostname()):
            return False  # another machine's: unknown from here
        started = process_start_time(self.pid)
        return started is None or abs(started - self.started) > 1.0

    def command(self, width: int = 160) -> str:
        """The script and its arguments, printable and at most ``width`` characters."""
        return printable(_clip(shlex.join(self.argv), width)) if self.argv else "(no argv)"

    def envs(self) -> str:
        """Its env ids, else the names of its env factories, else "env unknown"."""
        if self.env_ids:
            return printable("env " + ", ".join(self.env_ids))
        if self.makers:
            return printable("made by " + ", ".join(self.makers))
        return "env unknown"

    def label(self, width: int = 160) -> str:
        """One line: its start time, script and envs (for a picture's band)."""
        if not self.recorded:
            return f"run not recorded · {self.roots[0] if self.roots else ''}"[:width]
        return f"{local_time(self.started)} · {self.command(width // 2)} · {self.envs()}"[:width]

    def heading(self) -> str:
        """One line for the text tree: time, script, envs, pid and host, working dir."""
        where = f"pid {self.pid}" + (f" on {printable(self.hostname)}" if self.hostname else "")
        if self.cwd:
            where += f" · in {printable(_clip(self.cwd, 120))}"
        return f"run {local_time(self.started)} · {self.command()} · {self.envs()} · {where}"


def group_runs(nodes: dict[str, BranchNode], roots: list[str]) -> list[Run]:
    """The runs of a log, in the order their first root appears (the latest last)."""
    runs: dict[tuple[Any, ...], Run] = {}
    for root in roots:
        run = Run.of(nodes[root])
        runs.setdefault(run.key, run).roots.append(root)
    return list(runs.values())


def select_runs(
    runs: list[Run],
    nodes: dict[str, BranchNode],
    *,
    root: str | None = None,
    last: int | None = None,
    since: float | None = None,
) -> list[Run]:
    """The runs to show: the tree holding branch ``root`` (under its run; KeyError if
    it is not in the log), else those started at or after ``since`` (a Unix time), of
    those the ``last`` N. Nothing given: every run."""
    if root is not None:
        tree = tree_of(nodes, root)
        run = next(r for r in runs if tree in r.roots)
        return [replace(run, roots=[tree])]
    if since is not None:
        runs = [r for r in runs if r.started is not None and r.started >= since]
    if last is not None:
        runs = runs[-last:] if last > 0 else []
    return runs


def pick(
    events: list[dict[str, Any]] | Events,
    *,
    root: str | None = None,
    last: int | None = None,
    since: float | None = None,
) -> tuple[dict[str, BranchNode], list[Run]]:
    """The nodes of a log's events and the runs chosen as :func:`select_runs` does."""
    nodes, roots = branch_nodes(events)
    runs = select_runs(group_runs(nodes, roots), nodes, root=root, last=last, since=since)
    for run in runs:
        if run.process_gone():
            _mark_never_closed(nodes, run.roots)
    return nodes, runs


# The status of a vector env whose process ended without closing it (a kill -9, a crash).
NEVER_CLOSED = "never closed: its process is gone"


def _mark_never_closed(nodes: dict[str, BranchNode], roots: list[str]) -> None:
    stack = list(roots)
    while stack:  # iterative: a deep chain of branches
        node = nodes[stack.pop()]
        if node.exit_status is None:
            node.exit_status = NEVER_CLOSED
        stack.extend(node.children)


_AGO = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """A Unix time from "10m", "2h", "30s", "1d" (that long ago) or an ISO date/time
    ("2026-12-01", "2026-12-01T10:00"; local time unless it names a zone). Raises
    ValueError naming what it cannot read."""
    text = text.strip()
    ago = _AGO.fullmatch(text)
    if ago:
        return (time.time() if now is None else now) - float(ago[1]) * _UNITS[ago[2]]
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):
        raise ValueError(
            f"cannot read {text!r} as a time: give a duration ago (30s, 10m, 2h, 1d) "
            "or an ISO date/time (2026-12-01 or 2026-12-01T10:00)"
        ) from None

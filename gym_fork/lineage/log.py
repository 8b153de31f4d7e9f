"""The append-only lineage log: one JSON object per line, one line per event."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

ENV_VAR = "GYM_FORK_LINEAGE_LOG"


def default_log_path() -> Path | None:
    """$GYM_FORK_LINEAGE_LOG ("" disables), else $XDG_STATE_HOME/gym_fork/lineage.jsonl."""
    configured = os.environ.get(ENV_VAR)
    if configured is not None:
        return Path(configured) if configured else None
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(state) / "gym_fork" / "lineage.jsonl"


class LineageLog:
    """Appends events to a JSONL file; each event is one ``write`` on an O_APPEND fd, so
    concurrent writers (several controllers) never interleave within a line."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        self._lock = threading.Lock()

    def append(self, event: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = (json.dumps(event, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All events of a lineage log; a torn last line (a killed writer) is skipped."""
    events = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events

"""What a process started now would inherit from us besides its environment (umask,
resource limits, CPU affinity, nice value), as plain data, and taking it on: a process
forked from an older one (a zygote's fork) gets what a fresh start would have had."""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any


def inherited_state() -> dict[str, Any]:
    """This process's umask, resource limits, affinity and nice value, as they are now."""
    umask = None
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            with contextlib.suppress(OSError, ValueError):
                limits[name] = list(resource.getrlimit(getattr(resource, name)))
    return {
        "umask": umask,
        "rlimits": limits,
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def take_on(state: dict[str, Any]) -> None:
    """Take on ``state`` (from :func:`inherited_state` of another process), each part
    best effort: a limit this process cannot set is left as it is."""
    if isinstance(state.get("umask"), int):
        os.umask(state["umask"])
    for name, (soft, hard) in (state.get("rlimits") or {}).items():
        if name.startswith("RLIMIT_") and hasattr(resource, name):
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
    with contextlib.suppress(OSError, ValueError, TypeError):
        os.sched_setaffinity(0, state["affinity"])
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        os.setpriority(os.PRIO_PROCESS, 0, state["nice"])

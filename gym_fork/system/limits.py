"""A process sandbox's resource limits (what each means: ``SandboxLimits`` in
gym_fork/system/isolation.py): the rlimits set at its birth and the memory and pids
cgroups it joins (made by gym_fork/system/cgroups.py).
"""

from __future__ import annotations

import resource
from typing import Any

from gym_fork.system import cgroups
from gym_fork.system.isolation import Isolation, IsolationConfig, SandboxLimits


def join_cgroups(config: IsolationConfig, achieved: Isolation, owner: int) -> None:
    """Join the memory and pids cgroups of tree ``owner`` that the limits ask for (under
    ``limits["cgroups"]``); those it could not join are said under ``missing``."""
    limits = config.limits
    if limits.memory_bytes is not None or limits.processes is not None:
        joined = cgroups.join(owner, limits.memory_bytes, limits.processes)
        for name, why in joined.pop("errors").items():
            achieved.missing[f"cgroup_{name}"] = why
        if "processes" in joined:
            achieved.missing.pop("limit_processes", None)  # pids.max, per sandbox
        achieved.limits["cgroups"] = joined


_RLIMITS = {
    "memory_bytes": resource.RLIMIT_DATA,
    "cpu_seconds": resource.RLIMIT_CPU,
    "open_files": resource.RLIMIT_NOFILE,
}


def apply_limits(limits: SandboxLimits, missing: dict[str, str]) -> dict[str, Any]:
    """Set the rlimits that are asked for; returns what is in force."""
    applied: dict[str, Any] = {}
    for name, which in _RLIMITS.items():
        value = getattr(limits, name)
        if value is None:
            continue
        try:
            resource.setrlimit(which, (value, value))
            applied[name] = value
        except (ValueError, OSError) as exc:
            missing[f"limit_{name}"] = str(exc)
    if limits.processes is not None:
        # RLIMIT_NPROC counts every process of the uid (a tree's sandboxes share one):
        # the pids cgroup is the per-sandbox limit, and clears this where it applies.
        missing["limit_processes"] = "needs the pids cgroup (RLIMIT_NPROC counts a whole uid)"
    return applied

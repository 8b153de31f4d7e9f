"""Per-sandbox cgroups (v1 here, v2 elsewhere) for the memory and process limits.

Each sandbox of a warm parent joins ``gym_fork-<warm parent pid>/<sandbox pid>`` under
the memory and pids controllers. Memory: the sandbox's new pages are charged there (pages
it shares copy-on-write stay charged where they were first touched), and past
``memory_bytes`` the kernel's OOM killer ends it (reported as SIGKILL). Processes:
``pids.max``, which, unlike RLIMIT_NPROC, also binds root. The warm parent removes a
sandbox's groups when it reaps it, its own at exit, and stale ones (whose warm parent is
gone) when it starts.
"""

from __future__ import annotations

import contextlib
import glob
import os

V1 = "/sys/fs/cgroup"
PREFIX = "gym_fork-"


def _v2() -> bool:
    return os.path.exists(f"{V1}/cgroup.controllers")


def controller_root(controller: str) -> str | None:
    """Where ``controller``'s hierarchy is mounted and writable, or None."""
    if _v2():
        with open(f"{V1}/cgroup.controllers") as f:
            ok = controller in f.read().split()
        return V1 if ok and os.access(V1, os.W_OK) else None
    root = f"{V1}/{controller}"
    return root if os.path.isdir(root) and os.access(root, os.W_OK) else None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def join(warm_parent: int, memory_bytes: int | None, processes: int | None) -> dict:
    """Put the calling sandbox in its own cgroups with these limits; returns what took
    effect as {"memory_bytes": ..., "processes": ...} and raises nothing."""
    applied: dict = {}
    errors: dict = {}
    pid = os.getpid()
    wanted = [
        ("memory", memory_bytes, "memory.max" if _v2() else "memory.limit_in_bytes"),
        ("pids", processes, "pids.max"),
    ]
    for controller, value, knob in wanted:
        if value is None:
            continue
        root = controller_root(controller)
        if root is None:
            errors[controller] = f"no writable {controller} cgroup controller"
            continue
        try:
            group = os.path.join(root, f"{PREFIX}{warm_parent}", str(pid))
            os.makedirs(group, exist_ok=True)
            if _v2():
                with contextlib.suppress(OSError):
                    _write(
                        os.path.join(root, f"{PREFIX}{warm_parent}", "cgroup.subtree_control"),
                        f"+{controller}",
                    )
            _write(os.path.join(group, knob), str(value))
            _write(os.path.join(group, "cgroup.procs"), str(pid))
            applied["memory_bytes" if controller == "memory" else "processes"] = value
        except OSError as exc:
            errors[controller] = f"{controller} cgroup: {exc}"
    applied["errors"] = errors
    return applied


def _roots() -> list[str]:
    return [r for r in {controller_root("memory"), controller_root("pids")} if r]


def remove(warm_parent: int, pid: int) -> None:
    """Remove a dead sandbox's groups."""
    for root in _roots():
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(root, f"{PREFIX}{warm_parent}", str(pid)))


def remove_tree(warm_parent: int) -> None:
    """Remove this warm parent's groups (its sandboxes are dead)."""
    for root in _roots():
        tree = os.path.join(root, f"{PREFIX}{warm_parent}")
        for group in glob.glob(os.path.join(tree, "[0-9]*")):
            with contextlib.suppress(OSError):
                os.rmdir(group)
        with contextlib.suppress(OSError):
            os.rmdir(tree)


def tree_exists(warm_parent: int) -> bool:
    """Is any group of this warm parent's tree left?"""
    return any(os.path.isdir(os.path.join(r, f"{PREFIX}{warm_parent}")) for r in _roots())


def sweep_stale() -> None:
    """Remove the groups of warm parents that no longer exist (killed with SIGKILL)."""
    for root in _roots():
        for tree in glob.glob(os.path.join(root, f"{PREFIX}*")):
            try:
                owner = int(os.path.basename(tree)[len(PREFIX) :])
            except ValueError:
                continue
            if not os.path.exists(f"/proc/{owner}"):
                remove_tree(owner)


def leftover_groups() -> set[str]:
    """Every gym_fork group on this host (for leak checks)."""
    return {g for root in _roots() for g in glob.glob(os.path.join(root, f"{PREFIX}*"))}

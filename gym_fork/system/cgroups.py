"""Per-sandbox cgroups (v1 here, v2 elsewhere) for the memory and process limits.

Each sandbox of a warm parent joins ``gym_fork-<warm parent pid>/<sandbox pid>`` under
the memory and pids controllers. Memory: the sandbox's new pages are charged there (pages
it shares copy-on-write stay charged where they were first touched), and past
``memory_bytes`` the kernel's OOM killer ends it (reported as SIGKILL). Processes:
``pids.max``, which, unlike RLIMIT_NPROC, also binds root. The warm parent removes a
sandbox's groups when it reaps it, its own at exit, and stale ones (whose warm parent is
gone) when it starts.

A clone (a branch's sandbox, forked by a sandbox whose view of cgroupfs is read-only and
which has no capabilities) cannot make a group: the controller makes
``gym_fork-<warm parent pid>/clone-<n>`` for it before the fork (:func:`make_clone_groups`)
and hands it an fd of the group's ``cgroup.procs``, which the clone writes itself into
as its first step (:func:`join_at_fork`), before it copies its source's /tmp (whose tmpfs
pages are then its own charge) or builds anything. The controller removes the group once
it has seen the clone exit.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
from dataclasses import dataclass, field

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
        root = controller_root(controller) or _delegated_root(controller, warm_parent)
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


CLONE_PREFIX = "clone-"
_LIMITS = {"memory": "memory_bytes", "pids": "processes"}
_clone_serial = itertools.count()
# In a clone: what joining the groups the controller made for it gave, as join() reports
# it (set by join_at_fork, its first step).
_joined_at_fork: dict = {"errors": {}}


@dataclass
class CloneGroups:
    """The groups the controller made for the clones of one FORK, before they exist.

    Each clone gets an fd per entry of ``controllers`` (the controllers that fd's group
    is under: one group for both on v2, one per controller on v1), opened O_WRONLY on
    the group's ``cgroup.procs`` by the controller. The kernel checks a write to it
    against the opener's credentials (Linux 5.16+; before, the writer's, which a process
    moving itself passes on v1): a clone of any uid moves itself in with it. Whoever
    holds it can also move any other process it can name (in its pid namespace) into
    that group: the controller hands it out only where the tree has a pid namespace of
    its own, and the source and the clone hold it only for the FORK and the clone's
    first step. ``errors``: controller -> why its limit has no group of the clone's."""

    controllers: list[list[str]] = field(default_factory=list)
    fds: list[list[int]] = field(default_factory=list)  # per clone
    paths: list[list[str]] = field(default_factory=list)  # per clone
    errors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def none(cls, count: int, errors: dict[str, str] | None = None) -> CloneGroups:
        """No group for any of ``count`` clones (``errors``: why, per controller)."""
        return cls(
            fds=[[] for _ in range(count)], paths=[[] for _ in range(count)], errors=errors or {}
        )

    def close_fds(self) -> None:
        """Close the controller's fds (after they were sent: the source has its own)."""
        for fds in self.fds:
            for fd in fds:
                os.close(fd)
        self.fds = [[] for _ in self.fds]


def fds_per_clone(memory_bytes: int | None, processes: int | None) -> int:
    """How many fds :func:`make_clone_groups` gives each clone (at most)."""
    asked = (memory_bytes is not None) + (processes is not None)
    return min(asked, 1) if _v2() else asked


def make_clone_groups(
    tree: int, count: int, memory_bytes: int | None, processes: int | None
) -> CloneGroups:
    """In the controller, before a FORK of ``count`` clones: a group of the tree per
    clone (and, on v1, per controller), limited as a sandbox's, and an fd of each
    group's ``cgroup.procs``. Raises nothing: a controller whose groups cannot be made
    is under ``errors``, and no clone gets an fd for it."""
    made = CloneGroups.none(count)
    names = [f"{CLONE_PREFIX}{next(_clone_serial)}" for _ in range(count)]
    v2 = _v2()
    wanted = [(c, v) for c, v in (("memory", memory_bytes), ("pids", processes)) if v is not None]
    for root, controllers in _clone_hierarchies(wanted, made.errors).items():
        knobs = [(_knob(c, v2), dict(wanted)[c]) for c in controllers]
        paths, fds = [], []
        try:
            tree_dir = os.path.join(root, f"{PREFIX}{tree}")
            os.makedirs(tree_dir, exist_ok=True)
            if v2:
                with contextlib.suppress(OSError):  # enabled already, or refused below
                    _write(
                        os.path.join(tree_dir, "cgroup.subtree_control"),
                        " ".join(f"+{c}" for c in controllers),
                    )
            for name in names:
                group = os.path.join(tree_dir, name)
                os.mkdir(group)
                paths.append(group)
                for knob, value in knobs:
                    _write(os.path.join(group, knob), str(value))
                fds.append(os.open(os.path.join(group, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        except OSError as exc:
            for fd in fds:
                os.close(fd)
            remove_groups(paths)
            for c in controllers:
                made.errors[c] = f"the controller could not make its {c} cgroup: {exc}"
            continue
        made.controllers.append(controllers)
        for k in range(count):
            made.paths[k].append(paths[k])
            made.fds[k].append(fds[k])
    return made


def _knob(controller: str, v2: bool) -> str:
    if controller == "memory":
        return "memory.max" if v2 else "memory.limit_in_bytes"
    return "pids.max"


def _clone_hierarchies(
    wanted: list[tuple[str, int]], errors: dict[str, str]
) -> dict[str, list[str]]:
    """Root -> the controllers the clones' groups there enforce (one root for all on v2,
    one per controller on v1); a controller with no writable hierarchy is under
    ``errors``."""
    found: dict[str, list[str]] = {}
    for controller, _value in wanted:
        root = controller_root(controller)
        if root is None:
            errors[controller] = f"no writable {controller} cgroup controller"
        else:
            found.setdefault(root, []).append(controller)
    return found


def join_at_fork(
    fds: list[int],
    controllers: list[list[str]],
    errors: dict[str, str],
    limits: dict[str, int | None],
) -> None:
    """In a clone, its first step: move itself into the groups the controller made for
    it (an fd of each one's ``cgroup.procs``, under ``controllers``), closing the fds;
    ``errors``: the controller's, for the limits that have no group of the clone's.
    ``limits``: {"memory_bytes": ..., "processes": ...} asked. What took effect is
    :func:`joined_at_fork`'s."""
    global _joined_at_fork
    joined: dict = {"errors": dict(errors)}
    for fd, names in zip(fds, controllers, strict=True):
        try:
            os.write(fd, b"0")  # "0": the writer itself
            for name in names:
                joined[_LIMITS[name]] = limits.get(_LIMITS[name])
        except OSError as exc:
            for name in names:
                joined["errors"][name] = f"it could not join its own {name} cgroup: {exc}"
        finally:
            os.close(fd)
    _joined_at_fork = joined


def joined_at_fork() -> dict:
    """In a clone: the limits its own groups enforce, as :func:`join` reports them."""
    return {**_joined_at_fork, "errors": dict(_joined_at_fork["errors"])}


def remove_groups(paths: list[str]) -> None:
    """Remove these groups (empty ones: a group a process is left in stays until the
    tree's groups are removed)."""
    for path in paths:
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _roots() -> list[str]:
    return [r for r in {controller_root("memory"), controller_root("pids")} if r]


def remove(warm_parent: int, pid: int) -> None:
    """Remove a dead sandbox's groups."""
    for root in _roots():
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(root, f"{PREFIX}{warm_parent}", str(pid)))


def remove_tree(warm_parent: int) -> None:
    """Remove this warm parent's groups (its sandboxes are dead), every group below
    them included: the tree's groups are delegated to its uid, so env code that ran in
    the warm parent or a sandbox may have made groups of its own in them."""
    for root in _roots():
        tree = os.path.join(root, f"{PREFIX}{warm_parent}")
        for folder in reversed(_groups_below(tree)):  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(folder)


# The most groups below one tree's that teardown looks for (env code can make them).
MAX_GROUPS_BELOW = 100_000


def _groups_below(tree: str) -> list[str]:
    """``tree`` and the groups below it, each after its parent, walked without recursion
    (a chain nested thousands deep is a few syscalls per level, not a RecursionError);
    a group's files are the kernel's, its directories are groups."""
    found: list[str] = []
    stack = [tree]
    while stack and len(found) < MAX_GROUPS_BELOW:
        folder = stack.pop()
        found.append(folder)
        try:
            with os.scandir(folder) as entries:
                stack += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
    return found


def tree_dirs(warm_parent: int, create: bool) -> list[str]:
    """This tree's group directories, one per hierarchy (made first if ``create``; those
    that cannot be are left out)."""
    dirs = []
    for root in _roots():
        tree = os.path.join(root, f"{PREFIX}{warm_parent}")
        if create:
            with contextlib.suppress(OSError):
                os.makedirs(tree, exist_ok=True)
        if os.path.isdir(tree):
            dirs.append(tree)
    return dirs


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


def _delegated_root(controller: str, warm_parent: int) -> str | None:
    """``controller``'s hierarchy where only this tree's group is ours (:func:`delegate`:
    a warm parent in a user namespace), or None."""
    root = V1 if _v2() else f"{V1}/{controller}"
    tree = os.path.join(root, f"{PREFIX}{warm_parent}")
    return root if os.path.isdir(tree) and os.access(tree, os.W_OK) else None


def delegate(warm_parent: int, uid: int) -> None:
    """Create this tree's groups and hand them to ``uid`` (a warm parent that runs in a
    user namespace as that uid makes and limits its sandboxes' groups in them): the
    directories and the files a move into or below them writes. Raises nothing: a group
    it cannot make is reported by :func:`join` in the sandbox."""
    for root in _roots():
        tree = os.path.join(root, f"{PREFIX}{warm_parent}")
        with contextlib.suppress(OSError):
            os.makedirs(tree, exist_ok=True)
            os.chown(tree, uid, uid)
            for name in ("cgroup.procs", "tasks", "cgroup.subtree_control"):
                with contextlib.suppress(FileNotFoundError):
                    os.chown(os.path.join(tree, name), uid, uid)

"""How a process sandbox is born: from "left its parent" to "runs env code", in order.

Every sandbox of the process host goes through :func:`be_born` with its role, passed in
by the code that forked it (never inferred from what the process inherited):

- ``SPAWNED``: forked by the warm parent for a sandbox the controller asked for.
- ``IDLE``: forked by the warm parent ahead of any request (its idle pool); it is born
  before it waits for its assignment, so an assignment costs no set-up.
- ``PREIMPORT``: the warm parent's throw-away sandbox that builds ``env_fns[0]`` once
  to learn what it imports (gym_fork/hosts/process/preimport.py).
- ``CLONE``: a ``fork()`` of a running sandbox (a branch, a reset by clone). It inherits
  its source's confinement (no capability on the host, seccomp, Landlock), so it gets
  its namespaces from a user namespace of its own.

The warm parent, where ``from_parent``'s prototype env is built and where the env_fns
are unpickled, is born by :data:`WARM_PARENT_STEPS` (run by
gym_fork/hosts/process/parent.py, whose fork of the tree's pid 1, tree_init.py, sits in
the middle).

Each step is recorded, in order, under ``sandbox["birth"]`` of the sandbox's report (and
``tree["birth"]`` for the warm parent), so a test can check the order that ran against
the one written here, and the result against /proc (tests/system/test_birth.py). A step
that cannot be done says why under ``missing``; none is skipped silently.

The order of the sandbox steps, and why each is where it is:

1. ``namespaces``: its own mount, IPC (and without Landlock, network) namespaces first:
   every mount the later steps make is its alone, and vanishes with it.
2. ``oom_score_adj``: raised while its /proc is writable and it is privileged, so the
   kernel's OOM killer picks a sandbox before the controller.
3. ``limits``: rlimits before anything of the env can allocate.
4. ``cgroups``: joined while cgroupfs is still writable in its view (read-only after 5).
5. ``read_only_view``: every mount read-only, after taking detached writable copies of
   the directories it may write (so the copies cannot be redirected by a later path walk).
6. ``private_tmp``: its own /tmp layer and /dev/shm, over the read-only view.
7. ``writable_paths``: the writable copies put in place last, over its own /tmp too.
   (A clone does 1-7 as one step, ``clone_namespaces``: user namespace, mount, IPC,
   network, its /tmp and /dev/shm as copies of its source's.)
8. ``tmpdir``: TMPDIR: /tmp, or a private scratch directory where no private mount is.
9. ``no_new_privs``: before the filters that need it, and before the uid changes.
10. ``clone_limits``: a clone's limits and the cgroups it joined at its fork, reported.
11. ``identity``: the tree's unprivileged uid, the last privileged step (capabilities
    stay in force until 12).
12. ``confine``: capabilities dropped, not dumpable, its own Landlock domain, seccomp:
    nothing privileged can happen after it, and env code runs next.
"""

from __future__ import annotations

import enum
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from gym_fork.system import cgroups, host_view, isolation, linux, sandbox_isolation
from gym_fork.system import namespaces as ns
from gym_fork.system.isolation import Isolation, IsolationConfig
from gym_fork.system.limits import apply_limits, join_cgroups


class Role(enum.Enum):
    """Which kind of sandbox is being born (see the module docstring)."""

    SPAWNED = "spawned"
    IDLE = "idle"
    PREIMPORT = "preimport"
    CLONE = "clone"


FRESH = frozenset({Role.SPAWNED, Role.IDLE, Role.PREIMPORT})  # forked by the warm parent
ALL = frozenset(Role)


@dataclass
class Birth:
    """What the steps of one birth share."""

    role: Role
    config: IsolationConfig
    tree: Isolation
    achieved: Isolation
    owner: int  # the tree's id on the host: its cgroups and scratch dirs carry it
    copy_from: str | None  # a clone's: what its TMPDIR starts from
    namespaced: bool  # the tree has a mount namespace of its own
    scratch: str | None = None
    kept: host_view.Kept = field(default_factory=list)

    @property
    def own_mounts(self) -> bool:
        return bool(self.achieved.sandbox.get("mount"))


def _namespaces(b: Birth) -> None:
    if not b.namespaced:
        b.achieved.missing["read_only_host"] = "no mount namespace: the host's files as they are"
        return
    flags = ns.CLONE_NEWNS | ns.CLONE_NEWIPC | sandbox_isolation.own_network(b.config)
    try:
        ns.unshare(flags)
    except OSError as exc:
        b.achieved.missing["sandbox_mount"] = f"per-sandbox mount/ipc namespace: {exc}"
        try:  # still give the sandbox its own IPC namespace
            ns.unshare(ns.CLONE_NEWIPC)
            b.achieved.sandbox["ipc"] = True
        except OSError:
            b.achieved.missing["ipc"] = f"its own IPC namespace: {exc}"
        return
    b.achieved.sandbox.update(
        mount=True, ipc=True, net=bool(sandbox_isolation.own_network(b.config))
    )
    if b.tree.tree.get("userns"):
        # As for a clone's maps: its own /proc files, for the tree's uid to write (not
        # dumpable again in confine, before any env code).
        linux.prctl(linux.PR_SET_DUMPABLE, 1)


def _oom_score_adj(b: Birth) -> None:
    try:
        sandbox_isolation.write_text(
            "/proc/self/oom_score_adj", str(isolation.SANDBOX_OOM_SCORE_ADJ)
        )
        b.achieved.sandbox["oom_score_adj"] = isolation.SANDBOX_OOM_SCORE_ADJ
    except OSError as exc:
        b.achieved.missing["oom_score_adj"] = f"its OOM score could not be raised: {exc}"


def _limits(b: Birth) -> None:
    b.achieved.limits = apply_limits(b.config.limits, b.achieved.missing)


def _cgroups(b: Birth) -> None:
    join_cgroups(b.config, b.achieved, b.owner)


def _read_only_view(b: Birth) -> None:
    if not b.own_mounts:
        return  # 1 said why
    try:
        sources = host_view.writable_sources(
            not b.config.private_tmp,
            b.config.writable_paths,
            b.tree.tree.get("writable_views", 0),
        )
        b.kept = host_view.read_only_view(sources)
        # Claimed here; the controller measures it (gym_fork/system/measure.py).
        b.achieved.sandbox["read_only_host"] = True
        b.achieved.sandbox["writable"] = list(b.config.shared_writable())
    except OSError as exc:
        b.achieved.missing["read_only_host"] = f"read-only view of the host: {exc}"


def _private_tmp(b: Birth) -> None:
    if not b.own_mounts or not b.tree.tree.get("private_tmp"):
        return  # 1 or the tree said why
    try:
        sandbox_isolation.own_private_tmp(b.config, bool(b.tree.tree.get("userns")))
        b.achieved.sandbox["private_tmp"] = b.achieved.sandbox["private_shm"] = True
        b.achieved.sandbox["tmp_layer_fd"] = sandbox_isolation.private_layer_fd()
    except OSError as exc:
        b.achieved.missing["private_tmp"] = f"the sandbox's own /tmp and /dev/shm: {exc}"


def _writable_paths(b: Birth) -> None:
    if not b.own_mounts:
        return
    try:
        host_view.attach_writable(b.kept)
    except OSError as exc:
        b.achieved.missing["writable_paths"] = f"a writable directory could not be bound: {exc}"


def _clone_namespaces(b: Birth) -> None:
    b.copy_from = sandbox_isolation.clone_source(b.copy_from, b.tree)
    if b.namespaced:
        # Looked up at each birth: what the module holds now is what runs.
        sandbox_isolation.enter_clone_namespaces(b.config, b.tree, b.achieved)


def _tmpdir(b: Birth) -> None:
    if not b.config.private_tmp:
        return  # the caller wants the host's /tmp: nothing private, nothing to copy
    if b.achieved.sandbox.get("private_tmp"):
        os.environ["TMPDIR"] = tempfile.tempdir = "/tmp"
        return
    b.scratch = sandbox_isolation.new_scratch_dir(f"gym_fork-scratch-{b.owner}-{os.getpid()}-")
    sandbox_isolation.copy_tree(b.copy_from, b.scratch)
    os.environ["TMPDIR"] = tempfile.tempdir = b.scratch
    b.achieved.missing.setdefault(
        "private_tmp", "no private mounts: TMPDIR points to a private directory instead"
    )


def _no_new_privs(b: Birth) -> None:
    try:
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        b.achieved.sandbox["no_new_privs"] = True
    except OSError as exc:
        b.achieved.missing["no_new_privs"] = str(exc)


def _clone_limits(b: Birth) -> None:
    # Its rlimits are its source's (set again: the report says so); its cgroups are
    # those the controller made for it, joined before anything else (sandbox.py).
    achieved, limits = b.achieved, b.config.limits
    achieved.limits = apply_limits(limits, achieved.missing)
    if limits.memory_bytes is not None or limits.processes is not None:
        joined = cgroups.joined_at_fork()
        errors = joined.pop("errors")
        if errors:
            achieved.missing["cgroups"] = (
                f"a clone stays in its source's {' and '.join(sorted(errors))} "
                f"cgroup(s) ({'; '.join(errors[k] for k in sorted(errors))}): the cgroup "
                "limits bind source and clones together"
            )
        if "processes" in joined:
            achieved.missing.pop("limit_processes", None)  # pids.max binds root too
        # Its own: past memory_bytes the OOM killer ends this branch, not its source.
        achieved.limits["cgroups"] = {**joined, "own_group": bool(joined)}
    if "shared_with_source" not in achieved.missing:  # no namespaces of its own
        sandbox_isolation.report_shared_with_source(
            achieved, sandbox_isolation.clone_inherits_shared()
        )


def _identity(b: Birth) -> None:
    sandbox_isolation.become_sandbox_user(b.tree, b.achieved, b.scratch)


def _confine(b: Birth) -> None:
    sandbox_isolation.confine_sandbox(b.config, b.achieved, clone=b.role is Role.CLONE)


# (name, the roles that take it, the step), in the order they run: see the docstring.
STEPS: tuple[tuple[str, frozenset[Role], Callable[[Birth], None]], ...] = (
    ("namespaces", FRESH, _namespaces),
    ("oom_score_adj", FRESH, _oom_score_adj),
    ("limits", FRESH, _limits),
    ("cgroups", FRESH, _cgroups),
    ("read_only_view", FRESH, _read_only_view),
    ("private_tmp", FRESH, _private_tmp),
    ("writable_paths", FRESH, _writable_paths),
    ("clone_namespaces", frozenset({Role.CLONE}), _clone_namespaces),
    ("tmpdir", ALL, _tmpdir),
    ("no_new_privs", ALL, _no_new_privs),
    ("clone_limits", frozenset({Role.CLONE}), _clone_limits),
    ("identity", FRESH, _identity),
    ("confine", ALL, _confine),
)


# In a sandbox: its role and the steps its birth took (env code may read it; what it
# reports is the sandbox's own word, as its HELLO is).
born: dict[str, object] | None = None


def steps_of(role: Role) -> list[str]:
    """The names of the steps a sandbox of ``role`` takes, in order."""
    return [name for name, roles, _ in STEPS if role in roles]


def be_born(
    role: Role,
    config: IsolationConfig,
    tree: Isolation,
    warm_parent: int,
    copy_from: str | None = None,
) -> tuple[str | None, Isolation]:
    """Take the calling, just forked process from its parent to a sandbox of ``role``
    that may run env code; returns its scratch dir (None with a private /tmp: nothing
    on the host to clean) and its report.

    ``copy_from`` (a clone): its source's scratch dir, copied into its own where it has
    no private /tmp; None: its source's private writes."""
    achieved = Isolation(tree=dict(tree.tree), missing=dict(tree.missing), tree_id=tree.tree_id)
    birth = Birth(
        role,
        config,
        tree,
        achieved,
        owner=tree.tree_id or warm_parent,
        copy_from=copy_from,
        namespaced=config.namespaces and bool(tree.tree.get("mount")),
    )
    global born
    done: list[str] = []
    achieved.sandbox["role"] = role.value
    achieved.sandbox["birth"] = done
    born = {"role": role.value, "steps": done}
    for name, roles, step in STEPS:
        if role in roles:
            step(birth)
            done.append(name)
    return birth.scratch, achieved


# The warm parent's birth, in the order parent.py runs it (recorded in tree["birth"]),
# and why: nothing of the user's (env_fns unpickled, from_parent's env_fn and warmup)
# runs before the last of these.
WARM_PARENT_STEPS = (
    # Its output to the controller's pipes: a terminal would obey its escape sequences.
    "redirect_output",
    # No controlling terminal: TIOCSTI on the controller's would type into its shell.
    "drop_terminal",
    # The tree's mount, UTS, network namespaces, private mounts, its uid chosen, its
    # pid namespace, /dev, the writable views and /tmp: as the host's root (isolate_tree).
    "isolate_tree",
    # pid 1 of the tree: its own /proc (the waiter, outside, keeps cleaning up).
    "tree_init",
    # Every mount read-only but /tmp, /dev/shm, writable_paths and its cgroups, made by
    # the host's root so that the flags are locked in the user namespace of the next step.
    "read_only_view",
    # Root of the tree's own user namespace, the tree's uid on the host: no capability
    # there, per-uid quotas charged to that uid.
    "user_namespace",
    # Nothing it executes gains privileges (a setuid binary, file capabilities).
    "no_new_privs",
)

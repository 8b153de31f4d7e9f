"""Sandbox isolation for process sandboxes: namespaces, private /tmp, limits.

Two levels, chosen so that the fork path stays fast:

- The **tree** (the warm parent and every sandbox it or its sandboxes fork) gets, once:
  a mount namespace whose mounts do not propagate to the host, a private /tmp (an
  overlay: the host's /tmp stays readable, as the drop-in needs, and writes land in a
  tmpfs layer of the tree's own) and an empty /dev/shm, a UTS namespace, and unless
  ``network=True`` an empty network namespace (no interface up, not even loopback).
- Each **sandbox** gets, at birth: its own mount namespace with its own overlay on /tmp
  (over the warm parent's, so what the warm parent prepared there is part of the state
  it starts from) and its own /dev/shm, its own IPC namespace (SysV IPC, POSIX message
  queues), no_new_privs, and the limits. Its layers live exactly as long as its mount
  namespace: nothing to clean up, even after a SIGKILL.

- The tree also gets a **pid namespace** whose init (pid 1) is the warm parent: the
  sandboxes see only their tree in a /proc of their own, orphans (clones, daemons of an
  env) are adopted by the warm parent, and when it dies the kernel kills every process
  of the tree.
- The tree has its own minimal **/dev** (a tmpfs with null, zero, full, random, urandom,
  a new devpts and GPU devices if any): no disk, no kernel memory, no host terminal
  (gym_fork/system/host_view.py, as the read-only view below).
- Each sandbox sees the host **read-only** (every mount of its namespace made read-only,
  recursively, before the first line of env code; /proc stays writable for the process's
  own files but /proc/sys, /proc/sysrq-trigger, /proc/irq, /proc/bus and /proc/fs are
  read-only, /sys with everything): it writes only its /tmp, its /dev/shm and the
  ``writable_paths`` it is given. Its oom_score_adj makes the kernel's OOM killer pick it
  before the controller. Without Landlock's scoping it also gets a network namespace of
  its own (abstract UNIX sockets; see
  :func:`gym_fork.system.sandbox_isolation.own_network`).
- Each sandbox is then **confined** (gym_fork/system/confine.py): no capabilities (but
  CAP_SETFCAP, see there), not dumpable, a Landlock domain of its own, and a seccomp
  filter. A **clone** (``fork()`` of
  a running sandbox) inherits that confinement and so cannot make namespaces in the
  host's user namespace; it makes a user namespace of its own (uid 0 mapped to itself)
  and in it its own mount, IPC and network namespaces: its /tmp is a new overlay on the
  tree's /tmp whose upper layer starts as a copy of its source's writes at the fork, its
  /dev/shm a copy of its source's. Nothing it writes afterwards reaches its source or
  siblings, and nothing they write reaches it. User namespaces nest 32 deep: a clone
  deeper than that (or where the kernel refuses user namespaces) falls back to a private
  TMPDIR and says so under ``missing``.

What is not isolated is reported, never assumed: see :func:`Isolation.report`.

Here: what the caller asks for (:class:`IsolationConfig`, :class:`SandboxLimits`), what
was achieved (:class:`Isolation`), and the tree's one-time set-up (:func:`isolate_tree`,
:func:`become_tree_init`, :func:`read_only_tree`). The pieces each sandbox's and each
clone's birth is made of (its namespaces, its /tmp and /dev/shm, its uid, its
confinement) are in gym_fork/system/sandbox_isolation.py, its rlimits and cgroups in
gym_fork/system/limits.py; gym_fork/system/birth.py runs them in order.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

from gym_fork.system import cgroups, host_view, identity
from gym_fork.system import namespaces as ns
from gym_fork.system.sandbox_isolation import write_text


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox resource limits (None: not limited).

    ``memory_bytes`` caps the sandbox's data segment and anonymous memory (RLIMIT_DATA):
    an allocation beyond it fails inside the env (numpy raises MemoryError), reported as
    that sub-env's error; where a memory cgroup is writable it also caps the memory the
    sandbox adds (the OOM killer then ends it). ``cpu_seconds`` (RLIMIT_CPU) kills a
    sandbox with SIGXCPU. ``open_files`` is RLIMIT_NOFILE. ``processes`` is the pids
    cgroup's pids.max, per sandbox (RLIMIT_NPROC would count every process of the uid
    a tree's sandboxes share).
    """

    memory_bytes: int | None = None
    cpu_seconds: int | None = None
    open_files: int | None = None
    processes: int | None = None


# Each private tmpfs layer (the tree's /tmp, a sandbox's /tmp and /dev/shm) is at most
# this big unless the caller says otherwise (tmpfs pages belong to no process: without a
# size, a sandbox filling /tmp could take half the RAM).
DEFAULT_TMPFS_BYTES = 1 << 30
# Raised above the controller's so that the kernel's OOM killer picks a sandbox first.
SANDBOX_OOM_SCORE_ADJ = 1000
TREE_OOM_SCORE_ADJ = 500


@dataclass(frozen=True)
class IsolationConfig:
    """What the caller asks for; :class:`Isolation` records what was achieved.

    ``writable_paths``: host directories a sandbox may write (bound writable into its
    read-only view of the host, nosuid). ``tmpfs_bytes``: the size of each private
    tmpfs layer (None: :data:`DEFAULT_TMPFS_BYTES`, or ``limits.memory_bytes`` when
    smaller). ``sandbox_user``: "auto" (an unprivileged uid of the tree's own, unless
    env code could not read or write what it needs as one: gym_fork/system/identity.py),
    "unprivileged" (that uid whatever happens) or "root"."""

    namespaces: bool = True
    network: bool = False
    private_tmp: bool = True
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    confine: bool = True  # drop capabilities and install the seccomp filter
    writable_paths: tuple[str, ...] = ()
    tmpfs_bytes: int | None = None
    sandbox_user: str = "auto"
    # Variables of the controller's environment the tree gets besides the allowlist
    # (gym_fork/system/environment.py); True: all of them.
    pass_env: tuple[str, ...] | bool = ()

    def layer_bytes(self) -> int:
        """The size of each private tmpfs layer."""
        if self.tmpfs_bytes is not None:
            return self.tmpfs_bytes
        memory = self.limits.memory_bytes
        return min(DEFAULT_TMPFS_BYTES, memory) if memory else DEFAULT_TMPFS_BYTES

    def shared_writable(self) -> tuple[str, ...]:
        """The host directories a sandbox writes: ``writable_paths``, and with
        ``private_tmp=False`` the host's /tmp and /dev/shm."""
        shared = () if self.private_tmp else ("/tmp", "/dev/shm")
        return shared + tuple(self.writable_paths)


@dataclass
class Isolation:
    """Layers achieved in one sandbox (or tree); ``missing`` says why a layer is not.

    ``tree_id`` names the tree on the host (the pid, in the host's namespace, of the
    process that started it): its cgroups and scratch directories carry it."""

    tree: dict[str, Any] = field(default_factory=dict)
    sandbox: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    tree_id: int = 0

    def report(self) -> dict[str, Any]:
        """The achieved layers as plain data (for the HELLO and the isolation report).

        Copied by hand, not with dataclasses.asdict: a sandbox builds this right after
        fork, and every object a deep copy touches is a page copied (the values are
        plain data, dicts at most one level deep)."""
        return {
            "tree": _plain(self.tree),
            "sandbox": _plain(self.sandbox),
            "limits": _plain(self.limits),
            "missing": dict(self.missing),
        }


def _plain(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _plain(v) if type(v) is dict else v for k, v in d.items()}


# -- tree level (warm parent) --------------------------------------------------------
def isolate_tree(config: IsolationConfig, tree_id: int) -> Isolation:
    """Run once by the process that starts the tree, before anything is built or forked.

    When ``tree["pid"]`` is True, the caller's next child is pid 1 of the tree's new
    pid namespace and must call :func:`become_tree_init`."""
    achieved = Isolation(tree_id=tree_id)
    if not config.namespaces:
        achieved.missing["namespaces"] = "disabled by the caller (isolation.namespaces=False)"
        _choose_identity(config, achieved, namespaced=False)
        return achieved
    flags = ns.CLONE_NEWNS | ns.CLONE_NEWUTS | (0 if config.network else ns.CLONE_NEWNET)
    try:
        ns.unshare(flags)
    except OSError as exc:
        why = f"unshare failed ({exc.strerror}): needs root or user namespaces"
        for layer in ("mount", "uts", "net", "pid", "private_tmp"):
            achieved.missing[layer] = why
        _choose_identity(config, achieved, namespaced=False)
        return achieved
    achieved.tree.update(mount=True, uts=True, net=not config.network)
    if config.network:
        achieved.missing["net"] = "network=True: the host's network is shared"
    with contextlib.suppress(OSError):
        ns.sethostname("gym-fork")
    try:
        # Nothing mounted in the tree (its /proc, its /tmp) may propagate to the host.
        ns.make_mounts_private()
    except OSError as exc:
        for layer in ("pid", "private_tmp"):
            achieved.missing[layer] = f"mounts of the tree cannot be made private: {exc}"
        _choose_identity(config, achieved, namespaced=False)
        return achieved
    _choose_identity(config, achieved, namespaced=True)
    try:
        ns.unshare(ns.CLONE_NEWPID)
        achieved.tree["pid"] = True
    except OSError as exc:
        achieved.missing["pid"] = f"pid namespace: {exc}"
    with contextlib.suppress(OSError):  # raising it needs no privilege
        write_text("/proc/self/oom_score_adj", str(TREE_OOM_SCORE_ADJ))
    try:
        host_view.minimal_dev(keep_host_shm=not config.private_tmp)
        achieved.tree["minimal_dev"] = True
    except OSError as exc:
        achieved.missing["minimal_dev"] = f"the tree's own /dev: {exc}"
    if achieved.tree.get("minimal_dev"):
        try:
            achieved.tree["writable_views"] = host_view.bind_writable_views(config.writable_paths)
        except OSError as exc:
            achieved.missing["writable_paths"] = str(exc)
    if not config.private_tmp:
        achieved.missing["private_tmp"] = (
            "private_tmp=False (the caller's choice): /tmp and /dev/shm are the host's"
        )
        return achieved
    try:
        # /tmp: the host's files stay readable (the drop-in), writes land in the tree's
        # own layer. /dev/shm: an empty tmpfs (POSIX shared memory is not shared out).
        size = config.layer_bytes()
        os.close(ns.overlay_private_layer("/tmp", size))
        ns.mount("tmpfs", "/dev/shm", "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, f"mode=1777,size={size}")
        achieved.tree["private_tmp"] = True
    except OSError as exc:
        achieved.missing["private_tmp"] = f"overlay on /tmp failed ({exc.strerror})"
        return achieved
    if achieved.tree.get("minimal_dev"):
        with contextlib.suppress(OSError):
            host_view.bind_tree_tmp_view()
            achieved.tree["tmp_view"] = True
    return achieved


def read_only_tree(config: IsolationConfig, tree: Isolation) -> None:
    """In pid 1 of the tree, still the host's root, before any env code runs in it
    (``from_parent``'s env_fn and warmup, the env_fns' imports): a mount namespace of
    its own (the waiter keeps the one it cleans up from) in which every mount is
    read-only but the tree's /tmp and /dev/shm, the ``writable_paths`` (and the views
    its sandboxes copy them from) and the tree's own cgroups. Made before the tree's
    user namespace, the read-only flags are locked there: the warm parent, root in that
    namespace only, cannot clear them, and its sandboxes' namespaces inherit them."""
    if not tree.tree.get("mount"):
        return  # isolate_tree said why
    views = tree.tree.get("writable_views", 0)
    sources = host_view.writable_sources(True, config.writable_paths, views)
    if tree.tree.get("private_tmp"):
        # Not over the tree's /tmp: a mount below it would be locked in the sandboxes'
        # namespaces, where the kernel then refuses /tmp as an overlay's lower layer.
        # There the warm parent writes the tree's /tmp layer, as before.
        sources = [(t, s) for t, s in sources if (t, s) in host_view.HOST_TMP or not _under_tmp(t)]
    sources += [
        (f"{host_view.WRITABLE_VIEW}{i}", f"{host_view.WRITABLE_VIEW}{i}") for i in range(views)
    ]
    limited = config.limits.memory_bytes is not None or config.limits.processes is not None
    sources += [(d, d) for d in cgroups.tree_dirs(tree.tree_id, create=limited)]
    try:
        ns.unshare(ns.CLONE_NEWNS)
        host_view.attach_writable(host_view.read_only_view(sources))
        tree.tree["read_only_host"] = True
    except OSError as exc:
        tree.missing["warm_parent_read_only_host"] = (
            f"the warm parent sees the host writable where its uid may write (world-"
            f"writable directories such as /var/tmp) while it runs env code: {exc}"
        )


def _under_tmp(path: str) -> bool:
    return any(os.path.commonpath([path, top]) == top for top in ("/tmp", "/dev/shm"))


def _choose_identity(config: IsolationConfig, achieved: Isolation, namespaced: bool) -> None:
    """Which host uid the tree's env code runs as (``tree["uid"]``), decided once, before
    any env code, from what it must read and write (gym_fork/system/identity.py). With
    the tree's own mount namespace (``namespaced``), directories only root may enter on
    the way to what env code reads are opened in its view (not on the host)."""
    host_uid = os.geteuid()
    achieved.tree["uid"] = host_uid
    if host_uid != 0:
        achieved.missing["identity"] = (
            f"the controller is not root: env code runs as its uid {host_uid} and can read "
            "whatever that uid can"
        )
        return
    if config.sandbox_user == "root":
        achieved.missing["identity"] = (
            "sandbox_user='root' (the caller's choice): env code runs as the host's root "
            "and can read every file root owns"
        )
        return
    passages, why = identity.plan(identity.paths_env_code_reads(), config.writable_paths)
    if why is None and passages:
        if not namespaced:
            why = f"{passages[0]!r} is closed to other users and the tree has no mount namespace"
        else:
            try:
                identity.open_passages(passages, config.layer_bytes())
                achieved.tree["passages"] = passages
            except OSError as exc:
                why = str(exc)
    if why is not None and config.sandbox_user == "auto":
        achieved.missing["identity"] = (
            "env code runs as the host's root (it can read owner-only files such as "
            f"~/.ssh): {why}; make that readable by other users, or pass "
            "sandbox_user='unprivileged' to run as an unprivileged uid anyway"
        )
        return
    achieved.tree["uid"] = identity.sandbox_uid(achieved.tree_id)


def become_tree_init(achieved: Isolation) -> None:
    """Run in pid 1 of the tree's pid namespace: mount the tree's own /proc."""
    try:
        ns.mount_own_proc()
        achieved.tree["proc"] = True
    except OSError as exc:
        achieved.missing["proc"] = f"own /proc: {exc} (the host's processes stay visible)"

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
  its own (abstract UNIX sockets; see :func:`own_network`).
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
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
import tempfile
from dataclasses import dataclass, field
from typing import Any

from gym_fork.system import cgroups, confine, host_view, identity, linux, snapshot
from gym_fork.system import namespaces as ns
from gym_fork.system.scratch import base_dir


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


# In a sandbox with a private /tmp overlay: an fd of the tmpfs layer holding only its
# own writes (in its ``upper`` directory).
_PRIVATE_WRITES_FD: int | None = None
# In a sandbox forking clones: its fds on /tmp and /dev/shm files, those no clone can
# reopen, and its shared mappings (snapshot.py), listed once before the fork.
_CLONE_INHERITS: tuple[list, list[str], list[str]] = ([], [], [])
# In a sandbox forking clones: the directory their TMPDIRs start from, when it was
# empty just before the fork (each clone then skips listing it again).
_EMPTY_CLONE_SOURCE: str | None = None


def _remember_private_writes(fd: int) -> None:
    global _PRIVATE_WRITES_FD
    _PRIVATE_WRITES_FD = fd


def _private_writes() -> str | None:
    return None if _PRIVATE_WRITES_FD is None else f"/proc/self/fd/{_PRIVATE_WRITES_FD}/upper"


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


# -- sandbox level: the mechanisms (gym_fork/system/birth.py runs them in order) ----
def _gpu_devices() -> list[str]:
    """The GPU devices of this sandbox's /dev (those minimal_dev gives a tree)."""
    try:
        names = os.listdir("/dev")
    except OSError:
        return []
    gpu = [n for n in names if n.startswith(host_view.GPU_DEVICE_PREFIXES)]
    paths = [f"/dev/{n}" for n in gpu]
    for folder in host_view.GPU_DEVICE_DIRS:
        with contextlib.suppress(OSError):
            paths += [f"/dev/{folder}/{n}" for n in os.listdir(f"/dev/{folder}")]
    return paths


def become_sandbox_user(tree: Isolation, achieved: Isolation, scratch: str | None) -> None:
    """The last privileged step: become the tree's unprivileged uid (its set-up is done;
    its capabilities stay in force until :func:`confine_sandbox` drops them)."""
    uid = tree.tree.get("uid", 0)
    if tree.tree.get("userns"):
        achieved.sandbox["uid"] = uid  # root of the tree's user namespace: uid on the host
        return
    if not uid or os.geteuid() != 0:
        achieved.sandbox["uid"] = os.geteuid()
        return
    try:
        if scratch is not None:
            os.chown(scratch, uid, uid)
        groups = identity.device_groups(_gpu_devices())
        identity.become(uid, groups)
        achieved.sandbox["uid"] = uid
    except OSError as exc:
        achieved.sandbox["uid"] = os.geteuid()
        achieved.missing["identity"] = f"env code runs as the host's root: {exc}"


def join_cgroups(config: IsolationConfig, achieved: Isolation, owner: int) -> None:
    limits = config.limits
    if limits.memory_bytes is not None or limits.processes is not None:
        joined = cgroups.join(owner, limits.memory_bytes, limits.processes)
        for name, why in joined.pop("errors").items():
            achieved.missing[f"cgroup_{name}"] = why
        if "processes" in joined:
            achieved.missing.pop("limit_processes", None)  # pids.max, per sandbox
        achieved.limits["cgroups"] = joined


def own_private_tmp(config: IsolationConfig, in_user_namespace: bool) -> None:
    """A fresh sandbox's own /tmp (an overlay on the tree's, its writes kept open: clones
    of it start their /tmp from them) and /dev/shm."""
    size = config.layer_bytes()
    _remember_private_writes(
        ns.overlay_private_layer("/tmp", size, in_user_namespace=in_user_namespace)
    )
    host_view.own_dev_shm(size)


def own_network(config: IsolationConfig, clone: bool = False) -> int:
    """CLONE_NEWNET where a sandbox needs a network namespace of its own. The tree's is
    empty (no interface), so what it would share is abstract UNIX sockets: Landlock's
    scoping (ABI 6) keeps those between a sandbox and its own domain already, except
    that a domain reaches the domains nested in it, so a source would reach its clones'.
    Hence: every clone, and sandboxes only without Landlock (~0.45 ms each, and more to
    tear down)."""
    if config.network:
        return 0
    if not clone and confine.landlock_abi() >= confine.LANDLOCK_MIN_ABI:
        return 0
    return ns.CLONE_NEWNET


def enter_clone_namespaces(config: IsolationConfig, tree: Isolation, achieved: Isolation) -> None:
    """A clone (forked from a confined sandbox): a user namespace of its own, and in it
    mount, IPC and network namespaces; its /tmp and /dev/shm start as copies of its
    source's. On failure nothing is changed and the reason is under ``missing``."""
    global _PRIVATE_WRITES_FD
    flags = ns.CLONE_NEWUSER | ns.CLONE_NEWNS | ns.CLONE_NEWIPC
    flags |= own_network(config, clone=True)
    why = "a clone shares its source's mount and IPC namespaces"
    if config.shared_writable():
        why += ": user namespaces for clones are off where a host directory is writable"
        achieved.missing["sandbox_mount"] = achieved.missing["ipc"] = why
        return
    uid, gid = os.geteuid(), os.getegid()  # as the host sees them: read before unshare
    try:
        ns.unshare(flags)
    except OSError as exc:
        if exc.errno in (errno.EUSERS, errno.ENOSPC):
            reason = "user namespaces nest at most 32 deep, or user.max_user_namespaces is reached"
        else:
            reason = exc.strerror or str(exc)
        achieved.missing["sandbox_mount"] = achieved.missing["ipc"] = (
            f"{why}: no user namespace of its own ({reason})"
        )
        return
    confine.forget_inherited_drop()  # every capability again, in this namespace only
    # A process that is not dumpable has its /proc files owned by the host's root, which
    # a clone of an unprivileged uid (or of a clone) is not: it could not write its own
    # maps. Not dumpable again in confine_sandbox; ptrace is refused by seccomp meanwhile.
    linux.prctl(linux.PR_SET_DUMPABLE, 1)
    own_net = bool(own_network(config, clone=True))
    achieved.sandbox.update(user=True, mount=True, ipc=True, net=own_net)
    try:
        write_text("/proc/self/setgroups", "deny")
        write_text("/proc/self/uid_map", f"0 {uid} 1\n")
        write_text("/proc/self/gid_map", f"0 {gid} 1\n")
        if not tree.tree.get("private_tmp") or not tree.tree.get("tmp_view"):
            return
        source = _PRIVATE_WRITES_FD
        size = config.layer_bytes()

        def fill(upper: str) -> None:
            writes = _private_writes()
            if writes is not None and writes != _EMPTY_CLONE_SOURCE:
                copy_tree(writes, upper)

        own = ns.overlay_private_layer(
            "/tmp", size, lower=host_view.TREE_TMP_VIEW, fill=fill, in_user_namespace=True
        )
        if source is not None:
            os.close(source)  # the source's layer: not this clone's to write
        _PRIVATE_WRITES_FD = own
        host_view.own_dev_shm(size)
        host_view.reenter_working_directory()  # else it writes its source's /tmp
        achieved.sandbox["private_tmp"] = achieved.sandbox["private_shm"] = True
    except OSError as exc:
        achieved.missing["private_tmp"] = f"a clone's own /tmp and /dev/shm: {exc}"
        return
    # What it inherited open or mapped from its source (listed by the source before the
    # fork): files reopened on the copies, shared mappings (a fork cannot copy them)
    # reported.
    files, stuck, shared = _CLONE_INHERITS
    reopened, failed = snapshot.reopen_copied_files(files)
    if reopened:
        achieved.sandbox["reopened_files"] = reopened
    report_shared_with_source(achieved, shared + stuck + failed)


def clone_inherits_shared() -> list[str]:
    """The shared mappings a clone's source listed before the fork."""
    return _CLONE_INHERITS[2]


def report_shared_with_source(achieved: Isolation, shared: list[str]) -> None:
    names = sorted(set(shared))
    if names:
        achieved.missing["shared_with_source"] = (
            f"{len(names)} open file(s) or MAP_SHARED mapping(s) inherited from its source "
            f"stay shared with it (writes through them reach the source, and the "
            f"source's reach the branch): {', '.join(names[:5])}"
        )


def write_text(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def private_tmp_leftovers(limit: int = 10_000) -> dict[str, int] | None:
    """Files (and their bytes) this sandbox wrote into its private /tmp, counting at most
    ``limit`` entries; None without a private /tmp of its own."""
    writes = _private_writes()
    if writes is None:
        return None
    files = size = 0
    for root, _dirs, names in os.walk(writes):
        for name in names:
            with contextlib.suppress(OSError):
                info = os.lstat(os.path.join(root, name))
                if stat.S_ISREG(info.st_mode):
                    files += 1
                    size += info.st_size
            if files >= limit:
                return {"files": files, "bytes": size}
    return {"files": files, "bytes": size} if files else None


def clone_source(copy_from: str | None, tree: Isolation) -> str | None:
    """What a clone's TMPDIR starts from: its source's scratch dir, or with a private
    /tmp the source's own writes (not the whole /tmp: its lower layer is the host's)."""
    if copy_from is None and tree.tree.get("private_tmp"):
        return _private_writes() or tempfile.gettempdir()
    return copy_from


def before_forking_clones(copy_from: str | None, tree: Isolation) -> list[str]:
    """Run in a sandbox about to fork clones (``copy_from`` as they will pass it to
    :func:`gym_fork.system.birth.be_born`): list what their TMPDIRs start from once,
    here, instead of once in every clone (only an empty listing is remembered), and what
    they will share with this sandbox whatever their namespaces: its shared mappings
    (anonymous shared memory included: a fork does not copy them), and open files in /tmp
    or /dev/shm no clone can reopen on its copy. Returns those, named."""
    global _EMPTY_CLONE_SOURCE, _CLONE_INHERITS
    source = clone_source(copy_from, tree)
    try:
        _EMPTY_CLONE_SOURCE = source if source and not os.listdir(source) else None
    except OSError:
        _EMPTY_CLONE_SOURCE = None  # each clone looks for itself
    files, stuck = snapshot.private_files() if _PRIVATE_WRITES_FD is not None else ([], [])
    try:
        shared = snapshot.shared_mappings()  # every fork: ~40 us (1 ms where read as text)
    except OSError as exc:
        shared = [f"[its mappings could not be listed: {exc.strerror or exc}]"]
    _CLONE_INHERITS = (files, stuck, shared)
    return sorted(set(shared + stuck))


def new_scratch_dir(prefix: str) -> str:
    """A new directory ``prefix`` + random suffix in the scratch base, mode 0700 (what
    tempfile.mkdtemp makes, without building a random generator in every new sandbox)."""
    base = base_dir()
    for _ in range(100):
        path = os.path.join(base, prefix + os.urandom(6).hex())
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free scratch directory name in {base}")


def confine_sandbox(config: IsolationConfig, achieved: Isolation, clone: bool) -> None:
    """Last step of the set-up: give up the privileges it needed, then filter syscalls
    (``clone``: a fork of a confined sandbox)."""
    if not config.confine:
        why = "disabled by the caller (isolation.confine=False)"
        achieved.missing["capabilities"] = achieved.missing["seccomp"] = why
        return
    with contextlib.suppress(OSError):
        confine.forbid_tracing()
    # Clones make their own user namespace, which needs CAP_SETFCAP (confine.py).
    # A clone without a user namespace of its own cannot drop it from its bounding set
    # (that needs CAP_SETPCAP): it keeps what it inherited.
    inherited_only = clone and not achieved.sandbox.get("user")
    # An unprivileged uid maps itself into a clone's user namespace without CAP_SETFCAP
    # (the kernel asks for it only to map the host's uid 0).
    keep = (
        confine.KEPT_FOR_CLONES
        if os.geteuid() == 0 and (inherited_only or _clones_get_namespaces(config, achieved))
        else ()
    )
    try:
        confine.drop_capabilities(keep)
        achieved.sandbox["capabilities"] = "dropped, but CAP_SETFCAP" if keep else "dropped"
    except OSError as exc:
        achieved.missing["capabilities"] = str(exc)
    if not achieved.sandbox.get("no_new_privs"):
        achieved.missing["seccomp"] = "needs no_new_privs, which could not be set"
        return
    try:
        # Its own domain, nested in its source's for a clone: out of reach of siblings.
        achieved.sandbox["landlock"] = confine.enter_landlock_domain()
    except OSError as exc:
        achieved.missing["landlock"] = str(exc)
    try:
        refused = confine.install_seccomp()
        achieved.sandbox["seccomp"] = f"on ({refused} syscalls refused)"
    except OSError as exc:
        achieved.missing["seccomp"] = str(exc)


def _clones_get_namespaces(config: IsolationConfig, achieved: Isolation) -> bool:
    return (
        bool(achieved.sandbox.get("mount") and achieved.sandbox.get("private_tmp"))
        and bool(achieved.tree.get("tmp_view"))
        and not config.shared_writable()
    )


def copy_tree(source: str | None, target: str) -> None:
    """Copy ``source``'s entries into ``target`` (gym_fork/system/snapshot.py), without
    scratch directories and other mounts (a re-attached venv under /tmp is not copied)."""
    if not source:
        return
    try:
        listed = os.listdir(source)  # usually empty (a fresh /dev/shm): nothing else to do
    except OSError:
        return  # missing or not a directory
    scratch = [n for n in listed if n.startswith("gym_fork-scratch-")]
    if listed:
        snapshot.copy_tree(source, target, skip=scratch)


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

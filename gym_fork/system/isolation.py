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
- Each sandbox is then **confined** (gym_fork/system/confine.py): no capabilities, not
  dumpable, and a seccomp filter. Clones inherit that confinement from the sandbox they
  are forked from, so they cannot make namespaces of their own: a clone shares its
  source's mount and IPC namespaces and gets a private TMPDIR (a copy of its source's
  own /tmp writes) instead: what it writes through ``tempfile``/TMPDIR is its own, what
  it writes to a literal /tmp path its source sees (reported under ``missing``).

What is not isolated is reported, never assumed: see :func:`Isolation.report`.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from gym_fork.system import cgroups, confine, linux
from gym_fork.system import namespaces as ns
from gym_fork.system.scratch import base_dir


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox resource limits (None: not limited).

    ``memory_bytes`` caps the sandbox's data segment and anonymous memory (RLIMIT_DATA):
    an allocation beyond it fails inside the env (numpy raises MemoryError), reported as
    that sub-env's error; where a memory cgroup is writable it also caps the memory the
    sandbox adds (the OOM killer then ends it). ``cpu_seconds`` (RLIMIT_CPU) kills a
    sandbox with SIGXCPU. ``open_files`` is RLIMIT_NOFILE. ``processes`` is RLIMIT_NPROC
    (per user, not enforced for root) and, where available, the pids cgroup's pids.max.
    """

    memory_bytes: int | None = None
    cpu_seconds: int | None = None
    open_files: int | None = None
    processes: int | None = None


@dataclass(frozen=True)
class IsolationConfig:
    """What the caller asks for; :class:`Isolation` records what was achieved."""

    namespaces: bool = True
    network: bool = False
    private_tmp: bool = True
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    confine: bool = True  # drop capabilities and install the seccomp filter


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


# In a sandbox with a private /tmp overlay: the directory holding only its own writes.
_PRIVATE_WRITES: str | None = None
# In a sandbox forking clones: the directory their TMPDIRs start from, when it was
# empty just before the fork (each clone then skips listing it again).
_EMPTY_CLONE_SOURCE: str | None = None


def _remember_private_writes(path: str) -> None:
    global _PRIVATE_WRITES
    _PRIVATE_WRITES = path


# -- tree level (warm parent) --------------------------------------------------------
def isolate_tree(config: IsolationConfig, tree_id: int) -> Isolation:
    """Run once by the process that starts the tree, before anything is built or forked.

    When ``tree["pid"]`` is True, the caller's next child is pid 1 of the tree's new
    pid namespace and must call :func:`become_tree_init`."""
    achieved = Isolation(tree_id=tree_id)
    if not config.namespaces:
        achieved.missing["namespaces"] = "disabled by the caller (isolation.namespaces=False)"
        return achieved
    flags = ns.CLONE_NEWNS | ns.CLONE_NEWUTS | (0 if config.network else ns.CLONE_NEWNET)
    try:
        ns.unshare(flags)
    except OSError as exc:
        why = f"unshare failed ({exc.strerror}): needs root or user namespaces"
        for layer in ("mount", "uts", "net", "pid", "private_tmp"):
            achieved.missing[layer] = why
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
        return achieved
    try:
        ns.unshare(ns.CLONE_NEWPID)
        achieved.tree["pid"] = True
    except OSError as exc:
        achieved.missing["pid"] = f"pid namespace: {exc}"
    if not config.private_tmp:
        achieved.missing["private_tmp"] = (
            "private_tmp=False (the caller's choice): /tmp and /dev/shm are the host's"
        )
        return achieved
    try:
        # /tmp: the host's files stay readable (the drop-in), writes land in the tree's
        # own layer. /dev/shm: an empty tmpfs (POSIX shared memory is not shared out).
        os.close(ns.overlay_private_layer("/tmp"))
        ns.mount("tmpfs", "/dev/shm", "tmpfs", ns.MS_NOSUID | ns.MS_NODEV, "mode=1777")
        achieved.tree["private_tmp"] = True
    except OSError as exc:
        achieved.missing["private_tmp"] = f"overlay on /tmp failed ({exc.strerror})"
    return achieved


def become_tree_init(achieved: Isolation) -> None:
    """Run in pid 1 of the tree's pid namespace: mount the tree's own /proc."""
    try:
        ns.mount_own_proc()
        achieved.tree["proc"] = True
    except OSError as exc:
        achieved.missing["proc"] = f"own /proc: {exc} (the host's processes stay visible)"


# -- sandbox level ---------------------------------------------------------------------
def enter_sandbox(
    config: IsolationConfig, tree: Isolation, warm_parent: int, copy_from: str | None
) -> tuple[str | None, Isolation]:
    """Isolate, then confine, the calling (just forked) sandbox; returns its scratch dir
    and report.

    With namespaces the sandbox's /tmp and /dev/shm are its own tmpfs mounts (a copy of
    its source's) and the scratch dir is None: nothing on the host to clean. Without,
    or in a clone (which inherits its source's confinement and so cannot make mounts),
    it gets a private directory as TMPDIR (``copy_from`` is the source's, copied for a
    clone; None: the source's temp dir).
    """
    achieved = Isolation(tree=dict(tree.tree), missing=dict(tree.missing), tree_id=tree.tree_id)
    owner = tree.tree_id or warm_parent
    scratch = None
    inherited = confine.inherited()
    if inherited:
        why = (
            "a clone shares its source's mount and IPC namespaces: the source dropped the "
            "privileges that making new ones needs"
        )
        achieved.missing["sandbox_mount"] = why
        if config.namespaces and tree.tree.get("mount"):
            achieved.missing["ipc"] = why
        copy_from = _clone_source(copy_from, tree)
        if copy_from == _EMPTY_CLONE_SOURCE:
            copy_from = None  # nothing to copy: the source found it empty before the fork
    elif tree.tree.get("private_tmp"):
        try:
            ns.unshare(ns.CLONE_NEWNS | ns.CLONE_NEWIPC)
            achieved.sandbox.update(mount=True, ipc=True)
            # Kept open: clones of this sandbox start their TMPDIR from its writes.
            _remember_private_writes(f"/proc/self/fd/{ns.overlay_private_layer('/tmp')}/upper")
            mount_fd = ns.new_tmpfs()
            _copy_tree("/dev/shm", f"/proc/self/fd/{mount_fd}")
            ns.attach_mount(mount_fd, "/dev/shm")
            achieved.sandbox["private_tmp"] = achieved.sandbox["private_shm"] = True
        except OSError as exc:
            achieved.missing["sandbox_mount"] = f"per-sandbox mount/ipc namespace: {exc}"
    if not config.private_tmp:
        pass  # the caller wants the host's /tmp: nothing private, nothing to copy
    elif not achieved.sandbox.get("private_tmp"):
        scratch = _new_scratch_dir(f"gym_fork-scratch-{owner}-{os.getpid()}-")
        _copy_tree(copy_from, scratch)
        os.environ["TMPDIR"] = scratch
        tempfile.tempdir = scratch
        achieved.missing.setdefault(
            "private_tmp", "no private mounts: TMPDIR points to a private directory instead"
        )
    else:
        os.environ["TMPDIR"] = "/tmp"
        tempfile.tempdir = "/tmp"
    if (
        not inherited
        and not achieved.sandbox.get("mount")
        and config.namespaces
        and tree.tree.get("mount")
    ):
        try:  # still give the sandbox its own IPC namespace
            ns.unshare(ns.CLONE_NEWIPC)
            achieved.sandbox["ipc"] = True
        except OSError as exc:
            achieved.missing["ipc"] = str(exc)
    try:
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        achieved.sandbox["no_new_privs"] = True
    except OSError as exc:
        achieved.missing["no_new_privs"] = str(exc)
    achieved.limits = apply_limits(config.limits, achieved.missing)
    limits = config.limits
    if limits.memory_bytes is not None or limits.processes is not None:
        joined = cgroups.join(owner, limits.memory_bytes, limits.processes)
        for name, why in joined.pop("errors").items():
            achieved.missing[f"cgroup_{name}"] = why
        if "processes" in joined:
            achieved.missing.pop("limit_processes", None)  # pids.max binds root too
        achieved.limits["cgroups"] = joined
    _confine(config, achieved)
    return scratch, achieved


def _clone_source(copy_from: str | None, tree: Isolation) -> str | None:
    """What a clone's TMPDIR starts from: its source's scratch dir, or with a private
    /tmp the source's own writes (not the whole /tmp: its lower layer is the host's)."""
    if copy_from is None and tree.tree.get("private_tmp"):
        return _PRIVATE_WRITES or tempfile.gettempdir()
    return copy_from


def before_forking_clones(copy_from: str | None, tree: Isolation) -> None:
    """Run in a sandbox about to fork clones (``copy_from`` as they will pass it to
    :func:`enter_sandbox`): list what their TMPDIRs start from once, here, instead of
    once in every clone. Only an empty listing is remembered."""
    global _EMPTY_CLONE_SOURCE
    source = _clone_source(copy_from, tree)
    try:
        _EMPTY_CLONE_SOURCE = source if source and not os.listdir(source) else None
    except OSError:
        _EMPTY_CLONE_SOURCE = None  # each clone looks for itself


def _new_scratch_dir(prefix: str) -> str:
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


def _confine(config: IsolationConfig, achieved: Isolation) -> None:
    """Last step of the set-up: give up the privileges it needed, then filter syscalls."""
    if not config.confine:
        why = "disabled by the caller (isolation.confine=False)"
        achieved.missing["capabilities"] = achieved.missing["seccomp"] = why
        return
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            confine.forbid_tracing()
    try:
        confine.drop_capabilities()
        achieved.sandbox["capabilities"] = "dropped"
    except OSError as exc:
        achieved.missing["capabilities"] = str(exc)
    if not achieved.sandbox.get("no_new_privs"):
        achieved.missing["seccomp"] = "needs no_new_privs, which could not be set"
        return
    try:
        refused = confine.install_seccomp()
        achieved.sandbox["seccomp"] = f"on ({refused} syscalls refused)"
    except OSError as exc:
        achieved.missing["seccomp"] = str(exc)


def _copy_tree(source: str | None, target: str, skip: list[str] = ()) -> None:
    """Copy ``source``'s entries into ``target``, without ``skip``, scratch directories
    and other mounts (a re-attached venv under /tmp is not copied)."""
    if not source:
        return
    try:
        listed = os.listdir(source)  # usually empty (a fresh /dev/shm): nothing else to do
    except OSError:
        return  # missing or not a directory
    if not listed:
        return
    device = os.stat(source).st_dev
    names = [
        n
        for n in listed
        if os.path.join(source, n) not in skip and not n.startswith("gym_fork-scratch-")
    ]
    for name in names:
        src, dst = os.path.join(source, name), os.path.join(target, name)
        with contextlib.suppress(OSError):
            if os.lstat(src).st_dev != device:
                continue
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)


_RLIMITS = {
    "memory_bytes": resource.RLIMIT_DATA,
    "cpu_seconds": resource.RLIMIT_CPU,
    "open_files": resource.RLIMIT_NOFILE,
    "processes": resource.RLIMIT_NPROC,
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
    if limits.processes is not None and os.geteuid() == 0:
        missing["limit_processes"] = "RLIMIT_NPROC is not enforced for root"
    return applied

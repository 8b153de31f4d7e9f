"""The per-sandbox and per-clone pieces of a process sandbox's isolation, each one step
of its birth (gym_fork/system/birth.py runs them in order; gym_fork/system/isolation.py
says what each layer is for and sets up the tree once).

A fresh sandbox: a network namespace where it needs one, its own /tmp overlay and
/dev/shm, the tree's unprivileged uid, its confinement. A clone: a user namespace of its
own and in it mount, IPC and network namespaces, its /tmp and /dev/shm copies of its
source's, and what it still shares with its source reported. Kept here per process: the
fd of this sandbox's own /tmp writes and what its clones inherit, listed once before
they are forked. Also the private TMPDIR where no private mount is, and what a sandbox
left in its /tmp.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from typing import TYPE_CHECKING

from gym_fork.system import (
    confine,
    frozen_layers,
    host_view,
    identity,
    landlock,
    layer_slots,
    linux,
    snapshot,
)
from gym_fork.system import namespaces as ns
from gym_fork.system.scratch import base_dir

if TYPE_CHECKING:  # isolation.py imports this module: annotations only, no cycle
    from gym_fork.system.isolation import Isolation, IsolationConfig


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


def private_layer_fd() -> int | None:
    """The fd of this sandbox's own /tmp layer (the layer helper freezes it before a
    FORK: gym_fork/system/frozen_layers.py), None without one."""
    return _PRIVATE_WRITES_FD


def own_private_tmp(config: IsolationConfig, in_user_namespace: bool) -> None:
    """A fresh sandbox's own /tmp (an overlay on the tree's, its writes kept open: clones
    of it start their /tmp from them) and /dev/shm. Its overlay marks opaque
    directories in user.* xattrs where its layer may be frozen (what a clone's overlay
    reads, in its own user namespace)."""
    size = config.layer_bytes()
    userxattr = in_user_namespace or frozen_layers.kernel_supports_layers()
    _remember_private_writes(ns.overlay_private_layer("/tmp", size, in_user_namespace=userxattr))
    host_view.own_dev_shm(size)


def adopt_frozen_layer(layer_fd: int) -> None:
    """In a source whose /tmp the layer helper has just frozen (a new overlay over its
    writes so far, read-only now): keep ``layer_fd`` as its own layer, point its open
    /tmp files and its working directory at what /tmp shows now (writing through them
    would change the frozen files under its clones)."""
    global _PRIVATE_WRITES_FD
    layer_slots.adopted_layer()
    # Kept first: it is this sandbox's layer now, whatever happens next.
    if _PRIVATE_WRITES_FD is None:
        _PRIVATE_WRITES_FD = layer_fd
    else:  # the same fd number: what the controller knows it by (its HELLO's report)
        try:
            os.dup2(layer_fd, _PRIVATE_WRITES_FD, inheritable=False)
        finally:
            os.close(layer_fd)
    files, _stuck = snapshot.private_files()
    snapshot.reopen_copied_files(files)
    host_view.reenter_working_directory()


def own_network(config: IsolationConfig, clone: bool = False) -> int:
    """CLONE_NEWNET where a sandbox needs a network namespace of its own. The tree's is
    empty (no interface), so what it would share is abstract UNIX sockets: Landlock's
    scoping (ABI 6) keeps those between a sandbox and its own domain already, except
    that a domain reaches the domains nested in it, so a source would reach its clones'.
    Hence: every clone, and sandboxes only without Landlock (~0.45 ms each, and more to
    tear down)."""
    if config.network:
        return 0
    if not clone and landlock.landlock_abi() >= landlock.LANDLOCK_MIN_ABI:
        return 0
    return ns.CLONE_NEWNET


def enter_clone_namespaces(config: IsolationConfig, tree: Isolation, achieved: Isolation) -> None:
    """A clone (forked from a confined sandbox): a user namespace of its own, and in it
    mount, IPC and network namespaces; its /tmp and /dev/shm start as copies of its
    source's. On failure nothing is changed and the reason is under ``missing``."""
    global _PRIVATE_WRITES_FD
    achieved.sandbox.pop("tmp_layer_fd", None)  # its source's, if inherited
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
                copy_tree(writes, upper, layer=True)

        layers = layer_slots.layer_paths()  # its source's frozen writes, shared
        own = ns.overlay_private_layer(
            "/tmp",
            size,
            lower=":".join([*layers, host_view.TREE_TMP_VIEW]),
            fill=fill,
            in_user_namespace=True,
        )
        if layers:
            achieved.sandbox["tmp_layers"] = len(layers)
        if source is not None:
            os.close(source)  # the source's layer: not this clone's to write
        _PRIVATE_WRITES_FD = own
        achieved.sandbox["tmp_layer_fd"] = own
        host_view.own_dev_shm(size)
        host_view.reenter_working_directory()  # else it writes its source's /tmp
        achieved.sandbox["private_tmp"] = achieved.sandbox["private_shm"] = True
    except OSError as exc:
        # Its mount namespace is a copy of its source's: /tmp is still the source's layer,
        # and running on it would write the source's files. The fork fails instead.
        raise OSError(
            exc.errno,
            f"fork: a clone's own /tmp and /dev/shm could not be made ({exc}); it would "
            "have written its source's",
        ) from exc
    # What it inherited open or mapped from its source (listed by the source before the
    # fork): files reopened on the copies, shared mappings (a fork cannot copy them)
    # reported.
    files, stuck, shared = _CLONE_INHERITS
    reopened, failed = snapshot.reopen_copied_files(files)
    if reopened:
        achieved.sandbox["reopened_files"] = reopened
    report_shared_with_source(achieved, shared + stuck + failed)


def clone_inherits_shared() -> list[str]:
    """The shared mappings and memfds a clone's source listed before the fork."""
    return _CLONE_INHERITS[2]


def report_shared_with_source(achieved: Isolation, shared: list[str]) -> None:
    """Say under ``missing`` which files and mappings a clone inherited (``shared``)
    stay shared with its source."""
    names = sorted(set(shared))
    if names:
        achieved.missing["shared_with_source"] = (
            f"{len(names)} open file(s) or MAP_SHARED mapping(s) inherited from its source "
            f"stay shared with it (writes through them reach the source, and the "
            f"source's reach the branch): {', '.join(names[:5])}"
        )


def write_text(path: str, text: str) -> None:
    """Write ``text`` into the existing file ``path`` (a /proc file) in one write."""
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


def before_forking_clones(
    copy_from: str | None,
    tree: Isolation,
    handed: frozenset[int] = frozenset(),
    swapping: bool = False,
) -> list[str]:
    """Run in a sandbox about to fork clones (``copy_from`` as they will pass it to
    :func:`gym_fork.system.birth.be_born`): list what their TMPDIRs start from once,
    here, instead of once in every clone (only an empty listing is remembered), and what
    they will share with this sandbox whatever their namespaces: its shared mappings
    (anonymous shared memory included: a fork does not copy them), memfds it holds open
    (mapped or not: read and written through the fd, it is shared memory all the same),
    and open files in /tmp or /dev/shm no clone can reopen on its copy. Returns those,
    named. ``handed``: the clones' fds the controller sent and its own channel's and slab's
    (no file of /tmp or /dev/shm, no memfd of the env's: not looked at).
    ``swapping``: the layer helper may be moving its /tmp writes now (a freeze, or its
    undoing): no listing of them is remembered, each clone looks once its source has
    its word on the layer."""
    global _EMPTY_CLONE_SOURCE, _CLONE_INHERITS
    source = None if swapping else clone_source(copy_from, tree)
    try:
        _EMPTY_CLONE_SOURCE = source if source and not os.listdir(source) else None
    except OSError:
        _EMPTY_CLONE_SOURCE = None  # each clone looks for itself
    # One pass over its fds: its /tmp and /dev/shm files, and memfds it holds (shared
    # memory a clone would share through the fd, mapped or not).
    listed, stuck = snapshot.private_files((*snapshot.PRIVATE_PREFIXES, "/memfd:"), handed)
    memfds = [p for p in (*(p for _fd, p in listed), *stuck) if p.startswith("/memfd:")]
    files = [(fd, p) for fd, p in listed if not p.startswith("/memfd:")]
    stuck = [p for p in stuck if not p.startswith("/memfd:")]
    if _PRIVATE_WRITES_FD is None:
        files, stuck = [], []
    try:
        shared = snapshot.shared_mappings()  # every fork: ~40 us (1 ms where read as text)
    except OSError as exc:
        shared = [f"[its mappings could not be listed: {exc.strerror or exc}]"]
    _CLONE_INHERITS = (files, stuck, shared + memfds)
    return sorted(set(shared + stuck + memfds))


def writes_tmp_files() -> bool:
    """After :func:`before_forking_clones`: whether this sandbox holds a file of its /tmp
    open for writing (its clones would inherit it: a frozen layer's seal waits for every
    writer to go)."""
    return any(
        path.startswith("/tmp/") and snapshot.opened_for_writing(fd)
        for fd, path in _CLONE_INHERITS[0]
    )


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
        achieved.sandbox["landlock"] = landlock.enter_landlock_domain()
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


def copy_tree(source: str | None, target: str, layer: bool = False) -> None:
    """Copy ``source``'s entries into ``target`` (gym_fork/system/snapshot.py), without
    scratch directories and other mounts (a re-attached venv under /tmp is not copied);
    ``layer``: an overlay's upper layer (its whiteouts and opaque directories too)."""
    if not source:
        return
    try:
        listed = os.listdir(source)  # usually empty (a fresh /dev/shm): nothing else to do
    except OSError:
        return  # missing or not a directory
    scratch = [n for n in listed if n.startswith("gym_fork-scratch-")]
    if listed:
        snapshot.copy_tree(source, target, skip=scratch, layer=layer)

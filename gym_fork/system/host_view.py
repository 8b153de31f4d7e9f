"""What a sandbox sees of the host's file system: the tree's minimal /dev, the views it
keeps of the tree's /tmp and of the writable directories, and each sandbox's read-only
mounts (used by gym_fork/system/isolation.py and sandbox_isolation.py, in the order
system/birth.py gives)."""

from __future__ import annotations

import contextlib
import errno
import os

from gym_fork.system import frozen_layers, snapshot
from gym_fork.system import namespaces as ns
from gym_fork.system import paths as no_follow

# The tree's /tmp, seen read-only by its sandboxes at this path of the tree's own /dev:
# the lower layer a clone builds its own /tmp on (the sandbox's /tmp hides it).
TREE_TMP_VIEW = "/dev/.gym_fork-tree-tmp"
WRITABLE_VIEW = "/dev/.gym_fork-writable-"  # + the index in writable_paths
# Where the kernel takes settings or commands: read-only in every sandbox, as container
# runtimes make them (runc's readonlyPaths).
READ_ONLY_PROC = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
# The devices of a sandbox's /dev (its own tmpfs): nothing that reaches hardware but
# GPUs, which CUDA and EGL envs need. No tty: /dev/tty is the controlling terminal's
# alias (the tree gives its up), and a terminal is where TIOCSTI types into a shell.
DEVICES = ("null", "zero", "full", "random", "urandom")
GPU_DEVICE_PREFIXES = ("nvidia",)
GPU_DEVICE_DIRS = ("dri",)

# The host's /tmp and /dev/shm as (where it goes, where from), with private_tmp=False.
HOST_TMP = (("/tmp", "/tmp"), ("/dev/shm", "/dev/shm"))

# (where it goes, a detached mount's fd, or why it could not be taken)
Kept = list[tuple[str, int | OSError]]


def minimal_dev(keep_host_shm: bool) -> None:
    """Cover /dev with a tmpfs holding only the devices an env needs (bound from the
    host's), a devpts of its own and, if ``keep_host_shm``, the host's /dev/shm."""
    keep = [n for n in DEVICES if os.path.exists(f"/dev/{n}")]
    with contextlib.suppress(OSError):
        names = os.listdir("/dev")
        keep += [n for n in names if n.startswith(GPU_DEVICE_PREFIXES)]
        keep += [n for n in names if n in GPU_DEVICE_DIRS]
    if keep_host_shm:
        keep.append("shm")
    clones = {}
    try:
        for name in keep:
            clones[name] = ns.clone_mount(f"/dev/{name}", recursive=True)
        ns.mount("tmpfs", "/dev", "tmpfs", ns.MS_NOSUID | ns.MS_NOEXEC, "mode=755,size=1m")
        for name, fd in list(clones.items()):
            path = f"/dev/{name}"
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.mkdir(path, 0o755)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o666))
            del clones[name]
            ns.attach_mount(fd, path)
    finally:
        for fd in clones.values():
            os.close(fd)
    if not os.path.exists("/dev/shm"):
        os.mkdir("/dev/shm", 0o1777)
    os.mkdir(
        frozen_layers.LAYERS_DIR, 0o555
    )  # where sandboxes' frozen /tmp layers go (frozen_layers.py)
    os.mkdir("/dev/pts", 0o755)
    ns.mount(
        "devpts",
        "/dev/pts",
        "devpts",
        ns.MS_NOSUID | ns.MS_NOEXEC,
        "newinstance,ptmxmode=0666,mode=620",
    )
    for name, target in (
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"/dev/{name}")


def bind_writable_views(paths: tuple[str, ...]) -> int:
    """Bind each of ``paths`` at a path of the tree's /dev, before the tree's /tmp
    overlay hides the host's /tmp: where sandboxes take their writable copies. Each is
    reached through no symlink and bound from its fd (:func:`bind_from`). Returns how
    many were bound; raises OSError naming the one that could not be."""
    for i, path in enumerate(paths):
        try:
            mount_fd = bind_from(path)
            try:
                os.mkdir(f"{WRITABLE_VIEW}{i}", 0o700)
            except BaseException:
                os.close(mount_fd)
                raise
            ns.attach_mount(mount_fd, f"{WRITABLE_VIEW}{i}")
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: {exc}") from exc
    return len(paths)


def bind_from(path: str) -> int:
    """A detached recursive copy of the mounts at the directory ``path``, opened through
    no symlink and copied from that fd (nothing walks ``path`` again, whatever a
    sandbox changes meanwhile). A symlink in ``path`` raises OSError(ELOOP) naming it."""
    fd = _open_directory(path)
    try:
        return ns.clone_mount_of(fd)
    finally:
        os.close(fd)


def bind_tree_tmp_view() -> None:
    """The tree's /tmp, read-only to sandboxes once their view is: a clone's lower layer."""
    os.mkdir(TREE_TMP_VIEW, 0o700)
    ns.mount("/tmp", TREE_TMP_VIEW, None, ns.MS_BIND)


def writable_sources(
    host_tmp: bool, paths: tuple[str, ...], views: int
) -> list[tuple[str, str | None]]:
    """(where it goes, where to copy it from) for each writable host directory: the
    host's /tmp and /dev/shm if ``host_tmp``, and the tree's views of ``paths`` (its
    /tmp overlay and /dev hide the host's), of which ``views`` were bound; None for the
    others: copied from the directory itself, reached through no symlink."""
    shared: list[tuple[str, str | None]] = list(HOST_TMP) if host_tmp else []
    for i, path in enumerate(paths):
        shared.append((path, f"{WRITABLE_VIEW}{i}" if i < views else None))
    return shared


def read_only_view(sources: list[tuple[str, str | None]]) -> Kept:
    """Make every mount of this (new) mount namespace read-only but /proc (except the
    kernel's settings in :data:`READ_ONLY_PROC`); returns detached writable copies of
    ``sources`` for :func:`attach_writable` (taken before, so still writable). A copy
    that cannot be taken is kept as its error, raised by :func:`attach_writable`: the
    view is read-only whatever happens to a writable directory."""
    kept: Kept = []
    try:
        for target, source in sources:
            try:
                fd = bind_from(target) if source is None else ns.clone_mount(source)
            except OSError as exc:
                kept.append((target, exc))
                continue
            kept.append((target, fd))
        ns.set_mount_attributes("/", recursive=True, set_=ns.MOUNT_ATTR_RDONLY)
        # A process writes some of its own /proc files (oom_score_adj, a user
        # namespace's uid_map): /proc itself stays writable, the kernel's knobs do not.
        ns.set_mount_attributes("/proc", recursive=False, clear=ns.MOUNT_ATTR_RDONLY)
        for path in READ_ONLY_PROC:
            if os.path.exists(path):
                ns.bind_read_only(path)
    except BaseException:
        _close_all(kept)
        raise
    return kept


def attach_writable(kept: Kept) -> None:
    """Put the writable copies in place (nosuid, nodev): last, over the sandbox's own
    /tmp too, so a writable directory under /tmp is the host's. Each goes on the
    directory at its path reached through no symlink (as the view shows it now). Then
    the process re-enters its working directory: a mount put over it (or over a
    directory above it) is seen only by a path walked after. Raises the first error, once
    the others are in place."""
    first: OSError | None = None
    try:
        while kept:
            target, fd = kept.pop(0)
            try:
                _attach_writable(target, fd)
            except OSError as exc:
                first = first or OSError(exc.errno, f"{target}: {exc}")
    finally:
        _close_all(kept)
        reenter_working_directory()
    if first is not None:
        raise first


def _attach_writable(target: str, fd: int | OSError) -> None:
    if isinstance(fd, OSError):
        raise fd
    try:
        ns.set_mount_attributes(
            fd,
            recursive=True,
            set_=ns.MOUNT_ATTR_NOSUID | ns.MOUNT_ATTR_NODEV,
            clear=ns.MOUNT_ATTR_RDONLY,
        )
        where = None if (target, target) in HOST_TMP else _open_directory(target)
    except BaseException:
        os.close(fd)
        raise
    if where is None:
        ns.attach_mount(fd, target)
        return
    try:
        ns.attach_mount_on(fd, where, target)
    finally:
        os.close(where)


def _open_directory(path: str) -> int:
    """:func:`no_follow.open_directory`, a symlink refused as OSError(ELOOP)."""
    try:
        return no_follow.open_directory(path)
    except no_follow.SymlinkInPath as exc:
        raise OSError(errno.ELOOP, str(exc)) from exc


def reenter_working_directory() -> None:
    """chdir again to the working directory's path: a process's cwd stays on the
    directory it entered, under any mount put over it since (its writes would land
    there: in a read-only view, or a clone's source's /tmp)."""
    with contextlib.suppress(OSError):
        no_follow.enter(os.getcwd())


def own_dev_shm(size: int) -> None:
    """Cover /dev/shm with a tmpfs of its own holding a copy of what it shows now."""
    mount_fd = ns.new_tmpfs(size)
    if os.listdir("/dev/shm"):
        snapshot.copy_tree("/dev/shm", f"/proc/self/fd/{mount_fd}")
    ns.attach_mount(mount_fd, "/dev/shm")


def _close_all(kept: Kept) -> None:
    for _, fd in kept:
        if isinstance(fd, int):
            os.close(fd)
    kept.clear()

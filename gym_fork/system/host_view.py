"""What a sandbox sees of the host's file system: the tree's minimal /dev, the views it
keeps of the tree's /tmp and of the writable directories, and each sandbox's read-only
mounts (used by gym_fork/system/isolation.py, in the order it gives)."""

from __future__ import annotations

import contextlib
import os

from gym_fork.system import namespaces as ns
from gym_fork.system import snapshot

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

Kept = list[tuple[str, int]]  # (where it goes, a detached mount's fd)


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
    overlay hides the host's /tmp: where sandboxes take their writable copies. Returns
    how many were bound; raises OSError naming the one that could not be."""
    for i, path in enumerate(paths):
        try:
            os.mkdir(f"{WRITABLE_VIEW}{i}", 0o700)
            ns.mount(path, f"{WRITABLE_VIEW}{i}", None, ns.MS_BIND | ns.MS_REC)
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: {exc}") from exc
    return len(paths)


def bind_tree_tmp_view() -> None:
    """The tree's /tmp, read-only to sandboxes once their view is: a clone's lower layer."""
    os.mkdir(TREE_TMP_VIEW, 0o700)
    ns.mount("/tmp", TREE_TMP_VIEW, None, ns.MS_BIND)


def writable_sources(host_tmp: bool, paths: tuple[str, ...], views: int) -> list[tuple[str, str]]:
    """(where it goes, where to copy it from) for each writable host directory: the
    host's /tmp and /dev/shm if ``host_tmp``, and the tree's views of ``paths`` (its
    /tmp overlay and /dev hide the host's), of which ``views`` were bound."""
    shared = [("/tmp", "/tmp"), ("/dev/shm", "/dev/shm")] if host_tmp else []
    for i, path in enumerate(paths):
        shared.append((path, f"{WRITABLE_VIEW}{i}" if i < views else path))
    return shared


def read_only_view(sources: list[tuple[str, str]]) -> Kept:
    """Make every mount of this (new) mount namespace read-only but /proc (except the
    kernel's settings in :data:`READ_ONLY_PROC`); returns detached writable copies of
    ``sources`` for :func:`attach_writable` (taken before, so still writable)."""
    kept: Kept = []
    try:
        for target, source in sources:
            kept.append((target, ns.clone_mount(source, recursive=True)))
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
    /tmp too, so a writable directory under /tmp is the host's."""
    try:
        while kept:
            target, fd = kept.pop(0)
            try:
                ns.set_mount_attributes(
                    fd,
                    recursive=True,
                    set_=ns.MOUNT_ATTR_NOSUID | ns.MOUNT_ATTR_NODEV,
                    clear=ns.MOUNT_ATTR_RDONLY,
                )
            except BaseException:
                os.close(fd)
                raise
            ns.attach_mount(fd, target)
    finally:
        _close_all(kept)


def own_dev_shm(size: int) -> None:
    """Cover /dev/shm with a tmpfs of its own holding a copy of what it shows now."""
    mount_fd = ns.new_tmpfs(size)
    if os.listdir("/dev/shm"):
        snapshot.copy_tree("/dev/shm", f"/proc/self/fd/{mount_fd}")
    ns.attach_mount(mount_fd, "/dev/shm")


def _close_all(kept: Kept) -> None:
    for _, fd in kept:
        os.close(fd)
    kept.clear()

"""The identity env code runs as: an unprivileged host uid instead of the host's root.

A sandbox is set up as root (namespaces, mounts and cgroups need it), then becomes
``SANDBOX_UID_BASE + tree % SANDBOX_UID_RANGE`` (uid and gid, no supplementary groups
but those that own the GPU devices it is given) before the first line of env code. Then
file permissions protect owner-only files (``~/.ssh/*``, credential files: the
capabilities a sandbox drops never included reading them as their owner), and the
kernel's per-user quotas (inotify instances, POSIX message queue bytes, user
namespaces) are charged to the tree's own uid, not to the host's root, whose other
programs would fail once a sandbox took them all.

The uid is not in /etc/passwd: nothing needs it there (``getpass.getuser()`` reads
``USER`` first, which the sandbox keeps). A clone makes its own user namespace mapping
its uid 0 to this uid (gym_fork/system/sandbox_isolation.py), which an unprivileged process
may do without any capability.

Where env code could not read what it needs as another user (the working directory or
an import path inside a directory only root may enter, such as ``/root``), or write a
``writable_paths`` directory only root may write, the sandbox stays root and says why
under ``missing["identity"]`` (``sandbox_user="unprivileged"`` insists; ``"root"``
asks for today's root explicitly).
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from collections.abc import Iterable

from gym_fork.system import confine

SANDBOX_UID_BASE = 0x5F000000  # 1593835520: far above any uid a distribution hands out
SANDBOX_UID_RANGE = 1 << 20
CHOICES = ("auto", "unprivileged", "root")

_PR_SET_KEEPCAPS = 8

_libc = ctypes.CDLL(None, use_errno=True)


def sandbox_uid(tree_id: int) -> int:
    """The host uid (and gid) of a tree's sandboxes."""
    return SANDBOX_UID_BASE + tree_id % SANDBOX_UID_RANGE


def _blocked(path: str, write: bool = False) -> tuple[list[str], str | None]:
    """What stops a user who is neither owner nor in the group from using ``path`` (a
    directory: listing and entering it; ``write``: creating files in it; a file: reading
    it): (the directories above it they cannot enter, the first other obstacle or None).
    Symlinks are followed as the kernel would."""
    path = os.path.realpath(path)
    parts = path.split(os.sep)
    closed: list[str] = []
    for depth in range(2, len(parts) + 1):
        component = os.sep.join(parts[:depth])
        try:
            info = os.stat(component)
        except OSError:
            return closed, None  # missing: nothing to read there
        if depth < len(parts):
            if not info.st_mode & stat.S_IXOTH:
                closed.append(component)
            continue
        if stat.S_ISDIR(info.st_mode):
            need = stat.S_IROTH | stat.S_IXOTH | (stat.S_IWOTH if write else 0)
        else:
            need = stat.S_IROTH
        if info.st_mode & need != need:
            return closed, component
    return closed, None


def plan(read: Iterable[str], write: Iterable[str]) -> tuple[list[str], str | None]:
    """How env code can run as an unprivileged user here: (the directories above what it
    reads that such a user cannot enter, to be opened in the tree's own view: see
    :func:`open_passages`, None), or ([], the reason it cannot: a ``writable_paths``
    entry only root may write, something it must read that only root may)."""
    passages: list[str] = []
    for path in write:
        closed, stop = _blocked(path, write=True)
        if closed or stop:
            return [], f"writable_paths entry {path!r} is not writable by other users"
    for path in read:
        closed, stop = _blocked(path)
        if stop is not None:
            return [], f"{path!r} is not readable by other users ({stop!r})"
        passages += closed
    return list(dict.fromkeys(passages)), None


def paths_env_code_reads() -> list[str]:
    """What env code reads as it runs: the working directory, the interpreter and every
    directory on the import path (run in the warm parent, whose view they are)."""
    paths = [os.getcwd(), sys.executable]
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    return list(dict.fromkeys(paths))


def device_groups(devices: Iterable[str]) -> list[int]:
    """The groups owning ``devices`` (GPU render nodes are often 0660 root:render), so
    that a sandbox given them can still open them."""
    groups = set()
    for path in devices:
        try:
            info = os.stat(path)
        except OSError:
            continue
        if info.st_mode & stat.S_IRWXG and info.st_gid != 0:
            groups.add(info.st_gid)
    return sorted(groups)


def become(uid: int, groups: Iterable[int] = ()) -> None:
    """Switch every uid and gid of this process to ``uid`` (a root process only), keeping
    its capabilities in force for the rest of its set-up (the caller drops them next).

    Raises OSError naming the call that failed."""
    _call(_libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups(list(groups))
    os.setresgid(uid, uid, uid)
    parent = os.getppid()
    os.setresuid(uid, uid, uid)
    _call(_libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    # A change of uid clears the parent-death signal: armed again (SIGKILL, as for every
    # sandbox), unless the parent is already gone.
    _call(_libc.prctl(1, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(70)
    # A uid change empties the effective set: raise it back from the permitted set, for
    # the capability drop (dropping from the bounding set needs CAP_SETPCAP in force).
    header = confine.CapHeader(confine.CAP_VERSION_3, 0)
    data = (confine.CapData * 2)()
    _call(_libc.capget(ctypes.byref(header), data), "capget")
    for word in data:
        word.effective = word.permitted
    _call(_libc.capset(ctypes.byref(header), data), "capset")


def _call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def open_passages(directories: Iterable[str], size_bytes: int) -> None:
    """In the tree's own mount namespace (privileged, before any env code): let other
    users through each of ``directories`` (enter, not list) without touching the host:
    each is covered by an overlay of itself whose directory gets the search bit for
    others (a metadata copy-up in the tree's tmpfs layer). Owner-only files inside stay
    owner-only. Raises OSError naming the directory that cannot be given one (a mount
    below it would be hidden by the overlay)."""
    from gym_fork.system import namespaces as ns

    mounts = _mount_points()
    for directory in directories:
        below = [m for m in mounts if m.startswith(directory.rstrip("/") + "/")]
        if below:
            raise OSError(
                f"{directory!r} holds other mounts ({below[0]!r}): it cannot be opened for "
                "an unprivileged uid without hiding them"
            )
        info = os.stat(directory)
        os.close(ns.overlay_private_layer(directory, size_bytes))
        os.chown(directory, info.st_uid, info.st_gid)
        os.chmod(directory, stat.S_IMODE(info.st_mode) | stat.S_IXOTH)


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        # Field 5 is the mount point (octal escapes for spaces: fine for a prefix test).
        return [line.split()[4] for line in f]


def map_user_namespace(pid: int, uid: int) -> None:
    """From outside (a root process): map uid and gid 0 of ``pid``'s new user namespace
    to host ``uid``, so that it is that uid on the host and root only in there."""
    for name in ("uid_map", "gid_map"):
        fd = os.open(f"/proc/{pid}/{name}", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, f"0 {uid} 1\n".encode())
        finally:
            os.close(fd)

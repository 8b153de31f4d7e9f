"""What the layer helper reads of a source sandbox before it freezes its /tmp writes
(gym_fork/system/frozen_layers.py), trusting none of it: the process behind the pidfd,
the fd it names as its layer (a detached tmpfs directory), its namespace's mount table
(the slots of earlier layers), and what a new /tmp would break or could not seal (a /tmp
file mapped shared, a unix socket bound or a fifo held there, a deleted file held open
or a deleted working directory). Each refusal is a :class:`FreezeRefused` saying why;
the source's clones then copy its writes as before. The slowest of these reads are made
by the read-only check that comes ahead of a fork, for its freeze (:func:`found`).

Stdlib only: imported by the helper's script too (``python -S``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time

try:
    from gym_fork.system import procmaps
except ImportError:  # run by layer_helper.py as a script: the package is not imported
    import procmaps  # type: ignore[import-not-found,no-redef]

LAYERS_DIR = (
    "/dev/.gym_fork-layers"  # made by the tree's /dev (host_view.minimal_dev, which names it too)
)
# Each layer is a mount in the source's namespace and in every namespace copied from it,
# and a lower of each /tmp mounted since; 32 keeps /tmp's mount options well under a page.
MAX_LAYERS = 32
_TMPFS_MAGIC = 0x01021994
_PIDFD_GET_INFO, _PIDFD_INFO_PID = 0xC040FF0B, 1  # _IOWR(0xFF, 11, struct pidfd_info)
_SYS_PIDFD_GETFD = 438
_libc = ctypes.CDLL(None, use_errno=True)


class FreezeRefused(Exception):
    """The source's /tmp is not frozen (why); its clones copy its writes as before."""


def their_fd(pidfd: int, number: int) -> int:
    fd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, number, 0)
    if fd < 0:
        err = ctypes.get_errno()
        raise FreezeRefused(f"its layer fd {number} could not be taken ({os.strerror(err)})")
    return fd


def pid_of(pidfd: int) -> int:
    """The pid (in our pid namespace) of the process ``pidfd`` holds: one ioctl
    (PIDFD_GET_INFO, Linux 6.13+), else its fdinfo (~0.1 ms)."""
    info = (ctypes.c_uint64 * 8)()  # struct pidfd_info, version 0: 64 bytes
    info[0] = _PIDFD_INFO_PID
    if _libc.ioctl(pidfd, _PIDFD_GET_INFO, info) == 0 and info[0] & _PIDFD_INFO_PID:
        pid = info[2] & 0xFFFFFFFF  # __u32 pid follows the mask and the cgroup id
        if pid > 0:
            return pid
    elif ctypes.get_errno() == errno.ESRCH:
        raise FreezeRefused("its process is gone")
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                pid = int(line.split()[1])
                if pid > 0:
                    return pid
    raise FreezeRefused("its process is gone")


def _mount_id(path_or_fd: str | int) -> int:
    fd = path_or_fd if isinstance(path_or_fd, int) else os.open(path_or_fd, os.O_PATH)
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    finally:
        if not isinstance(path_or_fd, int):
            os.close(fd)
    return -1


def check_is_tmpfs_directory(layer: int) -> None:
    if not stat.S_ISDIR(os.fstat(layer).st_mode):
        raise FreezeRefused("its layer fd is not a directory")
    buf = (ctypes.c_long * 16)()  # struct statfs: f_type first
    if _libc.fstatfs(layer, buf) != 0 or buf[0] != _TMPFS_MAGIC:
        raise FreezeRefused("its layer fd is not on a tmpfs")


def check_layer(layer: int, pid: int) -> tuple[bool, int]:
    """``layer`` (a tmpfs directory) must be mounted nowhere in the source's namespace
    (detached: its private layer). Returns, from the same read of that namespace's
    mount table: whether the index of slots is mounted there, and how many of its slots
    hold a layer (from 0 on: the depth)."""
    with open(f"/proc/{pid}/mountinfo", "rb") as f:
        table = b"\n" + f.read()  # one read, searched as bytes: ~50 us, not ~0.5 ms of lines
    if b"\n%d " % _mount_id(layer) in table:
        raise FreezeRefused("its layer fd is on a mounted file system, not its layer")
    points = _mount_points_under(table, LAYERS_DIR.encode())
    depth = 0
    while depth < MAX_LAYERS and f"{LAYERS_DIR}/{depth}".encode() in points:
        depth += 1
    return LAYERS_DIR.encode() in points, depth


def _mount_points_under(table: bytes, top: bytes) -> set[bytes]:
    """The mount points (mountinfo's fifth field) at ``top`` or below it, from the
    lines that name it (a few: the search is a bytes scan, not a parse of every line)."""
    points = set()
    start = table.find(b" " + top)
    while start >= 0:
        line_start = table.rfind(b"\n", 0, start) + 1
        line_end = table.find(b"\n", start)
        fields = table[line_start : line_end if line_end >= 0 else None].split(b" ")
        if len(fields) > 4 and (fields[4] == top or fields[4].startswith(top + b"/")):
            points.add(fields[4])
        start = table.find(b" " + top, line_end) if line_end >= 0 else -1
    return points


def shares_a_tmp_file(pid: int) -> bool:
    """Whether the source maps a /tmp file MAP_SHARED (its writes through the mapping
    would keep changing the frozen file under its clones)."""
    return any(name.startswith("/tmp/") for _writable, name in procmaps.shared_vmas(pid))


def keeps_a_tmp_endpoint(pid: int) -> str:
    """What of the source's would stop working across the new /tmp: a unix socket of
    its bound at a /tmp path (another overlay's inode is another socket: its clients
    would be refused) or a fifo, socket or device it holds open there (a fifo's pipe is
    the inode of the overlay it was opened through). "" if none. Sockets other sandboxes
    of its network namespace bound (at paths of their own /tmp) are not its concern."""
    sockets = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            path = os.readlink(f"/proc/{pid}/fd/{name}")
            if path.startswith("socket:["):
                sockets.add(path[8:-1])
                continue
            if not path.startswith("/tmp/"):
                continue
            mode = os.stat(f"/proc/{pid}/fd/{name}").st_mode
        except OSError:
            continue  # closed meanwhile
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"it holds {path[:200]} open, which is not a file or directory"
        if path.endswith(" (deleted)"):  # an O_TMPFILE or unlinked file: no path to reopen
            return f"it holds a deleted file open ({path[:200]})"
        if _locked(pid, name):
            return f"it holds a lock on {path[:200]} (its reopened file would not have it)"
    if sockets:
        with open(f"/proc/{pid}/net/unix") as f:
            for line in f:
                fields = line.split()  # Num RefCount Protocol Flags Type St Inode Path
                if len(fields) >= 8 and fields[6] in sockets and fields[7].startswith("/tmp/"):
                    return f"a unix socket is bound at {fields[7][:200]}"
    return ""


def _locked(pid: int, fd: str) -> bool:
    """Whether the source holds a lock (flock, OFD or POSIX) on the file of its ``fd``:
    a lock belongs to the open file (or the process's fds of it), and the source's files
    are reopened on its new layer, which would drop it."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            return b"\nlock:" in f.read(65536)
    except OSError:
        return False  # closed meanwhile


def works_in_a_deleted_tmp_directory(pid: int) -> str:
    """A thread of the source whose working directory is a /tmp directory deleted since
    (a TemporaryDirectory it is still in): the deleted inode keeps the frozen layer's
    file system from being made read-only, and no path leads back to it. "" if none."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return ""
    for task in tasks:
        try:
            cwd = os.readlink(f"/proc/{pid}/task/{task}/cwd")
        except OSError:
            continue  # gone meanwhile
        if cwd.startswith("/tmp/") and cwd.endswith(" (deleted)"):
            return f"a thread of it works in a deleted directory ({cwd[:200]})"
    return ""


# What a check found out for the freeze that follows (its slowest reads, ~0.4-0.8 ms,
# done while the controller prepares the fork), by the identity of the source's layer:
# (pid, device, inode) -> (the index is mounted there, the depth, why the source cannot
# be frozen or "", when). A freeze takes it if it is at most FOUND_FRESH_S old: the
# depth changes only by a freeze of this helper's (a slot found taken after all refuses
# the freeze), and what the source holds is as racy at the freeze (its threads run on):
# the seal, which no file open for writing lets through, is what keeps a layer frozen.
FOUND_FRESH_S = 1.0
_found_ahead: dict[tuple[int, int, int], tuple[bool, int, str, float]] = {}
found_taken = 0  # freezes that took what their check found (reported with their answers)


def find_out_ahead(layer: int, pidfd: int) -> None:
    """Run by a check that found writes to freeze: what its freeze will need to know."""
    now = time.monotonic()
    for key in [k for k, v in _found_ahead.items() if now - v[3] > FOUND_FRESH_S]:
        del _found_ahead[key]
    try:
        pid = pid_of(pidfd)
        indexed, depth = check_layer(layer, pid)
        refusal = why_not_frozen(pid)
    except (OSError, FreezeRefused):
        return  # the freeze looks again, and says why
    info = os.fstat(layer)
    _found_ahead[(pid, info.st_dev, info.st_ino)] = (indexed, depth, refusal, now)


def found(layer: int, pid: int) -> tuple[bool, int, str]:
    """For ``layer`` of ``pid``: check_layer's answer and :func:`why_not_frozen`'s,
    as its check found them, or now."""
    global found_taken
    info = os.fstat(layer)
    ahead = _found_ahead.pop((pid, info.st_dev, info.st_ino), None)
    if ahead is not None and time.monotonic() - ahead[3] <= FOUND_FRESH_S:
        found_taken += 1
        return ahead[0], ahead[1], ahead[2]
    indexed, depth = check_layer(layer, pid)
    return indexed, depth, why_not_frozen(pid)


def why_not_frozen(pid: int) -> str:
    """What the source holds that a new /tmp would break, or keep from being sealed."""
    if shares_a_tmp_file(pid):
        return "it maps a /tmp file shared (MAP_SHARED)"
    return keeps_a_tmp_endpoint(pid) or works_in_a_deleted_tmp_directory(pid)

"""A fork that copies nothing of /tmp: the source's writes frozen into a shared layer.

A sandbox's private /tmp is an overlay: the tree's /tmp below, the sandbox's own writes
in an upper layer (a tmpfs of its own). A clone used to start from a copy of its source's
upper layer, a cost in proportion to the workspace (200 MB in 10,000 files: ~0.3 s). Now,
right before a FORK, the *layer helper* (gym_fork/system/layer_helper.py, a root process
of the controller's) freezes the source's writes:

1. in the source's mount namespace, it moves (renames: no data copied) every entry of the
   source's upper layer into a new directory of the same tmpfs, and binds that directory
   read-only at ``/dev/.gym_fork-layers/<depth>`` (an index of empty, read-only slots it
   mounts there the first time);
2. it covers /tmp with a new overlay: that layer, the source's earlier frozen layers and
   the tree's /tmp below, an empty tmpfs of its own above (handed to the source with the
   FORK: it keeps it as its upper layer);
3. the source reopens its files under /tmp and re-enters its working directory
   (sandbox_isolation.adopt_frozen_layer), then forks its clones. A clone copies the
   source's mount namespace, slots included, and mounts its own /tmp over the same layers
   (:func:`layer_paths`) with an empty upper: nothing is copied, whatever the size.

Why from outside: a confined source has no capability left (and is usually threaded: no
new user namespace for it), so it cannot mount; the layers must be *attached* where a
clone's namespace copy finds them (overlay takes no detached layer from a less privileged
namespace), hence the slots. Why renames, not the upper directory itself as the layer:
the source's old overlay stays mounted (under the new one, and in every earlier clone's
namespace copy), and overlayfs warns on every mount whose lower is another's upper.

Invariants the helper keeps (nothing the source says is trusted): the layer it freezes is
a detached tmpfs the source holds an fd of, and the upper layer of the /tmp the source has
(a file the helper makes in that /tmp must appear in it: not a dup of its own source's
layer, nor a tmpfs a sandbox made in a user namespace of its own); every path it touches
is under that tmpfs through fds, the tree's view (no symlink), or a slot of the index it
mounted itself (read-only to the sandbox); the frozen layer's file system is made
read-only (sealed) before any clone runs: at once, within the freeze, where no file of it
is open for writing (new opens go through the new /tmp already), else once the source has
reopened its files; a source whose layer cannot be sealed then (a file of it still open
for writing past /tmp's overlay) is not forked (gym_fork/hosts/process/layers.py); the
helper never freezes a
sandbox that maps a /tmp file shared (the mapping would keep writing the frozen layer),
has a unix socket bound or a fifo open under /tmp (a new overlay is a new inode for them:
its own clients would lose it), or is MAX_LAYERS deep (the clone then copies what was
written since, as before); any failure before the new /tmp is mounted leaves the source
as it was. A fifo or socket file in a frozen layer is no channel between branches: each
overlay has an inode (a pipe, a socket) of its own for it.

Stdlib only, and ``namespaces`` imported without the package where run as the helper's
script (it starts with ``python -S``: ~20 ms, once per host).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat

try:
    from gym_fork.system import namespaces as ns
    from gym_fork.system import procmaps
except ImportError:  # run by layer_helper.py as a script: the package is not imported
    import namespaces as ns  # type: ignore[import-not-found,no-redef]
    import procmaps  # type: ignore[import-not-found,no-redef]

LAYERS_DIR = (
    "/dev/.gym_fork-layers"  # made by the tree's /dev (host_view.minimal_dev, which names it too)
)
# Each layer is a mount in the source's namespace and in every namespace copied from it,
# and a lower of each /tmp mounted since; 32 keeps /tmp's mount options well under a page.
MAX_LAYERS = 32
# Entries at the top of the upper layer, renamed one by one while the source waits: past
# this, the clones copy instead (a freeze stays well inside the helper's deadline).
MAX_TOP_ENTRIES = 20_000
_TMPFS_MAGIC = 0x01021994
_PIDFD_GET_INFO, _PIDFD_INFO_PID = 0xC040FF0B, 1  # _IOWR(0xFF, 11, struct pidfd_info)
_SYS_PIDFD_GETFD, _SYS_FSPICK, _SYS_FSCONFIG = 438, 433, 431
_FSPICK_CLOEXEC, _FSPICK_EMPTY_PATH = 0x1, 0x8
_FSCONFIG_SET_FLAG, _FSCONFIG_CMD_RECONFIGURE = 0, 7
_libc = ctypes.CDLL(None, use_errno=True)


class FreezeRefused(Exception):
    """The source's /tmp is not frozen (why); its clones copy its writes as before."""


def layer_paths() -> list[str]:
    """In a sandbox: its frozen layers' paths, the most recent first (the slots mounted
    in its namespace, from 0 on). ~2 us where none is."""
    paths = []
    for depth in range(MAX_LAYERS):
        slot = f"{LAYERS_DIR}/{depth}"
        if not os.path.ismount(slot):
            break
        paths.append(slot)
    return paths[::-1]


def kernel_supports_layers(release: str | None = None) -> bool:
    """tmpfs keeps user.* xattrs from Linux 6.6: the overlays of every layer then mark
    opaque directories alike (``userxattr``, what a clone's user namespace allows)."""
    found = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (6, 6)


def _setns(fd: int, kind: int) -> None:
    if _libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _their_fd(pidfd: int, number: int) -> int:
    fd = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, number, 0)
    if fd < 0:
        err = ctypes.get_errno()
        raise FreezeRefused(f"its layer fd {number} could not be taken ({os.strerror(err)})")
    return fd


def _pid_of(pidfd: int) -> int:
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


def _check_is_tmpfs_directory(layer: int) -> None:
    if not stat.S_ISDIR(os.fstat(layer).st_mode):
        raise FreezeRefused("its layer fd is not a directory")
    buf = (ctypes.c_long * 16)()  # struct statfs: f_type first
    if _libc.fstatfs(layer, buf) != 0 or buf[0] != _TMPFS_MAGIC:
        raise FreezeRefused("its layer fd is not on a tmpfs")


def _check_layer(layer: int, pid: int) -> tuple[bool, int]:
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


def _shares_a_tmp_file(pid: int) -> bool:
    """Whether the source maps a /tmp file MAP_SHARED (its writes through the mapping
    would keep changing the frozen file under its clones)."""
    return any(name.startswith("/tmp/") for _writable, name in procmaps.shared_vmas(pid))


def _keeps_a_tmp_endpoint(pid: int) -> str:
    """What of the source's would stop working across the new /tmp: a unix socket
    bound at a /tmp path (another overlay's inode is another socket: its clients would
    be refused) or a fifo, socket or device it holds open there (a fifo's pipe is the
    inode of the overlay it was opened through). "" if none."""
    with open(f"/proc/{pid}/net/unix") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7].startswith("/tmp/"):
                return f"a unix socket is bound at {fields[7][:200]}"
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            path = os.readlink(f"/proc/{pid}/fd/{name}")
            if not path.startswith("/tmp/"):
                continue
            mode = os.stat(f"/proc/{pid}/fd/{name}").st_mode
        except OSError:
            continue  # closed meanwhile
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"it holds {path[:200]} open, which is not a file or directory"
        if path.endswith(" (deleted)"):  # an O_TMPFILE or unlinked file: no path to reopen
            return f"it holds a deleted file open ({path[:200]})"
    return ""


def _check_is_its_tmp(upper: int, owner: os.stat_result) -> None:
    """In the source's mount namespace: the layer it named must be the upper layer of the
    /tmp it has (not a dup of its source's, or of a tmpfs of its own): a file made in /tmp
    must appear in that layer's ``upper``."""
    probe = f".gym_fork-probe-{os.urandom(6).hex()}"
    tmp = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with _as_owner(owner):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(probe, flags, 0o600, dir_fd=tmp))
            try:
                os.stat(probe, dir_fd=upper, follow_symlinks=False)
            except FileNotFoundError:
                raise FreezeRefused("its layer fd is not the upper layer of its /tmp") from None
            finally:
                os.unlink(probe, dir_fd=tmp)
    finally:
        os.close(tmp)


def _make_index(size_bytes: int = 1 << 20) -> int:
    """A detached, read-only tmpfs of MAX_LAYERS empty slots: mounted at LAYERS_DIR
    once per lineage (its clones' namespaces are copies)."""
    index = ns.new_tmpfs(size_bytes)
    try:
        for depth in range(MAX_LAYERS):
            os.mkdir(str(depth), 0o555, dir_fd=index)
        os.chmod(".", 0o555, dir_fd=index)
        ns.set_mount_attributes(index, recursive=True, set_=ns.MOUNT_ATTR_RDONLY)
    except BaseException:
        os.close(index)
        raise
    return index


def _make_upper(size_bytes: int) -> int:
    upper = ns.new_tmpfs(size_bytes)
    try:
        os.mkdir("upper", 0o1777, dir_fd=upper)
        os.mkdir("work", 0o700, dir_fd=upper)
        os.chmod("upper", 0o1777, dir_fd=upper)  # /tmp's mode, whatever the umask
    except BaseException:
        os.close(upper)
        raise
    return upper


_spares: dict[object, int] = {}  # ("upper", size) or "index" -> a detached tmpfs's fd


def make_spares(size_bytes: int) -> None:
    """Make, while no source waits, the new tmpfs the next freeze needs (an upper layer
    of ``size_bytes``, an index of slots): ~0.2 ms less for the source to wait."""
    if ("upper", size_bytes) not in _spares:
        _spares[("upper", size_bytes)] = _make_upper(size_bytes)
    if "index" not in _spares:
        _spares["index"] = _make_index()


def _new_upper(size_bytes: int) -> int:
    spare = _spares.pop(("upper", size_bytes), -1)
    return spare if spare >= 0 else _make_upper(size_bytes)


def _new_index() -> int:
    spare = _spares.pop("index", -1)
    return spare if spare >= 0 else _make_index()


@contextlib.contextmanager
def _as_owner(owner: os.stat_result):
    """File operations as the uid and gid that own ``owner`` (the layer's upper
    directory): a layer made in a user namespace takes no inode change from an owner
    it does not map (the host's root: EOVERFLOW)."""
    uid, gid = _libc.setfsuid(owner.st_uid), _libc.setfsgid(owner.st_gid)
    try:
        yield
    finally:
        _libc.setfsgid(gid)
        _libc.setfsuid(uid)


def _move_entries(names: list[str], src: int, dst: int) -> list[str]:
    moved = []
    for name in names:
        os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
        moved.append(name)
    return moved


def freeze(
    pidfd: int, layer_number: int, size_bytes: int, base: str
) -> tuple[int, int, int | None]:
    """Run by the layer helper (root, single-threaded): freeze the writes of the sandbox
    ``pidfd`` (its private layer is its fd ``layer_number``) into a read-only layer,
    cover its /tmp with a new overlay over that layer, its earlier ones and ``base``
    (the tree's /tmp view), with a new empty upper of at most ``size_bytes``. Returns
    (an fd of that new layer's tmpfs, for the source to keep; the depth now; an fd of the
    frozen layer's tmpfs, to :func:`seal` once the source has reopened its files, or None
    where it is sealed already: no file of it was open for writing, the usual case, which
    spares the source a round trip). Raises FreezeRefused, leaving the source as it was
    (nothing to freeze included).

    Everything under /proc is read before entering the source's namespace (its /proc
    is its tree's pid namespace's, where this process has no /proc/self)."""
    pid = _pid_of(pidfd)
    layer = _their_fd(pidfd, layer_number)
    opened: list[int] = [layer]
    own_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    opened.append(own_ns)
    entered = False
    frozen_name = ""
    owner = os.stat_result((0,) * 10)
    try:
        _check_is_tmpfs_directory(layer)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        upper = os.open("upper", flags, dir_fd=layer)
        opened.append(upper)
        names = os.listdir(upper)
        if not names:  # a fork that wrote nothing since the last: ~0.1 ms, no /proc read
            raise FreezeRefused("nothing to freeze")
        if len(names) > MAX_TOP_ENTRIES:
            raise FreezeRefused(
                f"{len(names)} entries at the top of its /tmp (a freeze renames each)"
            )
        indexed, depth = _check_layer(layer, pid)
        if depth >= MAX_LAYERS:
            raise FreezeRefused(f"{MAX_LAYERS} layers deep already")
        if _shares_a_tmp_file(pid):
            raise FreezeRefused("it maps a /tmp file shared (MAP_SHARED)")
        endpoint = _keeps_a_tmp_endpoint(pid)
        if endpoint:
            raise FreezeRefused(endpoint)
        owner = os.fstat(upper)
        frozen_name = f"frozen-{os.urandom(6).hex()}"  # in the layer's root: not in /tmp
        with _as_owner(owner):
            os.mkdir(frozen_name, 0o755, dir_fd=layer)
        frozen = os.open(frozen_name, flags, dir_fd=layer)
        opened.append(frozen)
        os.chmod(frozen, stat.S_IMODE(os.fstat(upper).st_mode))
        bind = ns.clone_mount_of(frozen)
        opened.append(bind)
        ns.set_mount_attributes(bind, recursive=True, set_=ns.MOUNT_ATTR_RDONLY)
        new = _new_upper(size_bytes)
        opened.append(new)
        if not indexed:
            opened.append(_new_index())
        _setns(pidfd, ns.CLONE_NEWNS)
        entered = True
        os.chdir("/")
        if os.path.islink(base) or not os.path.ismount(base):
            raise FreezeRefused(f"{base} is not the tree's /tmp view in its namespace")
        _check_is_its_tmp(upper, owner)
        if not indexed:
            if not os.path.isdir(LAYERS_DIR) or os.path.islink(LAYERS_DIR):
                raise FreezeRefused(f"the tree's /dev has no {LAYERS_DIR}")
            ns.attach_mount(opened.pop(), LAYERS_DIR)
        slot = f"{LAYERS_DIR}/{depth}"
        if os.path.ismount(slot):  # the table read before entering said it was free
            raise FreezeRefused(f"{slot} is taken in its namespace")
        opened.remove(bind)
        ns.attach_mount(bind, slot)
        try:
            earlier = [f"{LAYERS_DIR}/{d}" for d in range(depth - 1, -1, -1)]
            lower = ":".join([slot, *earlier, base])
            with _as_owner(owner):
                moved = _move_entries(names, upper, frozen)
            try:
                os.fchdir(new)  # upper and work: relative to the new layer's root
                options = f"lowerdir={lower},upperdir=upper,workdir=work,userxattr"
                ns.mount("overlay", "/tmp", "overlay", ns.MS_NOSUID | ns.MS_NODEV, options)
            except BaseException:
                with _as_owner(owner):
                    _move_entries(moved, frozen, upper)
                raise
            with _as_owner(owner):  # made by a thread of the source's meanwhile
                for _ in range(3):
                    if not _move_entries(os.listdir(upper), upper, frozen):
                        break
        except BaseException:
            with contextlib.suppress(OSError):
                ns.detach_mount(slot)  # empty again
            raise
        frozen_name = ""
        opened.remove(new)
        try:
            seal(layer)  # new opens go through the new /tmp: only old writers can block it
        except FreezeRefused:  # a file open for writing: sealed once the source reopened it
            opened.remove(layer)
            return new, depth + 1, layer
        return new, depth + 1, None
    finally:
        if frozen_name:  # not frozen: its empty directory goes
            with contextlib.suppress(OSError), _as_owner(owner):
                os.rmdir(frozen_name, dir_fd=layer)
        if entered:
            _setns(own_ns, ns.CLONE_NEWNS)
        for fd in opened:
            os.close(fd)


def seal(layer: int) -> None:
    """Make the frozen layer's file system read-only (``layer``: an fd of it, from
    :func:`freeze`), once the source has reopened its /tmp files on its new layer: from
    then on no fd of anyone's writes it (one kept past the overlay, received through a
    socket, or a writable shared mapping would, and makes this refuse: EBUSY). Raises
    FreezeRefused saying why."""
    picked = _libc.syscall(_SYS_FSPICK, layer, b"", _FSPICK_CLOEXEC | _FSPICK_EMPTY_PATH)
    if picked < 0:
        raise FreezeRefused(f"its layer cannot be reconfigured ({os.strerror(ctypes.get_errno())})")
    try:
        if _libc.syscall(_SYS_FSCONFIG, picked, _FSCONFIG_SET_FLAG, b"ro", None, 0) != 0:
            raise FreezeRefused(f"ro: {os.strerror(ctypes.get_errno())}")
        if _libc.syscall(_SYS_FSCONFIG, picked, _FSCONFIG_CMD_RECONFIGURE, None, None, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EBUSY:
                raise FreezeRefused(
                    "a file of its frozen /tmp layer is still open for writing outside /tmp's "
                    "overlay (an fd kept through its layer, or in flight on a socket), or "
                    "mapped writable and shared"
                )
            raise FreezeRefused(f"its layer cannot be made read-only ({os.strerror(err)})")
    finally:
        os.close(picked)

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
   (sandbox_isolation.adopt_frozen_layer). It forked its clones while the helper froze
   (gym_fork/hosts/process/sandbox.py: the freeze is off a fork's critical path), and
   tells them as soon as the helper's answer comes (before it adopts: its fds are not
   theirs; where they fit on the cores), or once it has adopted its layer; each waits
   for that word before its namespaces. The freeze begins
   once the source has said its env code is held off (ForkQuiet: its signals wait, its
   collector is off, until it has its new layer). A clone copies the
   source's mount namespace, slots included, and mounts its own /tmp over the same layers
   (:func:`layer_paths`) with an empty upper: nothing is copied, whatever the size. (A
   source with threads takes its layer before it forks: a thread's write between the
   new /tmp's mount and the fork would be in no layer its clones hold; so does one
   holding a /tmp file open for writing: its clones would hold the seal back.)

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
read-only (sealed) before any clone's set-up (its namespaces; env code of its at-fork
hooks may run before, as in any fork): at once, within the freeze, where no file of it
is open for writing (new opens go through the new /tmp already), else once the source has
reopened its files; a source whose layer cannot be sealed then (a file of it still open
for writing past /tmp's overlay) is not forked (gym_fork/hosts/process/layers.py); the
helper never freezes a
sandbox that maps a /tmp file shared (the mapping would keep writing the frozen layer),
has a unix socket bound or a fifo open under /tmp (a new overlay is a new inode for them:
its own clients would lose it), holds a deleted /tmp file open or works in a deleted /tmp
directory (the layer could not be sealed: gym_fork/system/layer_checks.py has every check
of the source), or is MAX_LAYERS deep (the clone then copies what was
written since, as before); any failure before the new /tmp is mounted leaves the source
as it was. A fifo or socket file in a frozen layer is no channel between branches: each
overlay has an inode (a pipe, a socket) of its own for it.

Stdlib only, and ``namespaces`` and ``layer_checks`` imported without the package where
run as the helper's script (``python -S``, where no zygote forks the helper).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import time

try:
    from gym_fork.system import layer_checks as checks
    from gym_fork.system import namespaces as ns
except ImportError:  # run by layer_helper.py as a script: the package is not imported
    import layer_checks as checks  # type: ignore[import-not-found,no-redef]
    import namespaces as ns  # type: ignore[import-not-found,no-redef]

LAYERS_DIR, MAX_LAYERS = checks.LAYERS_DIR, checks.MAX_LAYERS
FreezeRefused = checks.FreezeRefused

# Entries at the top of the upper layer, renamed one by one while the source waits: past
# this, the clones copy instead (a freeze stays well inside the helper's deadline).
MAX_TOP_ENTRIES = 20_000
_SYS_FSPICK, _SYS_FSCONFIG = 433, 431
_FSPICK_CLOEXEC, _FSPICK_EMPTY_PATH = 0x1, 0x8
_FSCONFIG_SET_FLAG, _FSCONFIG_CMD_RECONFIGURE = 0, 7
_libc = ctypes.CDLL(None, use_errno=True)


def kernel_supports_layers(release: str | None = None) -> bool:
    """tmpfs keeps user.* xattrs from Linux 6.6: the overlays of every layer then mark
    opaque directories alike (``userxattr``, what a clone's user namespace allows).
    Asked at every sandbox's birth: no regex (compiling one there cost ~0.4 ms)."""
    numbers = []
    for part in (release or os.uname().release).split(".")[:2]:
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            return False
        numbers.append(int(digits))
    return len(numbers) == 2 and (numbers[0], numbers[1]) >= (6, 6)


def _setns(fd: int, kind: int) -> None:
    if _libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


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
    """Rename ``names`` from ``src`` into ``dst``; returns those moved. One gone
    meanwhile (a thread of the source's removed or renamed it) is skipped; on any other
    failure what was moved goes back, and the error is raised."""
    moved: list[str] = []
    try:
        for name in names:
            try:
                os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
            except FileNotFoundError:
                continue
            moved.append(name)
    except BaseException:
        _move_back(moved, dst, src)
        raise
    return moved


def _move_back(names: list[str], src: int, dst: int) -> None:
    """Best effort: each of ``names`` back from ``src`` into ``dst``, unless ``dst`` has
    that name again (a thread of the source's made it since: the newer one stays)."""
    for name in names:
        with contextlib.suppress(OSError):
            os.stat(name, dir_fd=dst, follow_symlinks=False)
            continue
        with contextlib.suppress(OSError):
            os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)


def _move_late_entries(src: int, dst: int) -> None:
    """Once the new /tmp is mounted: entries a thread of the source's made in the old
    layer meanwhile (through its working directory or a directory fd), moved where the
    new /tmp shows them; best effort, never raising (the new /tmp is the source's now)."""
    for _ in range(3):
        try:
            names = os.listdir(src)
        except OSError:
            return
        moved = 0
        for name in names:
            try:  # a file replaces a frozen one of its name: the newer write wins
                os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
                moved += 1
            except OSError:  # gone meanwhile, or a directory onto a non-empty one
                continue
        if not moved:
            return


def wrote_since(pidfd: int, layer_number: int) -> bool:
    """Run by the layer helper: has the sandbox ``pidfd`` anything in its private layer
    (its fd ``layer_number``) to freeze? Read-only (the controller asks it ahead of a
    fork, and may never use the answer); True where it cannot tell (the freeze decides)."""
    try:
        layer = checks.their_fd(pidfd, layer_number)
    except FreezeRefused:
        return True
    try:
        checks.check_is_tmpfs_directory(layer)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        upper = os.open("upper", flags, dir_fd=layer)
        try:
            with os.scandir(upper) as entries:
                wrote = next(entries, None) is not None
        finally:
            os.close(upper)
        if wrote:
            checks.find_out_ahead(layer, pidfd)
        return wrote
    except (OSError, FreezeRefused):
        return True
    finally:
        os.close(layer)


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
    pid = checks.pid_of(pidfd)
    layer = checks.their_fd(pidfd, layer_number)
    opened: list[int] = [layer]
    own_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    opened.append(own_ns)
    entered = False
    frozen_name = ""
    owner = os.stat_result((0,) * 10)
    try:
        checks.check_is_tmpfs_directory(layer)
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
        indexed, depth, refusal = checks.found(layer, pid)
        if depth >= MAX_LAYERS:
            raise FreezeRefused(f"{MAX_LAYERS} layers deep already")
        if refusal:
            raise FreezeRefused(refusal)
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
        for name in ("upper", "work"):  # the source's, as its first layer: so a later
            # freeze's renames and probe run as it, not as the host's root
            os.chown(name, owner.st_uid, owner.st_gid, dir_fd=new, follow_symlinks=False)
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
                    _move_back(moved, frozen, upper)
                raise
        except BaseException:
            with contextlib.suppress(OSError):
                ns.detach_mount(slot)  # empty again
            raise
        frozen_name = ""
        opened.remove(new)
        with _as_owner(owner):  # made by a thread of the source's meanwhile
            _move_late_entries(upper, frozen)
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


class LayerBusy(FreezeRefused):
    """The frozen layer's file system has a writer (or a deleted inode in use) now."""


def seal(layer: int, patience_s: float = 0.0) -> None:
    """Make the frozen layer's file system read-only (``layer``: an fd of it, from
    :func:`freeze`), once the source has reopened its /tmp files on its new layer: from
    then on no fd of anyone's writes it (one kept past the overlay, received through a
    socket, or a writable shared mapping would, and makes this refuse: EBUSY). Busy, it
    tries again each millisecond for ``patience_s`` (a thread of the source's closing a
    file it had open before the freeze). Raises FreezeRefused saying why."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            _seal_once(layer)
            return
        except LayerBusy:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.001)


def _seal_once(layer: int) -> None:
    picked = _libc.syscall(_SYS_FSPICK, layer, b"", _FSPICK_CLOEXEC | _FSPICK_EMPTY_PATH)
    if picked < 0:
        raise FreezeRefused(f"its layer cannot be reconfigured ({os.strerror(ctypes.get_errno())})")
    try:
        if _libc.syscall(_SYS_FSCONFIG, picked, _FSCONFIG_SET_FLAG, b"ro", None, 0) != 0:
            raise FreezeRefused(f"ro: {os.strerror(ctypes.get_errno())}")
        if _libc.syscall(_SYS_FSCONFIG, picked, _FSCONFIG_CMD_RECONFIGURE, None, None, 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EBUSY:
                raise LayerBusy(
                    "a file of its frozen /tmp layer is still open for writing outside /tmp's "
                    "overlay (an fd kept through its layer, or in flight on a socket), "
                    "mapped writable and shared, or deleted and still in use (mapped, or a "
                    "working directory)"
                )
            raise FreezeRefused(f"its layer cannot be made read-only ({os.strerror(err)})")
    finally:
        os.close(picked)

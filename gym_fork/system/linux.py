"""Small Linux process primitives used by the hosts (prctl, pidfd, exit status)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(None, use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def prctl(option: int, value: int) -> None:
    """Call prctl(2); raise OSError on failure."""
    if _prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Get ``sig`` when the parent dies; exit now if it already has."""
    prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != expected_parent:
        os._exit(70)


def wait_readable(fd: int, timeout: float | None) -> bool:
    """True once ``fd`` is readable (or hung up) within ``timeout`` seconds (None:
    forever). poll, not select: select cannot watch an fd number above 1023."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))))


def readable(fds: list[int], timeout: float) -> list[int]:
    """Those of ``fds`` readable (or hung up) within ``timeout`` seconds (poll: any fd
    number)."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [fd for fd, _ in poller.poll(max(0, math.ceil(timeout * 1000)))]


# The pid of a watch of a process reaped before we got a pidfd of it: none. Nothing
# signals by a watch's pid (only by its pidfd), and /proc/-1 never exists.
NO_PID = -1


class ProcessWatch:
    """Liveness of a process that is not our child, through a pidfd."""

    def __init__(self, pid: int, fd: int | None = None) -> None:
        self.pid = pid
        if fd is not None:
            self.fd = fd  # a pidfd received from the process's parent: ours to close
            return
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.fd = -1

    def alive(self) -> bool:
        if self.fd < 0:
            return False
        return not wait_readable(self.fd, 0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):  # gone; or not a pidfd (a peer's forgery)
                signal.pidfd_send_signal(self.fd, sig)

    def wait_dead(self, timeout: float) -> bool:
        """True once the process has exited (within ``timeout`` seconds)."""
        if self.fd < 0:
            return True
        return wait_readable(self.fd, timeout)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def pidfd_pids(fd: int) -> list[int]:
    """The pids of a pidfd's process, from this process's pid namespace down to the
    process's own (``NSpid``); [] when ``fd`` is not a pidfd, [-1] once it is reaped.

    A pidfd received from another pid namespace tells us its pid in ours."""
    try:
        if "pidfd" not in os.readlink(f"/proc/self/fd/{fd}"):
            return []
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(p) for p in line.split()[1:]]
                if line.startswith("Pid:") and int(line.split()[1]) < 0:
                    return [-1]
    except (OSError, ValueError):
        return []
    return []


def describe_status(status: int | None) -> str:
    """Human text for a waitpid status or a subprocess-style exit code."""
    if status is None:
        return "exit status unknown"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with code {status}"


def raise_fd_limit(target: int = 65536) -> None:
    """Raise this process's soft RLIMIT_NOFILE towards its hard limit: each sandbox
    costs the controller a few fds (side socket, pidfd, output pipes)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(target, hard) if hard != resource.RLIM_INFINITY else target
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


_TIOCNOTTY = 0x5422


def drop_controlling_terminal() -> None:
    """Give up this process's controlling terminal (TIOCNOTTY) without leaving its
    session; its children are born without one. Nothing to do without a terminal."""
    import fcntl

    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return  # no controlling terminal
    try:
        fcntl.ioctl(fd, _TIOCNOTTY)
    except OSError as exc:
        raise OSError(exc.errno, f"giving up the controlling terminal: {exc.strerror}") from exc
    finally:
        os.close(fd)


def data_extents(fd: int, size: int | None = None) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each data extent of ``fd`` below ``size`` (default: its size
    now), holes skipped (SEEK_DATA/SEEK_HOLE)."""
    size = os.fstat(fd).st_size if size is None else size
    position = 0
    while position < size:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return  # only a hole is left
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        position = end


# -- fork() with the child born a sibling (CLONE_PARENT) ---------------------------------

CLONE_PIDFD = 0x00001000
CLONE_PARENT = 0x00008000
CLONE_CHILD_SETTID = 0x01000000
# Per machine: the numbers of clone, set_robust_list and get_robust_list, and where
# clone's child_tid argument goes (after tls on arm64).
_SYSCALLS = {"x86_64": (56, 273, 274, 3), "aarch64": (220, 99, 100, 4)}
_SIGSET_BYTES = 128  # glibc's sigset_t
_WALL = 0x40000000  # wait(2)'s __WALL
# Offset of the thread's tid in glibc's struct pthread (x86_64), used only where it
# holds our tid (checked): the child's copy is set by the kernel, as glibc's fork does.
_GLIBC_TID_OFFSET = 0x2D0


_libc_sigmask = ctypes.CDLL(None, use_errno=True).pthread_sigmask
_ALL_SIGNALS = (ctypes.c_ubyte * _SIGSET_BYTES)(*([0xFF] * _SIGSET_BYTES))


def block_signals() -> Any:
    """Block every maskable signal in the calling thread; returns the mask it had, for
    :func:`restore_signals`. Meanwhile no Python signal handler runs (a signal that
    comes waits, pending), and a process forked meanwhile is born with them blocked
    (it restores the mask itself). On sigset_t buffers: no Python set is made."""
    saved = (ctypes.c_ubyte * _SIGSET_BYTES)()
    if _libc_sigmask(signal.SIG_BLOCK, _ALL_SIGNALS, saved) != 0:
        raise OSError(errno.EINVAL, "block_signals: the signal mask could not be set")
    return saved


def restore_signals(saved: Any) -> None:
    """Put back the mask :func:`block_signals` returned (pending signals come now)."""
    _libc_sigmask(signal.SIG_SETMASK, saved, None)


class _RawClone:
    """clone(2) through libc's syscall(), called with the GIL held (the child is a
    Python process like os.fork()'s), and what the child needs set as glibc sets it."""

    def __init__(self, machine: str) -> None:
        self.clone, self.set_robust, self.get_robust, self.tid_slot = _SYSCALLS[machine]
        libc = ctypes.PyDLL(None, use_errno=True)
        self.syscall = libc.syscall
        self.syscall.restype = ctypes.c_long
        libc.pthread_self.restype = ctypes.c_void_p
        self.pthread_self = libc.pthread_self
        self.machine = machine
        # Looked up here, not in each child (a lookup there allocates, and every page a
        # child writes is a copy-on-write fault of its own).
        api = ctypes.pythonapi  # void functions: their int restype is ignored
        self.before_fork = api.PyOS_BeforeFork
        self.after_fork_child = api.PyOS_AfterFork_Child
        self.after_fork_parent = api.PyOS_AfterFork_Parent
        self.set_robust_number = ctypes.c_long(self.set_robust)
        # pthread_sigmask on sigset_t buffers: the child restores its mask without making
        # a Python set of what it was (signal's and _signal's return one).
        self.sigmask = libc.pthread_sigmask
        self.all_signals = (ctypes.c_ubyte * _SIGSET_BYTES)(*([0xFF] * _SIGSET_BYTES))

    @property
    def tid_at(self) -> int | None:
        """Where glibc keeps the calling thread's tid (asked at each call: the thread
        that forks need not be the one that made this), None if not found."""
        self_ptr = self.pthread_self()
        if self.machine != "x86_64" or not self_ptr:
            return None
        address = self_ptr + _GLIBC_TID_OFFSET
        if ctypes.c_int.from_address(address).value != threading.get_native_id():
            return None
        return address

    def __call__(self) -> tuple[int, int]:
        flags = CLONE_PARENT | CLONE_PIDFD | signal.SIGCHLD
        args = [ctypes.c_ulong(0)] * 4  # stack 0: the child goes on with a copy of ours
        # clone(2) without CLONE_PARENT_SETTID: parent_tid is where the kernel writes
        # the pidfd (in our memory only: the child's copy was made before).
        pidfd = ctypes.c_int(-1)
        args[1] = ctypes.c_ulong(ctypes.addressof(pidfd))
        tid_at = self.tid_at
        if tid_at is not None:
            flags |= CLONE_CHILD_SETTID
            args[self.tid_slot - 1] = ctypes.c_ulong(tid_at)
        # The kernel gives a new process no robust-futex list; glibc's fork registers
        # the thread's again in the child, and so do we (same address in the copy).
        head, size = ctypes.c_void_p(), ctypes.c_size_t()
        robust = self.syscall(
            ctypes.c_long(self.get_robust), 0, ctypes.byref(head), ctypes.byref(size)
        )
        pid = self.syscall(ctypes.c_long(self.clone), ctypes.c_ulong(flags), *args)
        if pid == 0 and robust == 0 and head.value:
            self.syscall(self.set_robust_number, head, size)
        return pid, pidfd.value if pid > 0 else -1


def fork_sibling() -> tuple[int, int]:
    """Like ``os.fork()``, but the child is born a child of our parent (clone(2) with
    CLONE_PARENT), not of us: no intermediate process that forks it and exits so that
    it is orphaned and adopted; and we get a pidfd of it (CLONE_PIDFD), a handle on it
    that no reaping by its parent can make name another process. Python's fork hooks
    run as for ``os.fork()`` (PyOS_BeforeFork, PyOS_AfterFork_Child/Parent:
    ``os.register_at_fork``, the import lock, threading's state); the child's glibc
    thread id and robust-futex list are set as glibc's fork sets them. glibc's own
    pthread_atfork handlers do not run: call it only from a single-threaded process
    (no lock can be held by another thread), and not from a pid namespace's init (the
    kernel refuses it: EINVAL). Returns ``(0, -1)`` in the child, ``(pid, pidfd)`` in
    the parent (the pidfd is the caller's to close); OSError if the kernel refuses
    (nothing was forked)."""
    clone = _raw_clone()
    if clone is None or clone.tid_at is None:
        raise OSError(errno.ENOSYS, "fork_sibling: not on this platform (can_fork_sibling)")
    sys.stdout.flush()
    sys.stderr.flush()
    # os.fork() runs its hooks and the fork in C; here they are Python calls, so signals
    # are held off meanwhile: a handler raising between PyOS_BeforeFork and AfterFork
    # would leave the import lock held (or a clone made and its pid lost).
    # (signal.pthread_sigmask would make a Signals member of each number of the full mask
    # it returns when restoring, ~0.1 ms, twice a fork.)
    mask = (ctypes.c_ubyte * _SIGSET_BYTES)()
    if clone.sigmask(signal.SIG_BLOCK, clone.all_signals, mask) != 0:
        raise OSError(errno.EINVAL, "fork_sibling: the signal mask could not be set")
    pid, pidfd, err = -1, -1, 0
    try:
        clone.before_fork()
        try:
            # After the fork hooks (one may start a thread): no other thread may hold a
            # lock of the C library, whose own fork handlers do not run here.
            if has_threads():
                raise OSError(errno.EBUSY, "fork_sibling: this process has threads")
            pid, pidfd = clone()
            if pid < 0:
                err = ctypes.get_errno()
        finally:
            if pid == 0:
                clone.after_fork_child()
            else:
                clone.after_fork_parent()
    finally:
        clone.sigmask(signal.SIG_SETMASK, mask, None)
    if pid < 0:
        raise OSError(err, f"clone(CLONE_PARENT): {os.strerror(err)}")
    return pid, pidfd


def live_children() -> list[tuple[int, str]]:
    """(pid, command name) of this process's children that have not exited (zombies
    left out), from /proc; empty where /proc cannot tell."""
    try:  # no child at all, the usual case: one call, not a read of every /proc entry
        # __WALL: children whose exit signal is not SIGCHLD (a raw clone) count too.
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT | _WALL)
    except ChildProcessError:
        return []
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read(4096)
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        comm, _, rest = stat.partition(b" (")[2].rpartition(b") ")
        fields = rest.split()
        if len(fields) >= 2 and fields[1] == str(me).encode() and fields[0] != b"Z":
            found.append((int(entry), comm.decode("utf-8", "replace")))
    return sorted(found)


def has_threads() -> bool:
    """True unless this process has one thread only (unknown: threaded, the safe side)."""
    try:
        return len(os.listdir("/proc/self/task")) != 1
    except OSError:
        return True


def can_fork_sibling() -> bool:
    """True where :func:`fork_sibling` makes a child as glibc's fork would: a raw clone
    and glibc's thread id of this thread found (x86_64). Elsewhere the child would keep
    its source's cached tid (glibc's owner checks of recursive and error-checking
    mutexes read it)."""
    clone = _raw_clone()
    return clone is not None and clone.tid_at is not None


_raw_clones: list[_RawClone | None] = []


def _raw_clone() -> _RawClone | None:
    """This process's raw clone, made once; None where there is none (not Linux on
    x86_64 or arm64, no libc)."""
    if not _raw_clones:
        import platform

        clone = None
        if os.uname().sysname == "Linux" and platform.machine() in _SYSCALLS:
            with contextlib.suppress(OSError, AttributeError):
                clone = _RawClone(platform.machine())
        _raw_clones.append(clone)
    return _raw_clones[0]

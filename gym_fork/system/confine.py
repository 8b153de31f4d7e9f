"""Confinement of a sandbox after its set-up: no capabilities, a seccomp filter.

Applied at the end of :func:`gym_fork.system.isolation.enter_sandbox`, once the sandbox
has made its namespaces, mounts and cgroups (which need privileges). Both layers are
inherited by every process the sandbox forks (its clones, an env's helpers) and cannot
be undone from inside: capabilities dropped from the bounding set never come back, and
a seccomp filter cannot be removed.

The filter refuses (EPERM) the system calls that reach beyond the sandbox's own tree:
joining or making namespaces, mounting, tracing or reading other processes, loading
kernel code, keyrings. ``clone`` with a namespace flag is refused too; ``clone3`` passes
its flags in memory a filter cannot read, so it fails with ENOSYS and the C library
falls back to ``clone`` (threads and ``fork`` keep working).
"""

from __future__ import annotations

import ctypes
import errno
import os

from gym_fork.system import linux

# Refused with EPERM, whatever their arguments.
REFUSED_SYSCALLS = (
    "setns",
    "unshare",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "bpf",
    "kexec_load",
    "kexec_file_load",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "perf_event_open",
    "open_by_handle_at",
    "name_to_handle_at",
    "userfaultfd",
    "reboot",
    "swapon",
    "swapoff",
)

CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)

_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_DUMPABLE = 4
_CAP_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(None, use_errno=True)

# What this process (and so every process forked from it) has already given up.
_seccomp_installed = 0
_dropped = False
_prepared: tuple[object, int] | None = None  # built once, in the warm parent


class ConfinementError(OSError):
    """A confinement layer could not be applied (the reason is the message)."""


def capability_sets() -> dict[str, int]:
    """This process's capability sets from /proc/self/status (CapEff, CapBnd, ...)."""
    sets = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cap"):
                name, value = line.split(":", 1)
                sets[name] = int(value, 16)
    return sets


def drop_capabilities() -> None:
    """Empty every capability set: ambient, bounding, effective, permitted, inheritable.

    With an empty bounding set, not even executing a program as root gives any back.
    Raises ConfinementError when a set is not empty afterwards."""
    global _dropped
    _dropped = True  # even a partial drop leaves this process unable to make namespaces
    sets = capability_sets()
    if any(sets.values()):
        linux.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        if sets.get("CapBnd"):
            # Bounding set first: dropping from it needs CAP_SETPCAP, which goes next.
            for cap in range(last + 1):
                if sets["CapBnd"] >> cap & 1:
                    linux.prctl(_PR_CAPBSET_DROP, cap)
        header = _CapHeader(_CAP_VERSION_3, 0)
        data = (_CapData * 2)()
        if _libc.capset(ctypes.byref(header), data) != 0:
            err = ctypes.get_errno()
            raise ConfinementError(err, f"capset: {os.strerror(err)}")
    left = {name: value for name, value in capability_sets().items() if value}
    if left:
        raise ConfinementError(errno.EPERM, f"capabilities left after the drop: {left}")


def forbid_tracing() -> None:
    """Not dumpable: siblings of the same uid cannot open this process's /proc/<pid>/mem
    or attach to it (that would need CAP_SYS_PTRACE, which every sandbox drops)."""
    linux.prctl(_PR_SET_DUMPABLE, 0)


def prepare_seccomp() -> tuple[object, int]:
    """Build the filter (not loaded): call once in the warm parent, so that each sandbox
    forked from it only loads it. Returns (filter, number of system calls refused).

    Raises ConfinementError naming the reason when libseccomp cannot be used."""
    global _prepared
    if _prepared is not None:
        return _prepared
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError, OSError) as exc:
        raise ConfinementError(errno.ENOSYS, f"pyseccomp/libseccomp unavailable: {exc}") from exc
    try:
        arch = seccomp.system_arch()
        refused = 0
        flt = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in REFUSED_SYSCALLS:
            try:
                number = seccomp.resolve_syscall(arch, name)
            except Exception:
                continue
            if number < 0:
                continue  # not a system call on this architecture
            flt.add_rule(seccomp.ERRNO(errno.EPERM), name)
            refused += 1
        for flag in CLONE_NAMESPACE_FLAGS:
            # clone's flags are its first argument on every architecture we run on
            flt.add_rule(
                seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag)
            )
        flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        refused += 2
    except OSError as exc:
        raise ConfinementError(exc.errno or errno.EINVAL, f"seccomp filter: {exc}") from exc
    _prepared = (flt, refused)
    return _prepared


def install_seccomp() -> int:
    """Load the filter into this process (inherited by every process forked from here,
    and never removed); returns how many system calls it refuses. Needs no_new_privs.

    Raises ConfinementError naming the reason when it cannot be loaded."""
    global _seccomp_installed
    if _seccomp_installed:
        return _seccomp_installed  # inherited from the sandbox this one was forked from
    flt, refused = prepare_seccomp()
    try:
        flt.load()
    except OSError as exc:
        raise ConfinementError(exc.errno or errno.EINVAL, f"seccomp filter: {exc}") from exc
    _seccomp_installed = refused
    return refused


def inherited() -> bool:
    """True in a process forked from a confined sandbox (a clone): it is confined already."""
    return _seccomp_installed > 0 or _dropped

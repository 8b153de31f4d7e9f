"""Confinement of a sandbox after its set-up: no capabilities, a seccomp filter.

Applied at the end of :func:`gym_fork.system.birth.be_born`, once the sandbox
has made its namespaces, mounts and cgroups (which need privileges). Both layers are
inherited by every process the sandbox forks (its clones, an env's helpers) and cannot
be undone from inside: capabilities dropped from the bounding set never come back, and
a seccomp filter cannot be removed.

The filter refuses (EPERM) the system calls that reach beyond the sandbox's own tree:
joining namespaces, tracing or reading other processes, loading kernel code, keyrings.
``clone`` with a namespace flag is refused too; ``clone3`` passes its flags in memory a
filter cannot read, so it fails with ENOSYS and the C library falls back to ``clone``
(threads and ``fork`` keep working).

One door is left open on purpose: ``unshare`` with CLONE_NEWUSER (and the mount calls a
new user namespace needs). A clone made by ``fork()`` of a running sandbox uses it to
get mount, IPC and network namespaces of its own (gym_fork/system/sandbox_isolation.py): the
capabilities it has there reach nothing but that namespace, as for any unprivileged
user of the host. That is also why a sandbox keeps CAP_SETFCAP (see
:data:`KEPT_FOR_CLONES`): without it the kernel refuses the clone's user namespace the
mapping of its own uid 0, and a clone could not create a file of its own.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from typing import Any

from gym_fork.system import linux

# Refused with EPERM, whatever their arguments.
REFUSED_SYSCALLS = (
    "setns",
    "umount2",
    "pivot_root",
    "chroot",
    "fspick",
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

CLONE_NEWUSER = 0x10000000
UNSHARE_REFUSED_FLAGS = (
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x20000000,  # CLONE_NEWPID
    0x00000080,  # CLONE_NEWTIME
)
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
# CAP_SETFCAP (31): needed, when a clone makes its user namespace, for mapping uid 0 in
# it. Harmless where it is kept: every sandbox has no_new_privs (file capabilities are
# never gained at exec) and writes only nosuid mounts of its own; kept only when the
# sandbox shares no writable directory with the host (see gym_fork/system/birth.py).
CAP_SETFCAP = 31
KEPT_FOR_CLONES = (CAP_SETFCAP,)

_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_DUMPABLE = 4
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
CAP_VERSION_3 = 0x20080522
# libseccomp attributes that would make its load pass flags to seccomp(2) (TSYNC, LOG,
# SSB): the precompiled program is only loaded by hand while all are off.
_SCMP_FLTATR_FLAGS = (4, 6, 7)
# The Cap* lines of /proc/<pid>/status.
_CAPABILITY_LINE = re.compile(rb"^Cap(\w+):\s*([0-9a-fA-F]+)", re.MULTILINE)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


_libc = ctypes.CDLL(None, use_errno=True)
# Declared once: each call then converts plain ints without building ctypes objects.
_prctl = _libc.prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int

# What this process (and so every process forked from it) has already given up.
_seccomp_installed = 0
_dropped = False
_in_own_user_namespace = False  # a clone that made its own user namespace
_prepared: tuple[Any, int] | None = None  # built once, in the warm parent
# The filter as a BPF program (kept alive: a sandbox loads it with one prctl) and the
# capability plan (capabilities of the bounding set, whether any set is not empty), both
# made in the warm parent: a fork has the warm parent's capabilities.
_program: tuple[ctypes.Array, _SockFprog] | None = None
_capability_plan: tuple[tuple[int, ...], bool] | None = None
_capset_args: tuple[CapHeader, ctypes.Array] | None = None


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


_last_cap: int | None = None  # read once (in the warm parent): every fork has it


def _plan_capabilities() -> tuple[tuple[int, ...], bool]:
    """(the capabilities in this process's bounding set, whether any set is not empty)."""
    global _last_cap
    sets = capability_sets()
    if _last_cap is None:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            _last_cap = int(f.read())
    last = _last_cap
    bounding = sets.get("CapBnd", 0)
    return tuple(cap for cap in range(last + 1) if bounding >> cap & 1), any(sets.values())


def _own_status() -> bytes:
    """/proc/self/status, raw (one read: the kernel renders it at once)."""
    fd = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def _check_prctl(option: int, value: int) -> None:
    if _prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _capabilities_left(keep_mask: int) -> bool:
    """Does this process hold any capability beyond ``keep_mask`` (ambient and
    inheritable: any at all)?"""
    for name, value in _CAPABILITY_LINE.findall(_own_status()):
        allowed = 0 if name in (b"Amb", b"Inh") else keep_mask
        if int(value, 16) & ~allowed:
            return True
    return False


def drop_capabilities(keep: tuple[int, ...] = ()) -> None:
    """Empty every capability set (ambient, bounding, effective, permitted,
    inheritable) but for the capabilities in ``keep``, left in the bounding, permitted
    and effective sets.

    With an empty bounding set, not even executing a program as root gives any back.
    Raises ConfinementError when a set holds more afterwards (checked in this process's
    /proc/self/status, whatever plan the drop followed)."""
    global _dropped
    keep_mask = sum(1 << cap for cap in set(keep))
    inherited_drop = _dropped  # forked from a sandbox that dropped them (a clone)
    _dropped = True  # even a partial drop leaves this process unable to make namespaces
    if inherited_drop:
        if not _capabilities_left(keep_mask):
            return
        plans: tuple = (None,)
    elif _in_own_user_namespace:
        # A new user namespace gives every capability: all of them, up to the last the
        # kernel knows (read in the warm parent), without reading this process's sets.
        full = (tuple(range(_last_cap + 1)), True) if _last_cap is not None else None
        plans = (full, None) if full is not None else (None,)
    else:
        # The warm parent's plan first (a fork has its capabilities), then, should any
        # be left, this process's own sets, read now.
        plans = (_capability_plan, None) if _capability_plan is not None else (None,)
    for plan in plans:
        bounding, any_set = plan if plan is not None else _plan_capabilities()
        if any_set:
            _check_prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
            # Bounding set first: dropping from it needs CAP_SETPCAP, which goes next.
            for cap in bounding:
                if not keep_mask >> cap & 1:
                    _check_prctl(_PR_CAPBSET_DROP, cap)
            header, data = _capset_args or (CapHeader(CAP_VERSION_3, 0), (CapData * 2)())
            if keep_mask:
                data = (CapData * 2)()
                for word in (0, 1):
                    bits = keep_mask >> (32 * word) & 0xFFFFFFFF
                    data[word].effective = data[word].permitted = bits
            if _libc.capset(ctypes.byref(header), data) != 0:
                err = ctypes.get_errno()
                raise ConfinementError(err, f"capset: {os.strerror(err)}")
        if not _capabilities_left(keep_mask):
            return
    left = {name: value for name, value in capability_sets().items() if value}
    raise ConfinementError(errno.EPERM, f"capabilities left after the drop: {left}")


def forbid_tracing() -> None:
    """Not dumpable: siblings of the same uid cannot open this process's /proc/<pid>/mem
    or attach to it (that would need CAP_SYS_PTRACE, which every sandbox drops)."""
    linux.prctl(_PR_SET_DUMPABLE, 0)


def prepare_seccomp() -> tuple[Any, int]:
    """Build the filter (not loaded) and the capability plan: call once in the warm
    parent (or the zygote it is forked from), so that each sandbox forked from it only
    loads the compiled program (one prctl) and drops what the plan lists. Returns
    (filter, number of system calls refused).

    Raises ConfinementError naming the reason when libseccomp cannot be used."""
    global _prepared, _program, _capability_plan, _capset_args
    if _prepared is not None:
        return _prepared
    if _capability_plan is None:
        try:
            _capability_plan = _plan_capabilities()
            _capset_args = (CapHeader(CAP_VERSION_3, 0), (CapData * 2)())
        except (OSError, ValueError):
            _capability_plan = None  # each sandbox reads its own sets
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
        # unshare only into a user namespace of its own (a clone's way to its own mount,
        # IPC and network namespaces); anything else needs capabilities it has not.
        flt.add_rule(
            seccomp.ERRNO(errno.EPERM),
            "unshare",
            seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEWUSER, 0),
        )
        # ... and never with the namespaces a clone does not need: a cgroup namespace of
        # its own lets a user namespace's root mount cgroupfs writable (and lift its
        # limits); pid, UTS and time namespaces are not a clone's either.
        for flag in UNSHARE_REFUSED_FLAGS:
            flt.add_rule(
                seccomp.ERRNO(errno.EPERM),
                "unshare",
                seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag),
            )
        # Typing into a terminal (TIOCSTI) or a console (TIOCLINUX) reaches a user's
        # shell; a sandbox has no terminal of the controller's, and this keeps it so.
        for request in (TIOCSTI, TIOCLINUX):
            flt.add_rule(
                seccomp.ERRNO(errno.EPERM),
                "ioctl",
                seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request),
            )
        refused += 2
        for flag in CLONE_NAMESPACE_FLAGS:
            # clone's flags are its first argument on every architecture we run on
            flt.add_rule(
                seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag)
            )
        flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        refused += 2
    except OSError as exc:
        raise ConfinementError(exc.errno or errno.EINVAL, f"seccomp filter: {exc}") from exc
    _program = _compile(flt)
    _prepared = (flt, refused)
    return _prepared


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _compile(flt) -> tuple[ctypes.Array, _SockFprog] | None:
    """The filter as libseccomp would load it (seccomp_export_bpf generates the same
    program as seccomp_load), ready for PR_SET_SECCOMP; None where libseccomp's load
    would pass flags to seccomp(2), or the export fails: sandboxes then use its load."""
    try:
        if any(flt.get_attr(attr) for attr in _SCMP_FLTATR_FLAGS):
            return None
        fd = os.memfd_create("gym_fork-seccomp", os.MFD_CLOEXEC)
        try:
            flt.export_bpf(_Fd(fd))
            size = os.lseek(fd, 0, os.SEEK_END)
            code = os.pread(fd, size, 0)
        finally:
            os.close(fd)
    except Exception:
        return None
    if not code or len(code) % 8 or len(code) // 8 > 4096:
        return None  # not a program the kernel takes (8 bytes per instruction, <= 4096)
    buffer = ctypes.create_string_buffer(code, len(code))
    return buffer, _SockFprog(len(code) // 8, ctypes.addressof(buffer))


def install_seccomp() -> int:
    """Load the filter into this process (inherited by every process forked from here,
    and never removed); returns how many system calls it refuses. Needs no_new_privs.

    Raises ConfinementError naming the reason when it cannot be loaded."""
    global _seccomp_installed
    if _seccomp_installed:
        return _seccomp_installed  # inherited from the sandbox this one was forked from
    flt, refused = prepare_seccomp()
    if _program is not None:
        # The program libseccomp's load would generate, loaded as it would load it
        # (no_new_privs is set by the caller; no flags).
        if _prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(_program[1]), 0, 0):
            err = ctypes.get_errno()
            raise ConfinementError(err, f"seccomp filter: {os.strerror(err)}")
    else:
        try:
            flt.load()
        except OSError as exc:
            raise ConfinementError(exc.errno or errno.EINVAL, f"seccomp filter: {exc}") from exc
    _seccomp_installed = refused
    return refused


def replan_capabilities() -> None:
    """In a process that has just entered a user namespace of its own (every capability
    there, the host's bounding set or not): the capabilities its sandboxes drop are
    read again from its sets now, not taken from the plan it was forked with."""
    global _capability_plan
    _capability_plan = _plan_capabilities()


def inherited() -> bool:
    """True in a process forked from a confined sandbox (a clone): it is confined already."""
    return _seccomp_installed > 0 or _dropped


def forget_inherited_drop() -> None:
    """In a clone that has just made its own user namespace (where it holds every
    capability again): the next :func:`drop_capabilities` must drop, not only check."""
    global _dropped, _in_own_user_namespace
    _dropped = False
    _in_own_user_namespace = True

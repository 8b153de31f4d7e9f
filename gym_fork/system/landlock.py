"""Landlock scoping of a sandbox: no process outside its domain within its reach.

Only Landlock's scoping, no file system rules. Applied with the rest of the confinement
(:mod:`gym_fork.system.confine`) at the end of a sandbox's birth (the step is
system/sandbox_isolation.py's), inherited by all it forks or executes.
"""

from __future__ import annotations

import ctypes
import errno
import os

from gym_fork.system.confine import ConfinementError

_libc = ctypes.CDLL(None, use_errno=True)

# Landlock (no file system rules: only its scoping). A process in a Landlock domain
# cannot ptrace, read /proc/<pid>/{mem,root,environ,...} of, signal, or connect to an
# abstract UNIX socket of any process outside its domain or the domains nested in it:
# a sandbox's siblings are out of its reach even through a program it executed (exec
# makes a process dumpable again). Scoping needs Landlock ABI 6 (Linux 6.12); a domain
# that handled file system rights would also forbid the mounts a clone makes.
_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_RESTRICT_SELF = 444, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1
_LANDLOCK_SCOPE_SIGNAL = 2
LANDLOCK_MIN_ABI = 6


class _LandlockRulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


_landlock_abi: int | None = None  # asked once: the kernel's answer does not change


def landlock_abi() -> int:
    """The Landlock ABI version of this kernel (0: none)."""
    global _landlock_abi
    if _landlock_abi is None:
        version = _libc.syscall(
            _SYS_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION
        )
        _landlock_abi = max(version, 0)
    return _landlock_abi


def enter_landlock_domain() -> str:
    """Put this process (and all it forks or executes) in a new Landlock domain scoped
    for signals and abstract UNIX sockets; returns what was achieved. Needs
    no_new_privs. Raises ConfinementError naming the reason."""
    abi = landlock_abi()
    if abi < LANDLOCK_MIN_ABI:
        raise ConfinementError(
            errno.ENOSYS,
            f"Landlock ABI {abi} < {LANDLOCK_MIN_ABI} (Linux 6.12): siblings can reach a "
            "sandbox's executed helpers through /proc and signal it",
        )
    attr = _LandlockRulesetAttr(0, 0, _LANDLOCK_SCOPE_SIGNAL | _LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET)
    fd = _libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    if fd < 0:
        err = ctypes.get_errno()
        raise ConfinementError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    try:
        if _libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, fd, 0) != 0:
            err = ctypes.get_errno()
            raise ConfinementError(err, f"landlock_restrict_self: {os.strerror(err)}")
    finally:
        os.close(fd)
    return f"scoped (ABI {abi}: ptrace, /proc, signals, abstract sockets)"

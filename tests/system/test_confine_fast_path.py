"""The confinement a sandbox loads from what the warm parent prepared: the compiled
seccomp program (one prctl) and the capability plan must confine exactly as libseccomp's
load and a drop from the process's own sets do."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from gym_fork.system import confine, linux

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping capabilities needs root")


def _in_child(body) -> str:
    """Run ``body()`` (returns a str) in a forked child; its result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.write(write, body().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    return out


def test_the_compiled_program_and_the_plan_confine_a_fork():
    try:
        confine.prepare_seccomp()
    except confine.ConfinementError as exc:
        pytest.skip(str(exc))
    assert confine._program is not None and confine._capability_plan is not None

    def body() -> str:
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
        confine.drop_capabilities()
        refused = confine.install_seccomp()
        libc = ctypes.CDLL(None, use_errno=True)
        out = [str(refused)]
        for call in (lambda: libc.unshare(0x00020000), lambda: libc.syscall(435, 0, 0)):
            rc = call()
            out.append(errno.errorcode.get(ctypes.get_errno(), "?") if rc else "allowed")
        with open("/proc/self/status") as f:
            out += [line.strip() for line in f if line.startswith(("CapEff", "CapBnd", "Sec"))]
        pid = os.fork()  # a plain fork still works, and the clone's drop is a check only
        if pid == 0:
            try:
                confine.drop_capabilities()
                confine.install_seccomp()
            except BaseException:
                os._exit(1)
            os._exit(0)
        out.append(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
        return "|".join(out)

    refused, unshare, clone3, *status, child = _in_child(body).split("|")
    assert int(refused) > 0
    assert (unshare, clone3) == ("EPERM", "ENOSYS")
    assert "CapEff:\t0000000000000000" in status and "CapBnd:\t0000000000000000" in status
    assert "Seccomp:\t2" in status
    assert child == "0"

"""Attacks from a hostile env inside a process sandbox: each must fail, and nothing an
env starts may outlive close() or the controller."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv
from gym_fork.system import cgroups
from gym_fork.system.isolation import SandboxLimits
from tests.helpers import SpaceEnv, kill_marked, marked_processes, wait_until

pytestmark = [
    pytest.mark.process_only,
    pytest.mark.skipif(os.geteuid() != 0, reason="the pid namespace needs root here"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_PTRACE_ATTACH, _PTRACE_DETACH = 16, 17
_MNT_DETACH = 2


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _outcome(rc: int) -> str:
    return "allowed" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), "?")


class HostileEnv(SpaceEnv):
    """A sub-env whose methods try to get out of their sandbox."""

    def __init__(self) -> None:
        super().__init__(spaces.Discrete(4))

    def join_net_namespace_of(self, pid: int) -> str:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        except OSError as exc:
            return f"open: {errno.errorcode[exc.errno]}"
        try:
            return "setns: " + _outcome(_libc().setns(fd, _CLONE_NEWNET))
        finally:
            os.close(fd)

    def setns_own(self) -> str:
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            return _outcome(_libc().setns(fd, _CLONE_NEWNET))
        finally:
            os.close(fd)

    def reach(self, pid: int) -> dict[str, str]:
        out = {}
        try:
            os.kill(pid, 0)
            out["kill"] = "allowed"
        except OSError as exc:
            out["kill"] = errno.errorcode[exc.errno]
        for what in ("root", "mem"):
            try:
                if what == "root":
                    os.listdir(f"/proc/{pid}/root/")
                else:
                    with open(f"/proc/{pid}/mem", "rb"):
                        pass
                out[what] = "allowed"
            except OSError as exc:
                out[what] = errno.errorcode[exc.errno]
        return out

    def visible_processes(self) -> tuple[list[int], str]:
        pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
        with open("/proc/1/cmdline", "rb") as f:
            return pids, f.read().replace(b"\0", b" ").decode()

    def mount_tmpfs(self, target: str) -> str:
        libc = _libc()
        rc = libc.mount(b"none", target.encode(), b"tmpfs", 0, None)
        result = _outcome(rc)
        if rc == 0:
            libc.umount2(target.encode(), _MNT_DETACH)
        return result

    def unshare(self) -> str:
        return _outcome(_libc().unshare(_CLONE_NEWNS))

    def ptrace_parent(self) -> str:
        libc = _libc()
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        parent = os.getppid()
        rc = libc.ptrace(_PTRACE_ATTACH, parent, None, None)
        result = _outcome(rc)
        if rc == 0:
            os.waitpid(parent, os.WNOHANG | 0x40000000)  # __WALL
            libc.ptrace(_PTRACE_DETACH, parent, None, None)
        return result

    def read_memory_of(self, pid: int) -> str:
        try:
            with open(f"/proc/{pid}/mem", "rb"):
                return "allowed"
        except OSError as exc:
            return errno.errorcode[exc.errno]

    def ns_pid(self) -> int:
        return os.getpid()

    def capabilities(self) -> str:
        with open("/proc/self/status") as f:
            return "".join(line for line in f if line.startswith(("CapEff", "CapBnd")))

    def daemonize(self) -> None:
        """A classic double fork: the daemon is nobody's child once its parent exits."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(60)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    def fork_bomb(self, n: int) -> None:
        """``n`` sleeping children (bounded: this is a test)."""
        for _ in range(n):
            if os.fork() == 0:
                try:
                    time.sleep(60)
                finally:
                    os._exit(0)

    def start_helpers(self) -> None:
        subprocess.Popen(["sleep", "60"])
        subprocess.Popen(["sleep", "60"], start_new_session=True)
        self.daemonize()


def hostile(n: int = 1, **kwargs) -> ForkVectorEnv:
    kwargs.setdefault("envs_per_worker", 1)
    kwargs.setdefault("lineage_log", False)
    return ForkVectorEnv([HostileEnv] * n, **kwargs)


@pytest.fixture
def envs():
    envs = hostile(2)
    envs.reset(seed=0)
    yield envs
    envs.close()
    kill_marked()  # only matters where confinement failed: never leave sleepers behind


def test_the_report_says_pid_capabilities_and_seccomp_are_achieved(envs):
    report = envs.isolation
    assert report["namespaces"]["pid"] and "pid" not in report["missing"]
    assert report["proc"] == "the tree's own"
    # An unprivileged uid keeps nothing (a clone maps it into its user namespace without
    # CAP_SETFCAP); a sandbox left as root keeps CAP_SETFCAP alone, for the same mapping.
    # CAP_SETFCAP is kept where the sandbox is root of its user namespace (the tree's, or
    # the host's): a clone needs it to map that uid 0 into its own. An unprivileged uid
    # of the host keeps nothing (it maps itself without it).
    unprivileged = report["uid"] != 0 and not report["user_namespace"]
    kept = "0000000000000000" if unprivileged else "0000000080000000"
    assert report["capabilities"] == ("dropped" if unprivileged else "dropped, but CAP_SETFCAP")
    assert report["seccomp"].startswith("on (") and "capabilities" not in report["missing"]
    caps = envs.call("capabilities")[0]
    assert f"CapEff:\t{kept}" in caps and f"CapBnd:\t{kept}" in caps


def test_the_controller_namespaces_cannot_be_joined(envs):
    me = os.getpid()
    assert envs.call("join_net_namespace_of", me)[0] == "open: ENOENT"
    assert envs.call("setns_own") == ("EPERM", "EPERM")  # setns itself is refused


def test_the_controller_is_not_even_visible(envs):
    reach = envs.call("reach", os.getpid())[0]
    assert reach["kill"] in ("ESRCH", "EPERM"), reach
    assert reach["root"] in ("ENOENT", "EACCES", "EPERM"), reach
    assert reach["mem"] in ("ENOENT", "EACCES", "EPERM"), reach
    pids, init = envs.call("visible_processes")[0]
    # pid 1 is the warm parent (a fork of the zygote keeps the zygote's command line)
    assert "gym_fork.hosts.process.parent" in init or "gym_fork.hosts.process.zygote" in init
    assert len(pids) == 3, pids  # the warm parent and the two sandboxes, nothing else


def test_mount_unshare_and_ptrace_are_refused(envs, tmp_path):
    assert envs.call("mount_tmpfs", str(tmp_path)) == ("EPERM", "EPERM")
    assert envs.call("unshare") == ("EPERM", "EPERM")
    assert envs.call("ptrace_parent") == ("EPERM", "EPERM")


def test_a_sandbox_cannot_read_the_memory_of_its_sibling(envs):
    _, second = envs.call("ns_pid")
    assert envs.call("read_memory_of", second)[0] in ("EACCES", "EPERM")


def test_clones_inherit_the_confinement(envs, tmp_path):
    branch = envs.fork("b", indices=[0])
    try:
        assert branch.call("mount_tmpfs", str(tmp_path)) == ("EPERM",)
        assert branch.call("unshare") == ("EPERM",)
        assert branch.isolation["seccomp"].startswith("on (")
    finally:
        branch.close()


def test_daemons_and_fork_bombs_are_gone_within_two_seconds_of_close():
    envs = hostile(2)
    try:
        envs.reset(seed=0)
        envs.call("daemonize")
        envs.call("fork_bomb", 25)
        assert len(marked_processes()) >= 1 + 2 + 50 + 1  # parent, sandboxes, children, daemon
        started = time.monotonic()
        envs.close()
        assert wait_until(lambda: not marked_processes(), 2.0), marked_processes()
        assert time.monotonic() - started < 2.0
    finally:
        envs.close()
        kill_marked()


CONTROLLER = textwrap.dedent(
    """
    import os, sys, threading, time
    from gym_fork import ForkVectorEnv
    from gym_fork.system.isolation import SandboxLimits
    from tests.hosts.test_confinement import HostileEnv

    def build():
        global envs
        envs = ForkVectorEnv([HostileEnv] * 2, envs_per_worker=1, lineage_log=False,
                             limits=SandboxLimits(processes=100))
        envs.reset(seed=0)
        envs.call("start_helpers")

    if sys.argv[1] == "thread":
        thread = threading.Thread(target=build)
        thread.start()
        thread.join()
        # A child of the controller inherits its end of the control socket.
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
    else:
        build()
        print(0, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.slow  # 2.1 s here
@pytest.mark.parametrize("where", ["main", "thread"])
def test_nothing_of_the_tree_survives_a_sigkilled_controller(where):
    """``thread``: built from a non-main thread by a controller that forked a child,
    so neither PDEATHSIG nor the control socket's EOF tells the tree."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, where], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    forked = 0
    try:
        forked = int(proc.stdout.readline())
        tree = marked_processes(proc.pid)
        assert len(tree) >= 1 + 2 + 6  # the parent, the sandboxes, their helpers
        ours = {f"{cgroups.PREFIX}{pid}" for pid in tree}  # named after the tree's starter

        def groups() -> set[str]:
            return {g for g in cgroups.leftover_groups() if os.path.basename(g) in ours}

        assert groups()
        proc.kill()
        proc.wait()
        started = time.monotonic()
        assert wait_until(lambda: not marked_processes(proc.pid), 2.0), marked_processes(proc.pid)
        assert wait_until(lambda: not groups(), 2.0), groups()
        assert time.monotonic() - started < 2.0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        if forked:
            os.kill(forked, signal.SIGKILL)
        kill_marked(proc.pid)
        wait_until(lambda: not marked_processes(proc.pid), 2.0)
        cgroups.sweep_stale()


def test_helpers_do_not_survive_close():
    envs = hostile(1, limits=SandboxLimits(processes=100))
    try:
        envs.reset(seed=0)
        envs.call("start_helpers")
        assert len(marked_processes()) >= 1 + 1 + 3  # parent, sandbox, helpers
        envs.close()
        assert wait_until(lambda: not marked_processes(), 2.0), marked_processes()
    finally:
        envs.close()
        kill_marked()

"""Attacks on the sibling fork (gym_fork/system/linux.py ``fork_sibling``: a raw
clone(2) with CLONE_PARENT): what the kernel refuses must come back as a clean OSError
with the source working on, and the child must be as sane as an ``os.fork()`` child.

Each case runs in a fresh interpreter (fork hooks cannot be taken back) that forks a
middle process to call fork_sibling: the sibling is then that interpreter's child, and
it reaps it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SandboxStartError
from gym_fork.system import linux
from tests.helpers import alive

REPO = Path(__file__).resolve().parents[2]

needs_sibling = pytest.mark.skipif(
    not linux.can_fork_sibling(), reason="fork_sibling needs glibc's thread id found (x86_64)"
)


# How a case starts: a middle process (``middle == 0`` in it) and a pipe back to us.
MIDDLE = """
import os
from gym_fork.system import linux
r, w = os.pipe()
middle = os.fork()
"""


def run(code: str, *prefix: str) -> list[str]:
    """``code`` in a fresh interpreter (after ``prefix``, e.g. unshare); its output."""
    out = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@needs_sibling
def test_a_clone_refused_by_rlimit_nproc_is_a_clean_eagain_and_the_source_forks_on():
    code = (
        MIDDLE
        + """
import _imp, errno, resource, threading
if middle == 0:
    linux.can_fork_sibling()  # imports what it needs while we may read the stdlib
    resource.setrlimit(resource.RLIMIT_NPROC, (1, resource.getrlimit(resource.RLIMIT_NPROC)[1]))
    if os.getuid() == 0:  # root is exempt from RLIMIT_NPROC: become nobody
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
    try:
        linux.fork_sibling()
        refused = "forked"
    except OSError as exc:
        refused = str(exc.errno == errno.EAGAIN)
    lock = threading.Lock()
    sane = not _imp.lock_held() and lock.acquire(timeout=1)  # the import lock is released
    resource.setrlimit(resource.RLIMIT_NPROC, resource.getrlimit(resource.RLIMIT_NPROC)[1:] * 2)
    pid, _ = linux.fork_sibling()
    if pid == 0:
        os._exit(7)
    os.write(w, f"{refused} {sane} {pid}".encode())
    os._exit(0)
os.close(w)
os.waitpid(middle, 0)
refused, sane, pid = os.read(r, 100).decode().split()
print(refused, sane, os.waitstatus_to_exitcode(os.waitpid(int(pid), 0)[1]))
"""
    )
    assert run(code) == ["True", "True", "7"]


@needs_sibling
@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare(1)")
def test_fork_sibling_in_a_pid_namespaces_init_is_a_clean_einval_and_os_fork_still_works():
    code = """
import errno, os
from gym_fork.system import linux
assert os.getpid() == 1
try:
    linux.fork_sibling()
    print("forked")
except OSError as exc:
    print(exc.errno == errno.EINVAL)
pid = os.fork()
if pid == 0:
    os._exit(3)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    probe = subprocess.run(["unshare", "-U", "-r", "-p", "-f", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no unprivileged pid namespace here")
    assert run(code, "unshare", "-U", "-r", "-p", "-f") == ["True", "3"]


@needs_sibling
def test_a_clone_that_dies_at_once_is_reaped_by_our_parent_and_the_source_goes_on():
    code = (
        MIDDLE
        + """
import signal
if middle == 0:
    pids = []
    for _ in range(3):
        pid, _ = linux.fork_sibling()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        pids.append(pid)
    os.write(w, " ".join(map(str, pids)).encode())
    os._exit(0)
os.close(w)
print(os.waitstatus_to_exitcode(os.waitpid(middle, 0)[1]))
for pid in os.read(r, 100).split():
    print(os.waitstatus_to_exitcode(os.waitpid(int(pid), 0)[1]))
"""
    )
    assert run(code) == ["0", "-9", "-9", "-9"]


# The sibling's glibc thread id, as pthread_self() sees it, and its real one.
_CHILD_TIDS = """
import ctypes, os, threading
from gym_fork.system import linux

def tids():
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_void_p
    slot = libc.pthread_self() + linux._GLIBC_TID_OFFSET
    return ctypes.c_int.from_address(slot).value, threading.get_native_id()
"""


@needs_sibling
def test_the_childs_glibc_tid_is_its_own_when_another_thread_made_the_raw_clone():
    code = (
        _CHILD_TIDS
        + """
made = threading.Thread(target=linux.can_fork_sibling)
made.start()
made.join()
r, w = os.pipe()
middle = os.fork()
if middle == 0:
    if linux.fork_sibling()[0] == 0:
        glibc, real = tids()
        os.write(w, str(glibc == real).encode())
        os._exit(0)
    os._exit(0)
os.close(w)
os.waitpid(middle, 0)
print(os.read(r, 100).decode())
os.wait()
"""
    )
    assert run(code) == ["True"]


@needs_sibling
def test_fork_sibling_in_a_threaded_process_refuses_or_makes_a_sane_child():
    code = (
        MIDDLE
        + """
import ctypes, signal, threading, time
if middle == 0:
    linux.can_fork_sibling()  # made by this thread: only the other thread is wrong
    libc = ctypes.CDLL(None)
    stdout = ctypes.c_void_p.in_dll(libc, "stdout")
    held = threading.Event()

    def hold():
        libc.flockfile(stdout)
        held.set()
        time.sleep(30)

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    try:
        pid, _ = linux.fork_sibling()
    except OSError:
        pid = -1
    if pid == 0:
        signal.alarm(1)  # the deadlock's deadline
        libc.fflush(stdout)
        os._exit(0)
    os.write(w, str(pid).encode())
    os._exit(0)  # not exit(): stdout's lock is held
os.close(w)
os.waitpid(middle, 0)
pid = int(os.read(r, 100))
print("refused" if pid < 0 else os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    )
    assert run(code)[0] in ("refused", "0")


class ImpostorClonesEnv(gym.Wrapper):
    """CartPole whose env code rewrites its worker so that a FORK answers with a pidfd
    of the warm parent (its own parent) instead of its clones."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def name_the_warm_parent_as_clones(self) -> None:
        from gym_fork.hosts.process import sandbox
        from gym_fork.system.fan_out import Forked

        def impostor(worker, plan, *rest):
            made = Forked()
            for k in range(len(plan)):
                made.add(k, linux.ProcessWatch(os.getppid()))
            return made

        sandbox._fork_siblings = impostor


def test_a_source_naming_the_warm_parent_as_its_clone_is_refused_and_the_tree_lives():
    env = ForkVectorEnv([ImpostorClonesEnv], lineage_log=False)
    try:
        env.reset(seed=0)
        warm_parent = env.sandboxes.host.pid
        env.call("name_the_warm_parent_as_clones")
        with pytest.raises(SandboxStartError, match="not a new sandbox"):
            env.fork("impostor", [0])
        assert alive([warm_parent])  # never adopted, so never killed with the branch
        _, rewards, _, _, _ = env.step(np.array([0]))
        assert list(rewards) == [1.0]
    finally:
        env.close()

"""A FORK's clones are born children of the warm parent (clone(2) with CLONE_PARENT,
gym_fork/system/linux.py fork_sibling): no intermediate process, no adoption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.system import linux
from tests.helpers import alive, wait_until

needs_sibling = pytest.mark.skipif(
    not linux.can_fork_sibling(),
    reason="fork_sibling needs glibc's thread id found (x86_64): clones double-fork here",
)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


# Run in a fresh interpreter: os.register_at_fork hooks cannot be taken back.
_SIBLING = """
import ctypes, os, platform, signal, threading
from gym_fork.system import linux

def robust_head():
    libc = ctypes.CDLL(None)
    head, size = ctypes.c_void_p(), ctypes.c_size_t()
    number = linux._SYSCALLS[platform.machine()][2]  # get_robust_list
    libc.syscall(number, 0, ctypes.byref(head), ctypes.byref(size))
    return head.value or 0


hooks = []
os.register_at_fork(after_in_child=lambda: hooks.append("child"))
read_end, write_end = os.pipe()
me = os.getpid()
middle = os.fork()
if middle == 0:
    code = 1
    try:
        os.close(read_end)
        hooks.clear()
        robust = robust_head()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # kept by both sides
        pid, pidfd = linux.fork_sibling()
        if pid == 0:
            tid_ok = robust_head() == robust != 0  # registered again, as glibc's fork does
            tid_ok &= pidfd == -1
            tid_ok &= signal.pthread_sigmask(signal.SIG_BLOCK, []) == {signal.SIGUSR1}
            if platform.machine() == "x86_64":
                libc = ctypes.CDLL(None)
                libc.pthread_self.restype = ctypes.c_void_p
                slot = libc.pthread_self() + linux._GLIBC_TID_OFFSET
                tid_ok &= ctypes.c_int.from_address(slot).value == threading.get_native_id()
            os.write(write_end, f"{os.getppid() == me} {hooks} {tid_ok} {os.getpid()}".encode())
            os._exit(0)
        code = 0 if hooks == [] else 2  # the child's hook ran in the child only
        if linux.pidfd_pids(pidfd) != [pid]:
            code = 3  # CLONE_PIDFD: we hold a pidfd of the sibling
        if signal.pthread_sigmask(signal.SIG_BLOCK, []) != {signal.SIGUSR1}:
            code = 4  # the mask held off during the fork is the caller's again
    finally:
        os._exit(code)
os.close(write_end)
_, status = os.waitpid(middle, 0)
with os.fdopen(read_end) as pipe:
    born_ours, hooks, tid_ok, pid = pipe.read().split()
# The sibling is our child, not the middle process's: ours to reap.
reaped, sibling_status = os.waitpid(int(pid), 0)
print(os.waitstatus_to_exitcode(status), born_ours, hooks, tid_ok, reaped == int(pid))
"""


@needs_sibling
def test_the_sibling_is_our_parents_child_with_pythons_fork_hooks_run():
    out = subprocess.run(
        [sys.executable, "-c", _SIBLING], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.split() == ["0", "True", "['child']", "True", "True"]


@needs_sibling
def test_a_clone_is_born_a_child_of_the_warm_parent_and_dies_with_it():
    env = ForkVectorEnv.from_parent(lambda: gym.make("CartPole-v1"), 1, lineage_log=False)
    try:
        env.reset(seed=0)
        branch = env.fork("siblings", [0], copies=2)
        try:
            warm_parent = env.sandboxes.host.pid
            clones = branch.worker_pids
            assert [_ppid(pid) for pid in clones] == [warm_parent, warm_parent]
            env.close()  # the source goes; its clones go on
            branch.step(np.array([0, 1]))
            os.kill(warm_parent, signal.SIGKILL)
            assert wait_until(lambda: not alive(clones), 2.0)
        finally:
            branch.close(terminate=True)
    finally:
        env.close(terminate=True)


class ThreadedEnv(gym.Wrapper):
    """CartPole whose sandbox runs a second thread (as an env's own helper thread)."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        threading.Thread(target=threading.Event().wait, daemon=True).start()


def test_a_threaded_source_still_forks_clones_of_the_warm_parent_by_a_double_fork():
    env = ForkVectorEnv([ThreadedEnv], lineage_log=False)
    try:
        env.reset(seed=0)
        with open(f"/proc/{env.worker_pids[0]}/status") as f:
            assert "Threads:\t2\n" in f.read()  # so the source takes the double fork
        branch = env.fork("threaded", [0], copies=2)
        try:
            warm_parent = env.sandboxes.host.pid
            assert [_ppid(pid) for pid in branch.worker_pids] == [warm_parent, warm_parent]
            _, rewards, _, _, _ = branch.step(np.array([0, 1]))
            assert list(rewards) == [1.0, 1.0]
        finally:
            branch.close()
    finally:
        env.close()


class RaisingEnv(gym.Wrapper):
    """CartPole that can kill itself with C's raise() (SIGKILL to its own thread): in a
    clone made by a raw clone(2) that must reach the clone, never its source."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def die_by_raise(self) -> None:
        signal.raise_signal(signal.SIGKILL)


def test_a_clone_that_raises_a_signal_kills_itself_not_its_source():
    env = ForkVectorEnv([RaisingEnv], lineage_log=False)
    try:
        env.reset(seed=0)
        source = env.worker_pids[0]
        branch = env.fork("raiser", [0])
        try:
            with pytest.raises(Exception, match=r"(?i)killed|signal|died|crash"):
                branch.call("die_by_raise")
        finally:
            branch.close()
        assert alive([source])
        _, rewards, _, _, _ = env.step(np.array([0]))
        assert list(rewards) == [1.0]
    finally:
        env.close()

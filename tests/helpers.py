"""Test helpers: deterministic envs over any space, and a leak snapshot."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class SpaceEnv(gym.Env):
    """Emits seeded samples of ``observation_space``; ends episodes at random lengths.

    Everything it returns depends only on the reset seeds and the actions, so the same
    seeds and actions give bit-identical results in any vector env.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(
        self, observation_space, action_space=None, max_len=7, render_mode=None, trunc_prob=0.05
    ):
        # Own copies: a space carries an RNG, and sharing it between sub-envs of one
        # process (SyncVectorEnv) would interleave their samples.
        self.observation_space = copy.deepcopy(observation_space)
        self.action_space = copy.deepcopy(action_space) if action_space else spaces.Discrete(3)
        self.max_len = max_len
        self.trunc_prob = trunc_prob
        self.render_mode = render_mode
        self.t = 0
        self.limit = max_len
        self.marker = "initial"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        self.t = 0
        self.limit = int(self.np_random.integers(2, self.max_len + 1))
        info = {"episode_seed": seed} if seed is not None else {}
        if options and "note" in options:
            info["note"] = options["note"]
        return self.observation_space.sample(), info

    def step(self, action):
        self.t += 1
        flat = spaces.flatten(self.action_space, action)
        reward = float(self.np_random.normal()) + float(np.sum(flat, dtype=float))
        terminated = self.t >= self.limit
        truncated = bool(self.np_random.random() < self.trunc_prob)
        info = {"t": self.t} if self.t % 2 == 0 else {}
        return self.observation_space.sample(), reward, terminated, truncated, info

    def render(self):
        return np.full((4, 4, 3), self.t, dtype=np.uint8)

    def add(self, x, y=1):
        return self.t + x + y

    def write_scratch(self, name, text):
        import tempfile

        with open(os.path.join(tempfile.gettempdir(), name), "w") as f:
            f.write(text)

    def read_scratch(self, name):
        import tempfile

        with open(os.path.join(tempfile.gettempdir(), name)) as f:
            return f.read()

    def tcp_connect(self, port):
        import socket

        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return "connected"
        except OSError as exc:
            return f"failed: {exc}"

    def write_tmp_if_marked(self, path, text):
        if self.marker == "write":
            with open(path, "w") as f:
                f.write(text)

    def read_file(self, path):
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def allocate(self, nbytes):
        return int(np.ones(nbytes // 8).sum())

    def hostname(self):
        import socket

        return socket.gethostname()

    def spawn_children(self, n):
        import subprocess

        procs = []
        try:
            for _ in range(n):
                procs.append(subprocess.Popen(["sleep", "5"]))
            return "allowed"
        except OSError:
            return "refused"
        finally:
            for p in procs:
                p.kill()
                p.wait()

    def burn_cpu(self, seconds):
        import time

        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    def scratch_dir(self):
        import tempfile

        return tempfile.gettempdir()


def alive(pids) -> set[int]:
    """Those of ``pids`` that are running (not gone, not a zombie)."""
    running = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    running.add(pid)
        except OSError:
            continue  # gone
    return running


def _zygotes() -> tuple[set[int], set[int]]:
    """Pids and controller-side fds of this process's zygotes: they live as long as
    the controller (gym_fork/hosts/process/zygote.py), so leak checks leave out these
    processes themselves, never what they forked."""
    from gym_fork.hosts.process import zygote

    running = zygote.running()
    return {pid for pid, _ in running}, {fd for _, fd in running}


def descendants(pid: int | None = None) -> set[int]:
    """All live descendant pids of ``pid`` (default: this process), without this
    process's zygotes (but with everything they forked)."""
    if pid is None:
        return _descendants(os.getpid()) - _zygotes()[0]
    return _descendants(pid)


def _descendants(pid: int) -> set[int]:
    children = children_by_parent()
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.add(child)
            stack.append(child)
    return out


def children_by_parent() -> dict[int, list[int]]:
    """Every live (not zombie) process of this /proc, by its parent's pid."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


SANDBOX_MARKER = "GYM_FORK_SANDBOX"


def marked_processes(controller: int | None = None) -> set[int]:
    """Live processes (in this pid namespace) started by the sandboxes of ``controller``
    (default: this process), wherever they went: every warm parent has
    GYM_FORK_SANDBOX=<controller pid> in its environment, and everything it starts
    inherits it (a reparented daemon is no descendant of the controller any more)."""
    needle = f"{SANDBOX_MARKER}={os.getpid() if controller is None else controller}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone, or a zombie
        if b"\0" + needle + b"\0" in b"\0" + environ:
            found.add(int(entry))
    return found - (_zygotes()[0] if controller is None else set())


def kill_marked(controller: int | None = None) -> None:
    """SIGKILL what :func:`marked_processes` finds (cleanup after a failed test)."""
    import contextlib
    import signal

    for pid in marked_processes(controller):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def open_fds() -> set[int]:
    """Open fds, without the microVM boot template (a deliberate per-process cache)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "gym_fork-vm-boot-" not in target:
            fds.add(int(fd))
    return fds - _zygotes()[1]


def gym_fork_shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "gym_fork" in n}


def gym_fork_cgroups() -> set[str]:
    from gym_fork.system.cgroups import leftover_groups

    return {g for g in leftover_groups() if _ours(os.path.basename(g), "gym_fork-")}


def gym_fork_scratch_dirs() -> set[str]:
    import tempfile

    base = tempfile.gettempdir()
    prefix = "gym_fork-scratch-"
    return {n for n in os.listdir(base) if n.startswith(prefix) and _ours(n, prefix)}


def _ours(name: str, prefix: str) -> bool:
    """Alone, every gym_fork name on the machine is this suite's; beside other pytest-xdist
    workers, only names whose tree id (the number after ``prefix``) is a tree this
    process started (gym_fork.hosts.process.host.TREES_STARTED)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return True
    from gym_fork.hosts.process.host import TREES_STARTED

    tree_id = name[len(prefix) :].split("-", 1)[0]
    return not tree_id.isdigit() or int(tree_id) in TREES_STARTED


def wait_until(predicate, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def reap_child(pid: int, timeout: float = 10.0) -> int:
    """Our child ``pid``'s exit code, once it exited (within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    raise AssertionError(f"child {pid} did not exit within {timeout} s")


class Hung(Exception):
    """The watchdog fired: the code under test did not return in time."""


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Raise Hung in the main thread if the block runs past ``seconds`` (SIGALRM): what
    it calls must never block for good (Hung is no OSError, which code under test may
    catch)."""

    def fire(_signum, _frame):
        raise Hung(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def tracked_idle_pool(size: int, become: Callable) -> Iterator[Any]:
    """An IdlePool (gym_fork/hosts/process/idle.py) whose children are noted; a fixture
    body: after the test, the pool is closed and every child it forked killed and
    reaped."""
    from gym_fork.hosts.process import idle
    from gym_fork.system.children import kill_child

    made = idle.IdlePool(size, become)
    forked: list[int] = []
    fill = made.fill

    def fill_and_note() -> list[int]:
        new = fill()
        forked.extend(new)
        return new

    made.fill = fill_and_note  # type: ignore[method-assign]
    yield made
    made.close()
    for pid in forked:
        kill_child(pid)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def make_space_env(observation_space, action_space=None, **kwargs) -> Any:
    return lambda: SpaceEnv(observation_space, action_space, **kwargs)


def why_no_frozen_layers() -> str:
    """Why a fork here copies a source's /tmp writes instead of freezing them into a
    shared layer ("" where it freezes): gym_fork/hosts/process/layers.py."""
    from gym_fork.hosts.process.layers import TmpLayers
    from gym_fork.system.isolation import IsolationConfig

    return TmpLayers(IsolationConfig()).off

"""Envs for tests/system/test_identity.py: what a curious env tries from its sandbox."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

import gymnasium as gym
import numpy as np


class CuriousEnv(gym.Env):
    """Reads files, its environment and the kernel's per-user quotas, from inside."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.held: list[int] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}

    def read(self, path: str) -> str:
        try:
            with open(path) as f:
                return "read: " + f.read()
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))

    def write(self, path: str) -> str:
        try:
            with open(path, "w") as f:
                f.write("x")
            return "written"
        except OSError as exc:
            return errno.errorcode.get(exc.errno or 0, str(exc))

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def exec_environment(self) -> bytes:
        """What this process was started with (b"" where it may not read it: a process
        that is not dumpable has its /proc files owned by root)."""
        try:
            with open("/proc/self/environ", "rb") as f:
                return f.read()
        except PermissionError:
            return b""

    def ids(self) -> tuple[int, int]:
        return os.getuid(), os.geteuid()

    def take_inotify_instances(self, most: int) -> int:
        """Hold as many inotify instances as the kernel gives (up to ``most``)."""
        libc = ctypes.CDLL(None, use_errno=True)
        while len(self.held) < most:
            fd = libc.inotify_init1(os.O_CLOEXEC)
            if fd < 0:
                break
            self.held.append(fd)
        return len(self.held)


def planting_parent_env(site_packages: str, secret: str, report: str, world_writable: str):
    """A from_parent env_fn (it runs in the warm parent, once) that tries what a hostile
    prototype would: plant a .pth every later interpreter runs, write /etc and a
    world-writable host directory (``world_writable``), read an owner-only file; it
    writes what happened to ``report`` (in a directory of ``writable_paths``)."""

    def make() -> gym.Env:
        outcomes = []
        planted = (
            os.path.join(site_packages, "gym_fork_planted.pth"),
            "/etc/gym_fork_planted",
            os.path.join(world_writable, "planted"),
        )
        for path in planted:
            try:
                with open(path, "w") as f:
                    f.write("import os\n")
                outcomes.append("written")
            except OSError as exc:
                outcomes.append(errno.errorcode.get(exc.errno or 0, str(exc)))
        try:
            with open(secret) as f:
                outcomes.append("read: " + f.read())
        except OSError as exc:
            outcomes.append(errno.errorcode.get(exc.errno or 0, str(exc)))
        outcomes.append(str(os.geteuid()))
        with open(report, "w") as f:
            f.write(" ".join(outcomes))
        return CuriousEnv()

    return make


def cgroup_planting_parent_env(depth: int, report: str):
    """A from_parent env_fn that makes groups of its own (a chain ``depth`` deep, and a
    sibling) in the cgroup directories its tree was delegated, which the teardown must
    remove; it writes the paths it made to ``report``."""

    def make() -> gym.Env:
        import glob

        made = []
        for tree in glob.glob("/sys/fs/cgroup/*/gym_fork-*"):
            try:
                if os.stat(tree).st_uid != os.geteuid():  # another tree's (unmapped here)
                    continue
            except FileNotFoundError:  # another tree's, removed since it was listed
                continue
            path = tree
            for level in range(depth):
                path = os.path.join(path, f"planted{level}")
                try:
                    os.mkdir(path)
                except OSError:
                    break
            made.append(path)
            with contextlib.suppress(OSError):
                os.mkdir(os.path.join(tree, "planted-sibling"))
        with open(report, "w") as f:
            f.write("\n".join(made))
        return CuriousEnv()

    return make

"""Envs and /proc readings for tests/system/test_birth.py."""

from __future__ import annotations

import json
import os

import gymnasium as gym
import numpy as np

CAP_SETFCAP = 31


def measured(pid: int | str) -> dict:
    """What /proc says of process ``pid`` ("self" inside a sandbox): no_new_privs,
    seccomp mode, effective capabilities, its uid on the host, namespaces, and whether
    its root mount and /var/tmp are read-only in its view."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    namespaces = {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in ("mnt", "ipc", "net", "user")}
    mounts = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            mounts[fields[4]] = fields[5].split(",")  # the last one mounted at a path wins
    return {
        "no_new_privs": status["NoNewPrivs"].strip() == "1",
        "seccomp": int(status["Seccomp"]),
        "cap_eff": int(status["CapEff"], 16),
        "uid": _host_uid(pid, int(status["Uid"].split()[0])),
        "ns": namespaces,
        "root_ro": _read_only_at("/", mounts),
        "var_tmp_ro": _read_only_at("/var/tmp", mounts),
    }


def _host_uid(pid: int | str, uid: int) -> int:
    """``uid`` as the host sees it: read from inside ("self"), status shows it in the
    tree's user namespace, which maps it one level up, to the host; from the controller
    it is the host's already."""
    if pid != "self":
        return uid
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, outside, count = (int(x) for x in line.split())
            if inside <= uid < inside + count:
                return outside + uid - inside
    return -1  # unmapped


def _read_only_at(path: str, mounts: dict[str, list[str]]) -> bool:
    """Whether the mount ``path`` is on (the deepest mount point above it) is read-only."""
    above = [m for m in mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return "ro" in mounts[max(above, key=len)]


class RecordsItsBirth(gym.Env):
    """An env that, when built, writes what its process was born as (gym_fork's record
    of its birth, as env code can read it) and what /proc says of it, to
    ``record_dir/<pid>.json``: also from the warm parent's throw-away build."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, record_dir: str | None = None) -> None:
        if record_dir is not None:
            from gym_fork.system import birth

            record = {"born": birth.born, **measured("self")}
            with open(os.path.join(record_dir, f"{os.getpid()}.json"), "w") as f:
                json.dump(record, f)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}

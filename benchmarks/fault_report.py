"""Time to detect each fault and attack of docs/reliability.md, measured from inside a
sandbox (a hostile or broken env does it) on the process host.

    .venv/bin/python benchmarks/fault_report.py

Prints one row per fault: what the caller got and how long after the fault it got it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv


class Saboteur(gym.Env):
    """Steps normally until told (through ``plan``) to misbehave in its next step."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.plan = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        plan, self.plan = self.plan, None
        if plan == "exception":
            raise RuntimeError("broken env")
        if plan == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if plan == "sigsegv":
            ctypes.string_at(0)
        if plan == "hang":
            time.sleep(3600)
        if plan == "scribble_ring":
            scribble("gym_fork-sub-env", 0xFF)
        if plan == "huge_info":
            return np.zeros(2, np.float32), 0.0, False, False, {"blob": b"x" * (64 << 20)}
        return np.zeros(2, np.float32), 0.0, False, False, {}


def scribble(name_part: str, value: int) -> None:
    """Overwrite the control blocks of every channel this sandbox holds."""
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if name_part in target:
            fd = int(entry)
            with mmap.mmap(fd, os.fstat(fd).st_size) as view:
                view[0:64] = bytes([value]) * 64


def measure(plan: str, **kwargs) -> tuple[str, float]:
    envs = ForkVectorEnv([Saboteur, Saboteur], envs_per_worker=1, lineage_log=False, **kwargs)
    try:
        envs.reset(seed=0)
        envs.set_attr("plan", [plan, None])
        calls = [lambda: envs.step(np.array([0, 0])), lambda: envs.reset(seed=1)]
        outcome, elapsed = "no error", 0.0
        for k, call in enumerate(calls):  # the fault shows at the step, or the next call
            started = time.perf_counter()
            try:
                call()
            except BaseException as exc:  # the row reports whatever the caller got
                elapsed = time.perf_counter() - started
                outcome = type(exc).__name__ + (" (at the next call)" if k else "")
                break
            elapsed = time.perf_counter() - started
        try:
            envs.reset(seed=2)
            envs.step(np.array([0, 0]))
            outcome += "; reset() recovers"
        except BaseException as exc:
            outcome += f"; reset() failed: {type(exc).__name__}"
        return outcome, elapsed
    finally:
        envs.close(terminate=True)


def main() -> None:
    rows = [
        ("exception in step", "exception", {}),
        ("SIGKILL in step", "sigkill", {}),
        ("SIGSEGV in step", "sigsegv", {}),
        ("hang in step, timeout=1", "hang", {"timeout": 1.0}),
        ("scribbled ring control block", "scribble_ring", {"timeout": 5.0}),
        ("64 MiB info (fragmented reply)", "huge_info", {}),
    ]
    print(f"{'fault (from inside the sandbox)':40} {'time to detect':>15}  outcome")
    for label, plan, kwargs in rows:
        outcome, elapsed = measure(plan, **kwargs)
        print(f"{label:40} {elapsed * 1000:12.1f} ms  {outcome}")


if __name__ == "__main__":
    main()

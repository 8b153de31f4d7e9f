"""A stopped sandbox: the controller notices, says who, resumes it, and the vector env
keeps working.

Every sandbox of a tree runs as uid 0 in one pid namespace. Where Landlock scopes signals
(Linux 6.12+) a sandbox cannot stop its siblings or the idle sandboxes any more
(:func:`test_a_sandbox_cannot_stop_its_siblings`); a sandbox can still stop itself (a
buggy env, a debugger) and, without Landlock, its siblings. A stopped process passes a
pidfd liveness check; each test here hung (or failed without naming anyone) before the
controller read the waited-for sandbox's state. Every test is bounded by a watchdog: a
hang fails it instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import signal
import threading
import time
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv, SubEnvCrashed
from tests.helpers import _descendants, alive, children_by_parent, wait_until, watchdog

pytestmark = pytest.mark.process_only


def _state(pid: int) -> str:
    """A process's state letter, from /proc (of the tree, inside a sandbox)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def siblings() -> list[int]:
    """Inside a sandbox: the other live children of its warm parent (the sandboxes of
    the tree and the idle ones), found in the tree's own /proc."""
    me = os.getpid()
    return [pid for pid in children_by_parent().get(os.getppid(), []) if pid != me]


def _keep_stopping(targets: list[int], times: int, seconds: float) -> None:
    """Stop each target again whenever it runs, ``times`` times each at most."""
    count = dict.fromkeys(targets, 0)
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(n < times for n in count.values()):
        for pid in targets:
            state = _state(pid)
            if state in ("Z", "X"):
                count[pid] = times  # gone (killed): done with it
            elif count[pid] < times and state not in ("T", "t"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                count[pid] += 1
        time.sleep(0.005)


class StopperEnv(gym.Env):
    """A plain env that, told so, SIGSTOPs itself or the other sandboxes in ``step``.

    ``mode``: "stop_once" stops itself once; "keep_stopping" stops itself again whenever
    it runs (3 times, from a thread); "stop_siblings" tries to stop every other sandbox
    of its tree (idle ones among them) and records what the kernel said in
    ``refusals``. ``slow``: seconds a step works (in small sleeps, so that a resumed
    step still takes about that long)."""

    observation_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self.mode = None
        self.slow = 0.0
        self.stopped: list[int] = []
        self.refusals: list[str] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        mode = self.mode
        if mode in ("stop_once", "keep_stopping"):
            self.mode = None
        targets = siblings() if mode == "stop_siblings" else [os.getpid()] if mode else []
        if mode == "stop_siblings":
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    self.stopped = [*self.stopped, pid]
                except OSError as exc:
                    self.refusals = [*self.refusals, errno.errorcode.get(exc.errno, "?")]
        elif mode == "keep_stopping":
            threading.Thread(target=_keep_stopping, args=(targets, 3, 30.0), daemon=True).start()
        if mode == "stop_once":
            self.stopped = [*self.stopped, *targets]
            os.kill(os.getpid(), signal.SIGSTOP)
        for _ in range(round(self.slow / 0.01)):
            time.sleep(0.01)
        return np.zeros(2, np.float32), 0.0, False, False, {}


def stopper():
    return StopperEnv()


ACTIONS = np.zeros(2, dtype=np.int64)


@contextlib.contextmanager
def vector_env(*args, **kwargs):
    with closing_on_error(ForkVectorEnv(*args, **kwargs)) as envs:
        yield envs


@contextlib.contextmanager
def closing_on_error(envs):
    """Close ``envs`` after the block; kill its sandboxes at once if the block failed
    (a stopped sandbox would not answer a close)."""
    try:
        yield envs
    except BaseException:
        envs.close(terminate=True)
        raise
    envs.close()


@pytest.mark.slow  # 2.1 s here
def test_a_sibling_stopped_once_is_resumed_named_and_the_step_returns(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "0")
    with vector_env([stopper] * 2, envs_per_worker=1, lineage_log=False) as envs:
        envs.reset(seed=0)
        victim = envs.worker_pids[1]
        envs.set_attr("slow", [0.0, 0.3])
        envs.set_attr("mode", [None, "stop_once"])
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught, watchdog(15):
            warnings.simplefilter("always")
            obs, *_ = envs.step(ACTIONS)
        elapsed = time.monotonic() - start
        assert obs.shape == (2, 2)
        assert elapsed < 6.0, f"took {elapsed:.1f} s"
        notes = [str(w.message) for w in caught if "stopped" in str(w.message)]
        assert notes, [str(w.message) for w in caught]
        note = notes[0]
        assert "sub-env(s) [1]" in note and f"pid {victim}" in note
        assert str(envs.worker_pids[0]) in note  # the only other sandbox of the tree: the suspect
        with watchdog(15):  # it serves on
            envs.set_attr("slow", [0.0, 0.0])
            for _ in range(3):
                obs, *_ = envs.step(ACTIONS)
        assert envs.worker_pids[1] == victim


@pytest.mark.slow  # 4.8 s here
def test_a_sibling_stopped_again_and_again_fails_the_step_naming_it_and_the_suspects(
    monkeypatch,
):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "0")
    with vector_env([stopper] * 2, envs_per_worker=1, lineage_log=False) as envs:
        envs.reset(seed=0)
        pids = list(envs.worker_pids)
        envs.set_attr("slow", [0.0, 0.3])
        envs.set_attr("mode", [None, "keep_stopping"])
        start = time.monotonic()
        with warnings.catch_warnings(), watchdog(20):
            warnings.simplefilter("ignore")
            with pytest.raises(SubEnvCrashed) as info:  # existing handlers catch it
                envs.step(ACTIONS)
        elapsed = time.monotonic() - start
        assert elapsed < 12.0, f"took {elapsed:.1f} s"
        error = info.value
        assert type(error).__name__ == "SubEnvStopped", error
        assert error.indices == [1] and error.pid == pids[1]
        assert error.suspects == [pids[0]]
        assert f"pid {pids[1]}" in str(error) and str(pids[0]) in str(error)
        assert wait_until(lambda: not alive({pids[1]}), 2.0)  # killed, to be replaced
        with watchdog(20):
            obs, _ = envs.reset(seed=1)  # a fresh sandbox for sub-env 1
            assert obs.shape == (2, 2)
            for _ in range(3):
                envs.step(ACTIONS)
        assert envs.worker_pids[0] == pids[0] and envs.worker_pids[1] != pids[1]


@pytest.mark.slow  # 1.6 s here
def test_timeout_errors_name_the_tree_and_who_is_stopped(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "0")
    with vector_env([stopper] * 2, envs_per_worker=1, timeout=1.0, lineage_log=False) as envs:
        envs.reset(seed=0)
        pids = list(envs.worker_pids)
        envs.set_attr("slow", [0.0, 0.3])
        envs.set_attr("mode", [None, "stop_once"])
        # An explicit wait's timeout (as AsyncVectorEnv: nothing is killed) ...
        envs.step_async(ACTIONS)
        with watchdog(15), pytest.raises(multiprocessing.TimeoutError) as info:
            envs.step_wait(timeout=0.3)
        assert not isinstance(info.value, SubEnvCrashed)
        lines = str(info.value).splitlines()
        assert [line for line in lines if f"pid {pids[0]}" in line and "not stopped" in line]
        assert [line for line in lines if f"pid {pids[1]}" in line and "STOPPED" in line]
        assert alive(pids) == set(pids)
        # ... and the vector env's own (the one that did not answer is killed), while the
        # victim is still stopped: both name every sandbox of the tree and its state.
        with watchdog(15), pytest.raises(SubEnvCrashed) as info:
            envs.step(ACTIONS)
        assert info.value.indices == [1]
        lines = str(info.value).splitlines()
        assert [line for line in lines if f"pid {pids[0]}" in line and "not stopped" in line]
        assert [line for line in lines if f"pid {pids[1]}" in line and "STOPPED" in line]
        with watchdog(15):
            envs.reset(seed=1)  # a fresh sandbox for sub-env 1
            envs.step(ACTIONS)
        assert envs.worker_pids[0] == pids[0] and envs.worker_pids[1] != pids[1]


def test_a_stopped_idle_pool_is_skipped_and_resets_keep_working(monkeypatch):
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "2")
    one = np.zeros(1, dtype=np.int64)
    envs = ForkVectorEnv.from_parent(stopper, 1, lineage_log=False)
    with closing_on_error(envs):
        host_pid = envs.sandboxes.host.pid
        envs.reset(seed=0)  # a second spawn request: from now on the pool is kept full

        def idle() -> set[int]:
            return alive(_descendants(host_pid) - set(envs.worker_pids))

        def idle_running() -> set[int]:
            return {pid for pid in idle() if _state(pid) not in ("T", "t")}

        with warnings.catch_warnings(record=True) as caught, watchdog(40):
            warnings.simplefilter("always")
            for seed in range(1, 5):
                assert wait_until(lambda: len(idle_running()) == 2, 5.0)

                def stop_every_idle() -> bool:
                    # Stopped from outside (a sandbox cannot, with Landlock); again for one
                    # the warm parent forked meanwhile (it refills a taken lease 20 ms late).
                    for pid in idle_running():
                        os.kill(pid, signal.SIGSTOP)
                    return not idle_running()

                assert wait_until(stop_every_idle, 2.0)
                start = time.monotonic()
                obs, _ = envs.reset(seed=seed)  # a fresh clone: not from the stopped pool
                elapsed = time.monotonic() - start
                assert obs.shape == (1, 2)
                assert elapsed < 1.0, f"reset {seed} took {elapsed:.1f} s"
                envs.step(one)
        notes = [str(w.message) for w in caught]
        # Never handed a spec: no sandbox of the vector env was found stopped ...
        assert not [n for n in notes if "SIGCONT" in n], notes
        # ... and the warm parent said what it found.
        idle_notes = [n for n in notes if "idle sandbox(es) stopped" in n]
        assert len(idle_notes) == 4, notes
        assert f"pid {envs.sandboxes.host.pid}" in idle_notes[0]


def test_a_sandbox_cannot_stop_its_siblings(monkeypatch):
    from gym_fork.system import landlock

    if landlock.landlock_abi() < landlock.LANDLOCK_MIN_ABI:
        pytest.skip(f"Landlock ABI {landlock.landlock_abi()} < 6: signals are not scoped here")
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "2")
    with vector_env([stopper] * 2, envs_per_worker=1, lineage_log=False) as envs:
        envs.reset(seed=0)
        envs.reset(seed=1)  # a second spawn request: the idle pool fills
        assert "scoped" in envs.isolation["landlock"]
        envs.set_attr("mode", ["stop_siblings", None])
        with watchdog(15):
            envs.step(ACTIONS)
            envs.step(ACTIONS)  # the sibling still answers
        assert envs.get_attr("stopped")[0] == []
        refusals = envs.get_attr("refusals")[0]
        assert refusals and set(refusals) == {"EPERM"}, refusals

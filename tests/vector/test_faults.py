"""Fault injection: one sub-env fails mid-step or mid-reset; the rest keeps working."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv, SubEnvCrashed, SubEnvTimeout, TransportError
from tests.helpers import SpaceEnv, descendants, wait_until

TIMEOUT = 1.0


class FaultyEnv(SpaceEnv):
    """Fails once, the way it is told, at its next step or reset."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=50, trunc_prob=0)
        self.fault = None  # (phase, kind)

    def _maybe_fail(self, phase):
        if self.fault is None or self.fault[0] != phase:
            return
        kind, self.fault = self.fault[1], None
        print(f"sub-env about to fail with {kind}", file=sys.stderr, flush=True)
        if kind == "exception":
            raise RuntimeError(f"injected failure in {phase}")
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sigsegv":
            ctypes.string_at(0)
        if kind == "hang":
            time.sleep(3600)

    def step(self, action):
        self._maybe_fail("step")
        return super().step(action)

    def reset(self, *, seed=None, options=None):
        self._maybe_fail("reset")
        return super().reset(seed=seed, options=options)


EXPECTED = {
    "exception": RuntimeError,
    "sigkill": SubEnvCrashed,
    "sigsegv": SubEnvCrashed,
    "hang": SubEnvTimeout,
}


@pytest.mark.parametrize("phase", ["step", "reset"])
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_one_failing_sub_env(kind, phase):
    envs = ForkVectorEnv([FaultyEnv] * 3, envs_per_worker=1, timeout=TIMEOUT, lineage_log=False)
    branch = None
    try:
        envs.reset(seed=0)
        branch = envs.fork(f"bystander-{kind}-{phase}", indices=[1])
        envs.set_attr("fault", [None, (phase, kind), None])
        start = time.monotonic()
        with pytest.raises(EXPECTED[kind]) as info:
            if phase == "step":
                envs.step(np.array([0, 0, 0]))
            else:
                envs.reset(seed=1)
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT + 2.0, f"took {elapsed:.2f} s to report"
        if kind != "exception":
            assert info.value.indices == [1]
            assert "about to fail" in info.value.args[0]  # the sandbox's last stderr lines
        if kind == "sigsegv":
            assert info.value.exitcode == -signal.SIGSEGV
        # The bystander branch (a clone of the failing sub-env) is unaffected.
        obs, *_ = branch.step(np.array([1]))
        assert obs.shape == (1, 2)
        # A reset restores a fully working vector env.
        obs, _ = envs.reset(seed=2)
        assert obs.shape == (3, 2)
        for _ in range(3):
            obs, rewards, *_ = envs.step(np.array([1, 1, 1]))
        assert obs.shape == (3, 2) and np.all(np.isfinite(rewards))
    finally:
        if branch is not None:
            branch.close()
        envs.close()


def test_an_explicit_wait_timeout_keeps_async_semantics_and_kills_nothing():
    envs = ForkVectorEnv([FaultyEnv] * 2, envs_per_worker=1, timeout=30, lineage_log=False)
    try:
        envs.reset(seed=0)
        pids = envs.worker_pids
        envs.set_attr("fault", [None, ("step", "hang")])
        envs.step_async(np.array([0, 0]))
        import multiprocessing

        with pytest.raises(multiprocessing.TimeoutError) as info:
            envs.step_wait(timeout=0.2)
        assert not isinstance(info.value, SubEnvTimeout)
        assert all(p in descendants() for p in pids)  # nobody was killed
    finally:
        envs.close(terminate=True)


def test_output_is_captured_per_sandbox():
    class Chatty(SpaceEnv):
        def __init__(self):
            super().__init__(spaces.Discrete(3))

        def step(self, action):
            print(f"stepping with {action}")
            print(f"warning {action}", file=sys.stderr)
            return super().step(action)

    envs = ForkVectorEnv([Chatty] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.step(np.array([1, 2]))
        sys.stdout.flush()
        assert wait_until(lambda: "stepping with 2" in envs.sandbox_output(1, "stdout"))
        assert "stepping with 1" not in envs.sandbox_output(1, "stdout")
        assert "warning 1" in envs.sandbox_output(0, "stderr")
    finally:
        envs.close()


def test_a_dead_warm_parent_is_replaced_by_a_cold_launch(tmp_path):
    envs = ForkVectorEnv.from_parent(FaultyEnv, 2, lineage_log=tmp_path / "log.jsonl")
    try:
        envs.reset(seed=0)
        old_parent = envs.sandboxes.host.pid
        workers = envs.worker_pids
        os.kill(old_parent, signal.SIGKILL)
        # Its sandboxes die with it (PR_SET_PDEATHSIG).
        assert wait_until(lambda: not (set(workers) & descendants()), 2.0)
        with pytest.raises(SubEnvCrashed):
            envs.step(np.array([0, 0]))
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 2) and envs.sandboxes.host.pid != old_parent
        envs.step(np.array([0, 0]))
        kinds = [e["event"] for e in envs.lineage.record.events]
        assert "replaced_warm_parent" in kinds
    finally:
        envs.close()


def test_a_sandbox_writing_garbage_into_its_ring_is_named_and_killed():
    envs = ForkVectorEnv([FaultyEnv] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        victim = envs.sandboxes.pool.workers[1]
        # Play a hostile sandbox: scribble over its reply ring's first record header.
        envs.step_async(np.array([0, 0]))
        time.sleep(0.2)
        region = victim.channel.inbox
        base = ctypes.addressof(ctypes.c_char.from_buffer(victim.channel.region.map))
        ctypes.memmove(base + region.capacity + 192 + 0, b"\xde\xad\xbe\xef", 4)
        with pytest.raises(TransportError, match=r"sub-env\(s\) \[1\]"):
            envs.step_wait()
        envs.reset(seed=1)
        envs.step(np.array([0, 0]))
    finally:
        envs.close()


def test_interpreter_exit_without_close_cleans_up():
    code = textwrap.dedent(
        """
        import gymnasium as gym
        from gym_fork import ForkVectorEnv
        envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")] * 2, envs_per_worker=1,
                             lineage_log=False)
        envs.reset(seed=0)
        print(envs.sandboxes.host.pid, *envs.worker_pids, flush=True)
        # no close()
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stderr

    def gone():
        return all(not os.path.exists(f"/proc/{p}") for p in pids)

    assert wait_until(gone, 2.0)

"""Fault injection: one sub-env fails mid-step or mid-reset; the rest keeps working."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

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


@pytest.mark.slow  # 2.9 s here
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


class RaisingEnv(SpaceEnv):
    """Raises at step: ValueError for action 1, KeyError for action 2."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(3), max_len=50, trunc_prob=0)

    def step(self, action):
        if action == 1:
            raise ValueError("bad action")
        if action == 2:
            raise KeyError("other")
        return super().step(action)


def _failing_step(actions, caplog=None):
    """Step 16 RaisingEnvs with ``actions``: the raised exception and the error lines
    logged (every warning recorded, none deduplicated)."""
    envs = ForkVectorEnv([RaisingEnv] * 16, lineage_log=False)
    try:
        envs.reset(seed=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(Exception) as info:
                envs.step(np.array(actions))
        # The vector env keeps working after it.
        obs, *_ = envs.step(np.zeros(16, dtype=np.int64))
        assert obs.shape == (16, 2)
    finally:
        envs.close()
    return info.value, [str(w.message) for w in caught if "ERROR" in str(w.message)]


def test_one_error_in_16_sub_envs_is_one_line_naming_them():
    exc, lines = _failing_step([1] * 16)
    assert len(lines) == 1, lines
    assert "ValueError: bad action (sub-envs 0-15;" in lines[0]
    assert "Traceback" not in lines[0]
    assert isinstance(exc, ValueError) and exc.gym_fork_index == 15
    # Every sub-env's traceback is still on the exception.
    assert sorted(exc.gym_fork_tracebacks) == list(range(16))
    for index, trace in exc.gym_fork_tracebacks.items():
        assert "in step" in trace and "ValueError: bad action" in trace, index
    assert sorted(exc.gym_fork_errors) == list(range(16))
    notes = "\n".join(exc.__notes__)
    assert "the same error in sub-envs 0-15" in notes and "Traceback" in notes


def test_two_distinct_errors_are_two_lines_and_both_tracebacks_are_on_the_exception():
    actions = [1] * 16
    actions[4:7] = [2, 2, 2]
    actions[12] = 2
    exc, lines = _failing_step(actions)
    assert len(lines) == 2, lines
    assert "ValueError: bad action (sub-envs 0-3, 7-11, 13-15;" in lines[0]
    assert "KeyError: 'other' (sub-envs 4-6, 12)" in lines[1]
    assert isinstance(exc, ValueError) and exc.gym_fork_index == 15
    assert "KeyError: 'other'" in exc.gym_fork_tracebacks[12]
    # The other distinct error's traceback is quoted in a note of the raised one.
    notes = "\n".join(exc.__notes__)
    assert "KeyError: 'other' (sub-envs 4-6, 12); sub-env 4's traceback:" in notes
    assert "raise KeyError" in notes


def test_every_traceback_is_logged_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="gym_fork")
    exc, _lines = _failing_step([1] * 8 + [2] * 8)
    records = [
        r for r in caplog.records if r.name.startswith("gym_fork") and "traceback" in r.getMessage()
    ]
    assert len(records) == 16
    for index, record in enumerate(records):
        message = record.getMessage()
        assert record.levelno == logging.DEBUG
        assert message.startswith(f"sub-env {index} raised")
        assert ("raise ValueError" if index < 8 else "raise KeyError") in message
    assert isinstance(exc, KeyError)


def test_a_sandbox_cannot_put_control_characters_into_the_summary_line():
    from gym_fork.vector.faults import errors_exception

    record = {
        "index": 3,
        "type": "ValueError",
        "message": "a\x1b[2Jb\nsecond line",
        "traceback": "t",
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exc = errors_exception([record], trusted=False)
    (line,) = [str(w.message) for w in caught]
    assert "\x1b[2J" not in line and "second line" not in line
    assert "ValueError: a\\x1b[2Jb (sub-env 3)" in line
    assert isinstance(exc, ValueError)

"""Sandbox output capture never blocks the controller (hosts/output.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from gym_fork.hosts.output import _Echo

LOUD_CONTROLLER = textwrap.dedent(
    """
    import os, sys
    import gymnasium as gym
    import numpy as np
    from gym_fork import ForkVectorEnv

    class LoudEnv(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,))
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            sys.stdout.write("x" * 200_000 + "\\n")
            sys.stdout.flush()
            return np.zeros(2, np.float32), 0.0, False, False, {}

    envs = ForkVectorEnv([LoudEnv, LoudEnv], envs_per_worker=1, timeout=20)
    envs.reset(seed=0)
    for _ in range(40):  # 16 MB through a stdout nobody reads
        envs.step(np.array([0, 1]))
    envs.close()
    with open(sys.argv[1], "w") as f:
        f.write("done")
    os._exit(0)
    """
)


@pytest.mark.slow  # 1.1 s here
def test_a_stalled_controller_stdout_blocks_neither_step_nor_close(tmp_path):
    marker = tmp_path / "done"
    # stdout is a pipe this test never reads: it fills after 64 KiB.
    proc = subprocess.Popen(
        [sys.executable, "-c", LOUD_CONTROLLER, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert marker.exists(), f"the controller hung (exit code {proc.poll()})"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_echo_drops_and_counts_what_a_stalled_reader_cannot_take():
    read_end, write_end = os.pipe()
    echo = _Echo(capacity=256 * 1024)
    try:
        started = time.perf_counter()
        for _ in range(64):
            echo.put(write_end, b"y" * 65536)  # 4 MiB into a pipe nobody reads
        assert time.perf_counter() - started < 1.0
        assert echo.dropped > 0
        assert echo.size <= echo.capacity
    finally:
        os.close(read_end)  # the stuck writer gets EPIPE and moves on
        echo.close()
        os.close(write_end)


def test_sandboxes_dead_before_adoption_keep_their_output_apart():
    """Clones reported reaped have no pid of ours (NO_PID): their output is keyed by the
    sandbox, so tails never mix and each release closes its own pipes."""
    from gym_fork.hosts.base import WorkerSpec
    from gym_fork.hosts.output import OutputCollector
    from gym_fork.hosts.process.ends import SandboxEnds
    from gym_fork.system.linux import NO_PID, ProcessWatch

    output = OutputCollector(echo=False)
    fds_before = set(os.listdir("/proc/self/fd"))
    try:
        handles = []
        for word in (b"first", b"second"):
            ends = SandboxEnds(WorkerSpec("clone", [0], [0]), 1 << 16, output)
            os.write(ends.err_w, word)
            ends.handed_over()
            handles.append(ends.handle(0, ProcessWatch(NO_PID, -1)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and [h.output_tail() for h in handles] != [
            "first",
            "second",
        ]:
            time.sleep(0.01)
        assert [h.output_tail() for h in handles] == ["first", "second"]
        for handle in handles:
            handle.release()
        assert set(os.listdir("/proc/self/fd")) == fds_before
    finally:
        output.close()


def test_forgetting_a_sandbox_closes_all_its_pipes_and_only_its_own():
    """A release drains and closes that sandbox's pipes alone (each release once read
    every sandbox's: a 64-clone fork did 64 x 128 reads), all of them where its key came
    twice (a pid reused before the release), and what another wrote stays its tail."""
    from gym_fork.hosts.output import OutputCollector

    output = OutputCollector(echo=False)
    try:
        pipes = {}
        for key in ("a", "a", "b"):
            out, err = os.pipe(), os.pipe()
            output.watch(key, out[0], err[0])
            pipes.setdefault(key, []).append((out, err))
        os.write(pipes["b"][0][1][1], b"from b")
        for _out, err in pipes["a"]:
            os.write(err[1], b"from a")
        assert output.tail("a") in ("from a", "from afrom a")
        output.forget("a")
        for out, err in pipes["a"]:
            for read_end in (out[0], err[0]):
                with pytest.raises(OSError):
                    os.fstat(read_end)  # closed by the collector
        ((b_out, b_err),) = pipes["b"]
        os.fstat(b_out[0])
        os.fstat(b_err[0])
        assert output.tail("b") == "from b"
        output.forget("b")
        for fd in [w for pairs in pipes.values() for out, err in pairs for w in (out[1], err[1])]:
            os.close(fd)
    finally:
        output.close()


def test_a_stale_event_of_a_forgotten_sandboxs_fd_reused_by_another_is_ignored():
    """The collector's thread may hold an event for a sandbox forgotten meanwhile, whose
    fd number a new sandbox's pipe took: handled as the old one's, it closed the new
    pipe and left it listed, and the new sandbox's release then read (and would close)
    whatever fd took that number next (a reviewer's repro: an unrelated pipe drained)."""
    import threading

    from gym_fork.hosts.output import OutputCollector

    output = OutputCollector(echo=False)
    selector = output._selector
    real_select = selector.select
    paused, resume, armed = threading.Event(), threading.Event(), [False]

    def select(timeout=None):
        events = real_select(timeout)
        if armed[0] and any(key.data and key.data[0] == "a" for key, _ in events):
            armed[0] = False
            paused.set()
            resume.wait(5)  # "a" is forgotten and "b" watched meanwhile
        return events

    selector.select = select
    try:
        (a_out, a_out_w), (a_err, a_err_w) = output.new_pipes()
        output.watch("a", a_out, a_err)
        armed[0] = True
        os.write(a_err_w, b"a's line")
        assert paused.wait(5)
        os.close(a_out_w)
        os.close(a_err_w)
        output.forget("a")
        (b_out, b_out_w), (b_err, b_err_w) = output.new_pipes()
        output.watch("b", b_out, b_err)
        os.write(b_err_w, b"b's line")
        resume.set()
        time.sleep(0.2)  # the thread handles its stale event (or, rightly, ignores it)
        os.fstat(b_out)  # still b's, still open
        os.fstat(b_err)
        assert output.tail("b") == "b's line"
        output.forget("b")
        for fd in (b_out, b_err):
            with pytest.raises(OSError):
                os.fstat(fd)
        os.close(b_out_w)
        os.close(b_err_w)
    finally:
        resume.set()
        output.close()

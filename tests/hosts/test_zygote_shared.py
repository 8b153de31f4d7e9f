"""The zygote kept across processes (``GYM_FORK_ZYGOTE=shared``, opt-in): two
processes of a user fork their warm parents from one zygote, which leaves nothing once
it has been idle (gym_fork/zygote_launch.py, zygote_program.py ``SharedZygote``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gym_fork import zygote_launch
from tests.helpers import alive, marked_processes, wait_until

pytestmark = pytest.mark.process_only

REPO = Path(__file__).resolve().parents[2]

# Builds one vector env, prints the zygotes it knows and waits for a line on stdin.
CONTROLLER = """
import json, sys
import gymnasium as gym
from gym_fork import ForkVectorEnv
from gym_fork.hosts.process import zygote
envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
envs.reset(seed=0)
print(json.dumps([pid for pid, _ in zygote.running()]), flush=True)
sys.stdin.readline()
envs.close()
"""


@pytest.fixture
def runtime_dir():
    """A short XDG_RUNTIME_DIR (a socket path has at most 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="gf", dir="/tmp") as path:
        yield path


def start_controller(runtime: str) -> tuple[subprocess.Popen, list[int]]:
    environ = {k: v for k, v in os.environ.items() if k != "GYM_FORK_HOST"}
    environ.update(GYM_FORK_ZYGOTE="shared", GYM_FORK_ZYGOTE_IDLE="1", XDG_RUNTIME_DIR=runtime)
    process = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER],
        cwd=REPO,
        env=environ,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, "the controller failed"
    return process, json.loads(line)


def finish(process: subprocess.Popen) -> None:
    process.communicate("\n", timeout=60)
    assert process.returncode == 0


@pytest.mark.slow
def test_two_processes_share_one_zygote_which_leaves_nothing_after_its_idle_exit(runtime_dir):
    first, first_zygotes = start_controller(runtime_dir)
    try:
        second, second_zygotes = start_controller(runtime_dir)
        finish(second)
    finally:
        finish(first)
    assert len(first_zygotes) == 1 and second_zygotes == first_zygotes
    assert wait_until(lambda: not alive(first_zygotes), 10.0), "no idle exit"
    directory = Path(runtime_dir, f"gym_fork-{os.geteuid()}")
    assert list(directory.iterdir()) == [], "its socket is left"
    assert not marked_processes(first.pid) and not marked_processes(second.pid)


def test_a_directory_open_to_others_is_not_used(runtime_dir, monkeypatch):
    directory = Path(runtime_dir, f"gym_fork-{os.geteuid()}")
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime_dir)
    assert zygote_launch.connect_shared(zygote_launch.warm_parent_environment()) is None
    assert list(directory.iterdir()) == []

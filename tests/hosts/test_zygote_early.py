"""The zygote starts when a controller first looks up ``gym_fork.ForkVectorEnv``, and
only then: the first vector env uses that zygote, and a process that never builds one
pays nothing and leaves nothing (gym_fork/hosts/process/zygote.py, ``start_early``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gym_fork import zygote_launch
from gym_fork.hosts.process import zygote
from tests.helpers import alive, marked_processes

pytestmark = pytest.mark.process_only

REPO = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter (this one looked up ForkVectorEnv long ago); prints JSON.
# Importing the zygote client starts nothing (only the lookup does).
CHILDREN = """
import json, os
from gym_fork.hosts.process import zygote
def zygotes():
    return [pid for pid, _ in zygote.running()]
def children():
    mine = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                mine.append(int(entry))
    return mine
"""


def run_fresh(code: str, **env: str) -> tuple[dict, int]:
    """``code`` (after CHILDREN) in a new interpreter with zygotes on and the process
    host; its last stdout line as JSON, and its pid."""
    environ = {k: v for k, v in os.environ.items() if k not in ("GYM_FORK_HOST",)}
    environ.update(GYM_FORK_ZYGOTE="1", **env)
    process = subprocess.Popen(
        [sys.executable, "-c", CHILDREN + code],
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), process.pid


def test_import_gym_fork_alone_starts_no_zygote():
    found, pid = run_fresh(
        "import gym_fork, gym_fork.errors\n"
        "print(json.dumps({'zygotes': zygotes(), 'children': children()}))\n"
    )
    assert found == {"zygotes": [], "children": []}
    assert not marked_processes(pid)


def test_the_lineage_command_starts_no_zygote(tmp_path):
    log = tmp_path / "lineage.jsonl"
    events = [
        {"event": "root_ready", "branch_id": "root", "parent_branch_id": None,
         "baseline_id": "0123456789abcdef", "num_envs": 2, "created": 1.0,
         "timings": {}, "pids": [11, 12]},
        {"event": "closed", "branch_id": "root", "closed": 2.0, "exit_status": "closed"},
    ]  # fmt: skip
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    found, pid = run_fresh(
        "from gym_fork.cli import main\n"
        f"code = main(['lineage', {str(log)!r}])\n"
        "print(json.dumps({'code': code, 'zygotes': zygotes(), 'children': children()}))\n"
    )
    assert found == {"code": 0, "zygotes": [], "children": []}
    assert not marked_processes(pid)


@pytest.mark.slow  # 1.1 s here
def test_the_first_vector_env_uses_the_zygote_started_at_the_lookup():
    found, pid = run_fresh(
        "import gymnasium as gym\n"
        "before = zygotes()\n"
        "from gym_fork import ForkVectorEnv\n"
        "early = zygotes()\n"
        "envs = ForkVectorEnv([lambda: gym.make('CartPole-v1')] * 2)\n"
        "envs.reset(seed=0)\n"
        "from tests.helpers import _descendants\n"
        "inside = bool(early) and set(envs.worker_pids) <= _descendants(early[0])\n"
        "after = zygotes()\n"
        "envs.close()\n"
        "print(json.dumps({'before': before, 'early': early, 'after': after,"
        " 'inside': inside}))\n"
    )
    assert found["before"] == [] and len(found["early"]) == 1
    assert found["after"] == found["early"], "the first vector env started a second zygote"
    assert found["inside"], "the first vector env's sandboxes are not of the early zygote"
    assert not alive(found["early"]) and not marked_processes(pid)


def test_an_unused_early_zygote_is_gone_when_its_process_exits():
    found, pid = run_fresh(
        "from gym_fork import ForkVectorEnv\nprint(json.dumps({'early': zygotes()}))\n"
    )
    assert len(found["early"]) == 1
    assert not alive(found["early"]) and not marked_processes(pid)


@pytest.mark.slow  # 1.2 s here
def test_an_unused_early_zygote_gives_way_when_the_start_up_inputs_change():
    found, _ = run_fresh(
        "import gymnasium as gym\n"
        "from gym_fork import ForkVectorEnv\n"
        "early = zygotes()\n"
        "os.environ['OMP_NUM_THREADS'] = '3'  # read at start-up: another zygote key\n"
        "envs = ForkVectorEnv([lambda: gym.make('CartPole-v1')])\n"
        "envs.reset(seed=0)\n"
        "after = zygotes()\n"
        "from tests.helpers import alive\n"
        "print(json.dumps({'early': early, 'after': after, 'alive': list(alive(early))}))\n"
        "envs.close()\n"
    )
    assert len(found["early"]) == 1 and len(found["after"]) == 1
    assert found["after"] != found["early"] and found["alive"] == []


@pytest.fixture
def fresh_key(monkeypatch):
    """A zygote key no zygote has yet, and a controller that has not started one early:
    any start would show as a new zygote."""
    monkeypatch.setenv("PYTHONZYGOTETEST", "early")
    monkeypatch.setattr(zygote_launch, "_started_early", False)
    monkeypatch.delenv("GYM_FORK_HOST", raising=False)
    monkeypatch.setenv("GYM_FORK_ZYGOTE", "1")
    return {pid for pid, _ in zygote.running()}


def test_start_early_starts_one_zygote_once(fresh_key):
    zygote.start_early()
    zygote.start_early()
    started = {pid for pid, _ in zygote.running()} - fresh_key
    assert len(started) == 1


@pytest.mark.parametrize(
    "name, value",
    [("GYM_FORK_SANDBOX", "1"), ("GYM_FORK_HOST", "inline"), ("GYM_FORK_ZYGOTE", "0")],
    ids=["in-a-tree", "another-host", "zygotes-off"],
)
def test_start_early_starts_nothing_where_no_zygote_is_wanted(fresh_key, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    zygote.start_early()
    assert {pid for pid, _ in zygote.running()} - fresh_key == set()

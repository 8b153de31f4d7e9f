"""``gym-fork lineage`` shows "my run" (issue 22, item 3): after two scripts ran, the
default output is the latest one's tree headed by its time and script; ``--last``,
``--since``, ``--root`` and ``--all`` choose others, in text and pictures alike; a
vector env's log rotates by $GYM_FORK_LINEAGE_LOG_MAX_BYTES; bad options are refused
with their reason; a sandbox cannot write the default log; every option has help."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import cli
from gym_fork.lineage.rotation import MAX_BYTES_VAR, rotated_paths

SCRIPT = """\
import gymnasium as gym
import numpy as np
from gym_fork import ForkVectorEnv


def cartpole():
    return gym.make("CartPole-v1")


envs = ForkVectorEnv([cartpole] * 2, branch_id="{name}-root")
envs.reset(seed=0)
branch = envs.fork("{name}-branch", indices=[1], copies=2)
branch.step(np.zeros(2, dtype=np.int64))
branch.close()
envs.close()
"""


def run_script(tmp_path: Path, name: str, log: Path, **env: str) -> None:
    """A controller process of its own: one root (2 CartPole-v1) and one branch."""
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.format(name=name))
    environ = {**os.environ, "GYM_FORK_LINEAGE_LOG": str(log), **env}
    done = subprocess.run(
        [sys.executable, str(script), "--flag", name],
        cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def lineage(capsys, *args: str) -> str:
    assert cli.main(["lineage", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.slow  # 2.4 s here
def test_two_runs_the_default_shows_the_latest_and_options_choose(tmp_path, capsys):
    log = tmp_path / "lineage.jsonl"
    run_script(tmp_path, "first", log)
    between = time.time()
    time.sleep(0.05)  # a process start time has 10 ms ticks
    run_script(tmp_path, "second", log)

    out = lineage(capsys, str(log))
    heading = out.splitlines()[0]
    assert heading.startswith("run ") and "second.py --flag second" in heading, out
    assert "env CartPole-v1" in heading and f"on {socket.gethostname()}" in heading
    assert f"in {tmp_path}" in heading
    assert "second-root baseline=" in out and "second-branch from [1] x2" in out
    assert "first" not in out

    both = lineage(capsys, str(log), "--last", "2")
    assert both.index("first.py") < both.index("first-root") < both.index("second.py")
    assert "second-branch" in both and both.count("\nrun ") == 1  # two headings
    assert lineage(capsys, str(log), "--all") == both

    since = datetime.datetime.fromtimestamp(between).isoformat()
    assert lineage(capsys, str(log), "--since", since) == out
    assert lineage(capsys, str(log), "--since", "1h") == both
    assert lineage(capsys, str(log), "--since", "2999-01-01") == "(no runs since then)\n"
    # --root: the tree holding a branch, under its own run's heading.
    first = lineage(capsys, str(log), "--root", "first-root")
    assert "first.py" in first and "second" not in first
    # The pictures take the same choice: the default is the latest run.
    page = tmp_path / "latest.html"
    lineage(capsys, str(log), "--html", str(page))
    text = page.read_text()
    assert "second.py --flag second" in text and ">second-branch<" in text
    assert "first-root" not in text and "1 run(s): 1 tree(s)" in text


@pytest.mark.slow  # 1.8 s here
def test_a_vector_env_log_rotates_by_the_environment_variable(tmp_path, capsys):
    log = tmp_path / "lineage.jsonl"
    run_script(tmp_path, "first", log)
    one_run = sum(p.stat().st_size for p in [log])
    run_script(tmp_path, "second", log, **{MAX_BYTES_VAR: str(one_run + 100)})
    assert rotated_paths(log)[-1].exists()  # lineage.jsonl.1: the first run's records
    assert log.stat().st_size <= one_run + 100
    both = lineage(capsys, str(log), "--last", "2")
    assert "first-root" in both and "second-branch" in both


def hostile_root(branch_id: str, **run) -> dict:
    return {"event": "root_ready", "branch_id": branch_id, "parent_branch_id": None,
            "num_envs": 1, "created": 50.0, "run": {"started": 50.0, "pid": 7, **run}}  # fmt: skip


def test_bad_options_are_refused_with_their_reason(tmp_path, capsys):
    log = tmp_path / "lineage.jsonl"
    log.write_text(json.dumps(hostile_root("r")) + "\n")
    for args, reason in [
        (["--last", "0"], "'0' is not a positive whole number"),
        (["--since", "soon"], "cannot read 'soon' as a time"),
        (["--root", "r", "--last", "2"], "not allowed with argument"),
        (["--all", "--since", "1h"], "--since goes with --last or alone"),
    ]:
        with pytest.raises(SystemExit):
            cli.main(["lineage", str(log), *args])
        assert reason in capsys.readouterr().err, args


class TriesTheLog(gym.Env):
    """Tries to append to a path from inside its sandbox."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}

    def try_append(self, path: str) -> str:
        try:
            with open(path, "a") as f:
                f.write('{"event": "root_ready", "branch_id": "planted"}\n')
        except OSError as exc:
            return exc.strerror or str(exc)
        return "written"


def test_a_sandbox_cannot_write_the_default_log(monkeypatch):
    """The default log is under the user's state dir ($XDG_STATE_HOME, else
    ~/.local/state), which a sandbox sees read-only (here a state dir outside /tmp,
    which a sandbox sees as its own private copy)."""
    from gym_fork import ForkVectorEnv

    state = tempfile.mkdtemp(prefix="gym_fork-state-", dir="/var/tmp")
    monkeypatch.delenv("GYM_FORK_LINEAGE_LOG")
    monkeypatch.setenv("XDG_STATE_HOME", state)
    envs = ForkVectorEnv([TriesTheLog], envs_per_worker=1)
    try:
        path = str(envs.lineage.tree.log.path)
        assert path == f"{state}/gym_fork/lineage.jsonl"
        if envs.isolation.get("read_only_host") is not True:
            pytest.skip(f"no read-only view of the host here: {envs.isolation.get('missing')}")
        before = Path(path).read_bytes()
        (result,) = envs.call("try_append", path)
        # Read-only view, and (the env runs as an unprivileged uid) not its file either.
        assert result in ("Read-only file system", "Permission denied"), result
        assert Path(path).read_bytes() == before
    finally:
        envs.close()
        for name in os.listdir(f"{state}/gym_fork"):
            os.unlink(f"{state}/gym_fork/{name}")
        os.rmdir(f"{state}/gym_fork")
        os.rmdir(state)


class Parsed(Exception):
    """Raised in place of parsing: carries the parser cli.main built."""


def test_the_help_names_every_option(monkeypatch):
    import argparse

    def capture(self, args=None, namespace=None):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed) as caught:
        cli.main([])
    top = caught.value.args[0]
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {a.dest: a.help for a in commands._choices_actions}
    for name in ("lineage", "demo", "bench", "doctor", "image"):
        assert helps.get(name), name
    for name, parser in [("gym-fork", top)] + [
        (n, commands.choices[n]) for n in ("lineage", "demo", "bench")
    ]:
        assert parser.description, name
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, (name, action.option_strings or action.dest)


KILLED_SCRIPT = """\
import os, signal
import gymnasium as gym
from gym_fork import ForkVectorEnv


def cartpole():
    return gym.make("CartPole-v1")


envs = ForkVectorEnv([cartpole], branch_id="killed-root")
envs.reset(seed=0)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow  # 1.0 s here
def test_a_run_killed_with_sigkill_is_not_shown_open(tmp_path, capsys):
    """Its vector env was never closed, and never will be: the tree says its process
    is gone instead of [open] (a living run's open env stays [open])."""
    log = tmp_path / "lineage.jsonl"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    environ = {**os.environ, "GYM_FORK_LINEAGE_LOG": str(log)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=environ, capture_output=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == -9, done.stderr
    out = lineage(capsys, str(log))
    assert "killed-root baseline=" in out and "[never closed: its process is gone]" in out
    assert "[open]" not in out
    page = tmp_path / "killed.html"
    lineage(capsys, str(log), "--html", str(page))
    assert "never closed: its process is gone" in page.read_text()
    # this process's own open root: [open]
    from gym_fork import ForkVectorEnv

    envs = ForkVectorEnv(
        [lambda: gym.make("CartPole-v1")], branch_id="alive-root", lineage_log=str(log)
    )
    try:
        alive = lineage(capsys, str(log))
        assert "alive-root baseline=" in alive and "[open]" in alive, alive
    finally:
        envs.close()

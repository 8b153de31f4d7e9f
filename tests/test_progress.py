"""Progress bars: silent off a terminal, shown on one or when forced, silenceable."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pytest

from gym_fork import progress

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from gym_fork import progress
    quiet = "quiet" in sys.argv
    with progress.task("counting-sheep", total=3, quiet=quiet) as bar:
        for _ in range(3):
            time.sleep(0.05)
            bar.advance()
    print("done", flush=True)
    """
)


def run_script(env_value: str | None, *, tty: bool, quiet: bool = False) -> tuple[str, str]:
    """Run SCRIPT with GYM_FORK_PROGRESS=env_value; its stderr a pty or a pipe."""
    env = {k: v for k, v in os.environ.items() if k != progress.ENV_VAR}
    if env_value is not None:
        env[progress.ENV_VAR] = env_value
    args = [sys.executable, "-c", SCRIPT, *(["quiet"] if quiet else [])]
    if not tty:
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=follower)
        os.close(follower)
        follower = -1
        chunks = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed its end
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode() if proc.stdout else ""
        proc.stdout.close()
        assert proc.wait(10) == 0
        return out, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)


def test_silent_when_stderr_is_not_a_terminal():
    out, err = run_script(None, tty=False)
    assert out == "done\n"
    assert err == ""


def test_forced_on_prints_even_to_a_pipe():
    out, err = run_script("1", tty=False)
    assert out == "done\n"
    assert "counting-sheep" in err


def test_shown_on_a_terminal():
    _, err = run_script(None, tty=True)
    assert "counting-sheep" in err


@pytest.mark.parametrize(("env_value", "quiet"), [("0", False), (None, True), ("1", True)])
def test_silenced_on_a_terminal(env_value, quiet):
    _, err = run_script(env_value, tty=True, quiet=quiet)
    assert "counting-sheep" not in err


def test_in_process_capture_is_not_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv(progress.ENV_VAR, raising=False)
    assert not progress.enabled()
    with progress.task("quiet-one", total=2) as bar:
        bar.advance(2)
        assert not bar.active
        assert bar.completed == 2
    assert capsys.readouterr().err == ""


def test_forced_in_process(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV_VAR, "1")
    assert progress.enabled()
    assert not progress.enabled(quiet=True)
    items = list(progress.track(range(5), "tracked-items"))
    assert items == [0, 1, 2, 3, 4]
    assert "tracked-items" in capsys.readouterr().err


def test_nested_tasks_share_one_display(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV_VAR, "1")
    with progress.task("outer-task", total=2) as outer:
        with progress.task("inner-task", total=2) as inner:
            inner.advance(2)
        outer.advance(2)
    err = capsys.readouterr().err
    assert "outer-task" in err and "inner-task" in err
    assert progress._DISPLAY.progress is None  # stopped with the last task


def test_a_task_shorter_than_its_delay_draws_nothing(monkeypatch, capsys):
    monkeypatch.setenv(progress.ENV_VAR, "1")
    with progress.task("too-quick", total=1, delay=5.0) as bar:
        bar.advance()
    with progress.task("slow-enough", delay=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "too-quick" not in err
    assert "slow-enough" in err


def test_setting_values(monkeypatch):
    for value, expected in [("0", False), ("off", False), ("1", True), ("yes", True), ("", None)]:
        monkeypatch.setenv(progress.ENV_VAR, value)
        assert progress.setting() is expected

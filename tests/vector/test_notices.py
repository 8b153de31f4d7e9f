"""gym_fork's warnings: Gymnasium's prefixes and level, colour only on a terminal, no
%-formatting of the message (issue 31: colour codes landed in log files)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import pytest

from gym_fork import notices

REPO = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _caught(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_no_colour_codes_unless_stderr_is_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert _caught(lambda: notices.warn("plain")) == ["WARN: plain"]
    assert _caught(lambda: notices.error("plain")) == ["ERROR: plain"]
    monkeypatch.setattr(sys, "stderr", _Terminal())
    (coloured,) = _caught(lambda: notices.warn("plain"))
    assert coloured.startswith("\x1b[") and "WARN: plain" in coloured


def test_a_percent_sign_in_the_message_is_text_not_a_format():
    # Gymnasium's logger.warn("50% done") raises TypeError (msg % ()).
    with pytest.raises(TypeError):
        gym.logger.warn("sandbox says: 50%d done")
    assert _caught(lambda: notices.warn("sandbox says: 50%d done")) == [
        "WARN: sandbox says: 50%d done"
    ]


def test_gymnasiums_logger_level_silences_them():
    level = gym.logger.min_level
    try:
        gym.logger.min_level = gym.logger.ERROR
        assert _caught(lambda: notices.warn("quiet")) == []
        assert _caught(lambda: notices.error("loud")) == ["ERROR: loud"]
        gym.logger.min_level = gym.logger.ERROR + 10
        assert _caught(lambda: notices.error("quiet")) == []
    finally:
        gym.logger.min_level = level


@pytest.mark.process_only
def test_a_scripts_warnings_written_to_a_file_hold_no_escape_codes(tmp_path):
    """As a user runs it: a fresh interpreter whose stderr is a log file, and an env
    that leaves a file in its private /tmp, which close() warns about."""
    script = (
        "import gymnasium as gym\n"
        "from gym_fork import ForkVectorEnv\n"
        "class Leaves(gym.Wrapper):\n"
        "    def reset(self, **kw):\n"
        "        open('/tmp/video.mp4', 'w').write('x')\n"
        "        return super().reset(**kw)\n"
        "envs = ForkVectorEnv([lambda: Leaves(gym.make('CartPole-v1'))])\n"
        "envs.reset(seed=0)\n"
        "envs.close()\n"
    )
    log = tmp_path / "run.log"
    with open(log, "w") as stderr:
        done = subprocess.run(
            [sys.executable, "-c", script],
            stderr=stderr,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=tmp_path,
            timeout=120,
        )
    text = log.read_text()
    assert done.returncode == 0, text
    assert "WARN: gym_fork: a sandbox left 1 file(s)" in text, text
    assert "\x1b" not in text, repr(text)

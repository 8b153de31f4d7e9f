"""A sandbox's output and strings never drive the user's terminal (issue 30, item 6).

A hostile env writes escape sequences (retitle, erase line and CR, OSC 52 clipboard,
bidi override, C1 CSI) to its stdout and stderr and into its exception's type name and
message, then raises, exits or hangs: every error text shows them escaped, the echo to a
terminal shows them escaped, and the echo to a pipe keeps the bytes as written."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap
import time
import tty

import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SubEnvCrashed, SubEnvTimeout
from gym_fork.text_safety import TerminalEscaper, escape_controls
from tests.hosts.terminal_envs import (
    ESCAPED,
    EXIT,
    HANG,
    HOSTILE,
    RAISE,
    RAW_CONTROLS,
    SPLIT_ESCAPED,
    SPLIT_RAW,
    HostileTerminalEnv,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _error_text(exc: BaseException) -> str:
    """Everything Python prints of an exception: type, message, notes."""
    return "\n".join([type(exc).__name__, str(exc), *getattr(exc, "__notes__", [])])


def _assert_no_raw_controls(text: str) -> None:
    found = [c for c in RAW_CONTROLS if c in text]
    assert not found, f"raw control characters {found!r} in {text!r}"


def test_escaping_keeps_newlines_and_tabs_and_sees_characters_split_across_chunks():
    assert escape_controls(HOSTILE + "\n\tok é") == ESCAPED + "\n\tok é"
    data = (HOSTILE + " é\n").encode()
    for cut in range(1, len(data)):
        escaper = TerminalEscaper()
        assert escaper(data[:cut]) + escaper(data[cut:]) == (ESCAPED + " é\n").encode()


@pytest.mark.slow  # 1.8 s here
def test_errors_quote_a_hostile_sandboxs_output_and_strings_escaped():
    envs = ForkVectorEnv([HostileTerminalEnv], timeout=1.0)
    try:
        envs.reset(seed=0)
        with pytest.raises(ValueError) as raised:  # the name and message it sent
            envs.step(np.array([RAISE]))
        text = _error_text(raised.value) + raised.value.remote_traceback
        assert ESCAPED in str(raised.value) and "Hostile\\x1b]0;owned\\x07Error" in text
        _assert_no_raw_controls(text)

        with pytest.raises(SubEnvCrashed) as crashed:  # the stderr it left
            envs.step(np.array([EXIT]))
        assert ESCAPED in str(crashed.value)
        _assert_no_raw_controls(_error_text(crashed.value))

        envs.reset(seed=0)
        with pytest.raises(SubEnvTimeout) as hung:
            envs.step(np.array([HANG]))
        assert ESCAPED in str(hung.value)
        _assert_no_raw_controls(_error_text(hung.value))
    finally:
        envs.close()


CONTROLLER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from gym_fork import ForkVectorEnv
    from tests.hosts.terminal_envs import ECHO, build_hostile

    # Built in the warm parent (it writes there too), stepped in a clone of it.
    envs = ForkVectorEnv.from_parent(build_hostile, 1, timeout=20)
    envs.reset(seed=0)
    envs.step(np.array([ECHO]))
    envs.sandbox_output(0)  # drains what the sandbox wrote (echoed on the way)
    envs.close()
    """
)


def _run_controller(terminal: str) -> tuple[bytes, bytes]:
    """Run CONTROLLER with ``terminal`` ("stdout" or "stderr") on a pseudo-terminal and
    the other stream on a pipe; what each got."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no output processing: the bytes as the controller wrote them
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, terminal: slave}
    env = {**os.environ, "GYM_FORK_PROGRESS": "0", "PYTHONPATH": REPO}
    proc = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER], cwd=REPO, env=env, stdin=subprocess.DEVNULL, **streams
    )
    os.close(slave)
    piped = proc.stderr if terminal == "stdout" else proc.stdout
    assert piped is not None
    pipe = piped.fileno()
    got = {master: b"", pipe: b""}
    try:
        deadline = time.monotonic() + 60
        open_fds = set(got)
        while open_fds and time.monotonic() < deadline:
            for fd in select.select(list(open_fds), [], [], 1.0)[0]:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: every holder of the pty's other end closed it
                    chunk = b""
                if chunk:
                    got[fd] += chunk
                else:
                    open_fds.discard(fd)
        assert proc.wait(10) == 0, got
    finally:
        proc.kill()
        proc.wait()
        piped.close()
        os.close(master)
    return got[master], got[pipe]


@pytest.mark.slow  # 2.4 s here
@pytest.mark.parametrize("terminal", ["stdout", "stderr"])
def test_the_echo_escapes_on_a_terminal_and_keeps_the_bytes_on_a_pipe(terminal):
    on_terminal, on_pipe = _run_controller(terminal)
    # The warm parent's build and the clone's step each wrote it once.
    assert on_terminal.count(ESCAPED.encode()) == 2 and SPLIT_ESCAPED.encode() in on_terminal
    _assert_no_raw_controls(on_terminal.decode())
    assert on_pipe.count(HOSTILE.encode()) == 2 and SPLIT_RAW in on_pipe

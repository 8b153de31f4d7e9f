"""Launching the process host's zygote interpreter; its client is
``gym_fork/hosts/process/zygote.py``, the program ``zygote_program.py``.

Apart from the client because importing anything under ``gym_fork.hosts`` loads the
host interface and its transport first (~70 ms of CPU after gymnasium, measured on 2
loaded cores): the lookup of ``gym_fork.ForkVectorEnv`` launches the zygote with only
what this module imports, then imports the rest while the zygote starts (the zygote,
importing for ~0.3 s, is the first vector env's long pole). The client adopts the
launched zygote when it is imported (:func:`take_early`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from gym_fork import knobs

# Set in every warm parent's environment to the controller's pid, and so inherited by
# every sandbox and whatever it starts: leak checks find a tree's processes by it.
SANDBOX_MARKER = "GYM_FORK_SANDBOX"
ZYGOTE_PROGRAM = "gym_fork.hosts.process.zygote_program"

# A zygote is rebuilt when one of these differs: they are read while an interpreter
# starts or while the modules it pre-imports load. Every other variable a warm parent
# gets afresh with each fork (os.environ), so none of them is in the key: gym_fork sets
# some of its own at run time (GYM_FORK_SCRATCH_BASE), which must not cost a zygote.
_KEY_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "LC_", "LANG")
_KEY_SUFFIXES = ("_NUM_THREADS",)
_KEY_NAMES = ("GYM_FORK_SPIN",)  # read when the ring module is imported

# The directory holding gym_fork.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def enabled() -> bool:
    """Whether warm parents are forked from a zygote (``GYM_FORK_ZYGOTE``, default on)."""
    return knobs.read("GYM_FORK_ZYGOTE") != "0"


def zygote_key(env: dict[str, str]) -> tuple:
    """What a zygote's pre-imported state depends on."""
    chosen = sorted(
        (k, v)
        for k, v in env.items()
        if k.startswith(_KEY_PREFIXES) or k.endswith(_KEY_SUFFIXES) or k in _KEY_NAMES
    )
    ids = (os.getuid(), os.geteuid(), os.getgid(), os.getegid(), tuple(os.getgroups()))
    return (sys.executable, ids, tuple(chosen))


def warm_parent_environment(pass_env: tuple[str, ...] | bool = ()) -> dict[str, str]:
    """The environment of a warm parent: the controller's, less what the allowlist and
    ``pass_env`` leave out (gym_fork/system/environment.py), with gym_fork importable
    and the leak-check marker set."""
    from gym_fork.system.environment import scrubbed  # stdlib only: cheap, and late

    env = scrubbed(os.environ, pass_env)
    env["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env[SANDBOX_MARKER] = str(os.getpid())
    return env


def start_interpreter(module: str, env: dict[str, str]) -> tuple[socket.socket, subprocess.Popen]:
    """``python -m module FD`` with ``env``, and our end of the socket whose other end
    is FD in it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, process


_started_early = False
# (key, our socket, process) of the zygote launched early, until the client adopts it.
_early: tuple[tuple, socket.socket, subprocess.Popen] | None = None


def launch_early() -> bool:
    """Launch the zygote when the controller first looks up ``gym_fork.ForkVectorEnv``
    (or ``make_vec``), for the client to adopt. Only in a controller that would use it:
    not in a process of a tree (a warm parent, a sandbox, what env code starts: they
    have the marker), not with zygotes off or another host by ``GYM_FORK_HOST``; once.
    Returns whether it launched one (errors are left to the first vector env)."""
    global _started_early, _early
    if _started_early or SANDBOX_MARKER in os.environ or not enabled():
        return False
    _started_early = True
    if knobs.read("GYM_FORK_HOST") not in ("", "process"):
        return False
    env = warm_parent_environment()
    try:
        sock, process = start_interpreter(ZYGOTE_PROGRAM, env)
    except OSError:
        return False
    _early = (zygote_key(env), sock, process)
    return True


def take_early() -> tuple[tuple, socket.socket, subprocess.Popen] | None:
    """The zygote launched early and not yet adopted, as (key, socket, process); None
    if there is none."""
    global _early
    early, _early = _early, None
    return early


def _after_fork_in_child() -> None:
    # A fork between the launch and the adoption: the zygote is the parent's.
    global _early
    if _early is not None:
        _early[1].close()
        _early = None


os.register_at_fork(after_in_child=_after_fork_in_child)

"""Import, in the warm parent, the modules that building a sub-env imports.

Without this, every sandbox imports its env's modules (an Atari env: ale_py, cv2, ...)
after its fork, into private pages: 16 sandboxes hold 16 copies. AsyncVectorEnv avoids
that by building the first env in the controller before it forks its workers. The warm
parent does the same with a throw-away sandbox: a fork of it, isolated and confined like
any sandbox, builds ``env_fns[0]``, closes it and reports the names of the modules that
appeared; the warm parent imports them, so that every sandbox forked after shares them
copy-on-write. The env object itself never enters the warm parent (no threads, sockets
or GPU context of a user's env in the process that forks every sandbox).

What the throw-away sandbox reports is treated as untrusted: bounded in size, names
checked, imports that fail are skipped (the sandboxes import on their own then).
Only for trusted sandboxes (the process host's default): the names come from env code.
The controller keeps the names per env_fns, so a later warm parent of the same env_fns
imports them at once (``gym_fork.hosts.process.host.EnvModules``).
``GYM_FORK_PREIMPORT=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import re
import select
import signal
import sys
import time
import warnings
from collections.abc import Callable

MAX_REPORT_BYTES = 4 << 20
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def enabled() -> bool:
    """Whether warm parents pre-import env modules (``GYM_FORK_PREIMPORT``, default on)."""
    return os.environ.get("GYM_FORK_PREIMPORT", "1") != "0"


def budget() -> float:
    """Seconds the throw-away build may take (``GYM_FORK_PREIMPORT_SECONDS``, default 2):
    an env slower to build is not worth waiting for twice; its sandboxes import alone."""
    return float(os.environ.get("GYM_FORK_PREIMPORT_SECONDS", "2"))


def preimport(
    build: Callable[[], object],
    enter_sandbox: Callable[[], None],
    close_in_child: list[int],
    timeout: float,
    cleanup: Callable[[int], None],
) -> list[str]:
    """Build one env in a throw-away sandbox and import what it imported; returns the
    names imported here. ``enter_sandbox`` isolates and confines the child,
    ``close_in_child`` are fds it must not keep (the controller's socket), ``cleanup(pid)``
    removes what the child's sandbox left (scratch, cgroups) once it is reaped."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(build, enter_sandbox, close_in_child, write_end)
    os.close(write_end)
    try:
        report = _read_report(read_end, time.monotonic() + timeout)
    finally:
        os.close(read_end)
        # Not reaped yet (so the pid cannot be anyone else's): kill, then reap.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        cleanup(pid)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return []  # it failed or was too slow: the sandboxes import on their own
    return _import_all(report)


def _child(build, enter_sandbox, close_in_child: list[int], write_end: int) -> None:
    code = 1
    try:
        for fd in close_in_child:
            with contextlib.suppress(OSError):
                os.close(fd)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the env's prints appear once, from its real sandbox
        os.dup2(devnull, 2)
        os.close(devnull)
        enter_sandbox()
        before = set(sys.modules)
        env = build()
        with contextlib.suppress(Exception):
            env.close()
        report = "\n".join(name for name in list(sys.modules) if name not in before).encode()
        view = memoryview(report[:MAX_REPORT_BYTES])
        while view:
            view = view[os.write(write_end, view) :]
        code = 0
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _read_report(fd: int, deadline: float) -> bytes:
    """What the child wrote, until it closes its end, the size bound or the deadline."""
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_REPORT_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""  # too slow: not worth the wait
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def is_module_name(name: str) -> bool:
    """A dotted Python module name (nothing else is ever imported)."""
    return len(name) <= 512 and _MODULE_NAME.fullmatch(name) is not None


def import_all(names: list[str]) -> list[str]:
    """Import each of ``names`` not imported yet (skipping any that fails); returns the
    names asked for that are valid module names (what a later warm parent should import)."""
    valid = [n for n in names if isinstance(n, str) and is_module_name(n) and n != "__main__"]
    fresh = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated aliases warn once, in the sandboxes
        for name in valid:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
            except Exception:
                continue
            fresh = True
    if fresh:
        gc.collect()
        gc.freeze()
    return valid


def _import_all(report: bytes) -> list[str]:
    return import_all(report.decode("utf-8", "replace").split("\n"))

"""Import, in the warm parent, the modules that building a sub-env imports.

Without this, every sandbox imports its env's modules (an Atari env: ale_py, cv2, ...)
after its fork, into private pages: 16 sandboxes hold 16 copies. AsyncVectorEnv avoids
that by building the first env in the controller before it forks its workers. The warm
parent does the same with a throw-away sandbox: a fork of it, isolated and confined like
any sandbox, builds ``env_fns[0]``, closes it and reports the names of the modules that
appeared; the warm parent imports them, so that every sandbox forked after shares them
copy-on-write. The env object itself never enters the warm parent (no threads, sockets
or GPU context of a user's env in the process that forks every sandbox).

What the throw-away sandbox reports is treated as untrusted: bounded in size, and
imported only as gym_fork/system/vetted_imports.py allows (installed packages whose
files are older than the build: code the user installed, never code a sandbox wrote);
imports that fail are skipped (the sandboxes import on their own then).
The controller keeps the names per env_fns, so a later warm parent of the same env_fns
imports them at once (:class:`EnvModules`).
``GYM_FORK_PREIMPORT=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from gym_fork import knobs
from gym_fork.system import vetted_imports
from gym_fork.system.children import fork, kill_child, read_until_closed

MAX_REPORT_BYTES = 4 << 20


def enabled() -> bool:
    """Whether warm parents pre-import env modules (``GYM_FORK_PREIMPORT``, default on)."""
    return knobs.read("GYM_FORK_PREIMPORT") != "0"


def budget() -> float:
    """Seconds the throw-away build may take (``GYM_FORK_PREIMPORT_SECONDS``, default 2):
    an env slower to build is not worth waiting for twice; its sandboxes import alone."""
    return float(knobs.read("GYM_FORK_PREIMPORT_SECONDS"))


def preimport(
    build: Callable[[], object],
    enter_sandbox: Callable[[], None],
    close_in_child: list[int],
    timeout: float,
    cleanup: Callable[[int], None],
) -> tuple[list[str], float] | None:
    """Build one env in a throw-away sandbox and import what it imported; returns the
    names imported here and the time the build started (what they were vetted against),
    or None when the build failed or was too slow (nothing learnt). ``enter_sandbox``
    isolates and confines the child, ``close_in_child`` are fds it must not keep (the
    controller's socket), ``cleanup(pid)`` kills whatever the child left running and
    removes its scratch and cgroups once it is reaped: nothing of the build may run while
    the warm parent vets and imports."""
    # Less a margin: on older kernels file times come from a coarse clock (a few ms
    # behind time.time()), and a file written just after the build began must not pass.
    since = time.time() - 0.05
    read_end, write_end = os.pipe()
    pid = fork()
    if pid == 0:
        os.close(read_end)
        _child(build, enter_sandbox, close_in_child, write_end)
    os.close(write_end)
    try:
        report = read_until_closed(read_end, MAX_REPORT_BYTES, time.monotonic() + timeout)
    finally:
        os.close(read_end)
        kill_child(pid)  # then reap it
        _, status = os.waitpid(pid, 0)
        cleanup(pid)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not report:
        return None  # it failed or was too slow: the sandboxes import on their own
    return vetted_imports.import_all(report.decode("utf-8", "replace").split("\n"), since), since


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


def fork_unsafe() -> str | None:
    """Why this process should no longer fork sandboxes after pre-importing, or None: an
    imported module opened a GPU or loaded the CUDA driver (a CUDA context does not
    survive fork). A thread an import started is allowed, as AsyncVectorEnv's fork
    context allows it (numpy and OpenCV start one at import; a fork keeps only the
    forking thread, and such libraries re-create theirs after it)."""
    try:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                    return "an imported module opened a GPU device"
        with open("/proc/self/maps") as f:
            if any("libcuda.so" in line for line in f):
                return "an imported module loaded the CUDA driver"
    except OSError:
        return "its devices could not be checked"
    return None


class EnvModules:
    """Per controller: the modules that building each set of env_fns imports, as its
    first warm parent found them (:func:`preimport`), so that later
    warm parents of the same env_fns import them at once, without a throw-away build."""

    MAX_ENTRIES = 64
    MAX_NAMES = 20000

    def __init__(self) -> None:
        self._by_digest: dict[bytes, dict[str, Any]] = {}

    def known(self, env_fns: bytes) -> dict[str, Any] | None:
        """{"modules": names, "since": when they were vetted}, None if not learnt."""
        return self._by_digest.get(hashlib.sha256(env_fns).digest())

    def made_unsafe(self, env_fns: bytes, learnt: Any) -> bool:
        """True if the warm parent says its pre-import left it unsafe to fork from (a
        thread, a GPU context); then these env_fns are never pre-imported again."""
        if not (isinstance(learnt, dict) and learnt.get("unsafe")):
            return False
        self._remember(env_fns, {"enabled": False})
        return True

    def _remember(self, env_fns: bytes, entry: dict[str, Any]) -> None:
        if len(self._by_digest) >= self.MAX_ENTRIES:
            self._by_digest.pop(next(iter(self._by_digest)))
        self._by_digest[hashlib.sha256(env_fns).digest()] = entry

    def learn(self, env_fns: bytes, learnt: Any) -> None:
        """Keep what a warm parent imported for ``env_fns`` (its reply, checked)."""
        if not isinstance(learnt, dict) or learnt.get("unsafe"):
            return
        names, since = learnt.get("names"), learnt.get("since")
        if not isinstance(names, list) or len(names) > self.MAX_NAMES:
            return
        if not isinstance(since, float) or not all(
            isinstance(n, str) and vetted_imports.is_module_name(n) for n in names
        ):
            return
        self._remember(env_fns, {"modules": names, "since": since})


env_modules = EnvModules()  # the controller's

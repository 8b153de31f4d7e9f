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
The names come from env code, trusted or not: they select only installed packages whose
files no sandbox can write (every sandbox sees the host read-only) and that are older
than the build, so the warm parent runs code the user installed, never code a sandbox
wrote.
The controller keeps the names per env_fns, so a later warm parent of the same env_fns
imports them at once (``gym_fork.hosts.process.host.EnvModules``).
``GYM_FORK_PREIMPORT=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.abc
import importlib.util
import os
import re
import stat
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from gym_fork.system.children import fork, kill_child, read_until_closed

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
    return import_all(report.decode("utf-8", "replace").split("\n"), since), since


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


def is_module_name(name: str) -> bool:
    """A dotted Python module name, none of whose parts is ``__main__`` (importing
    ``pkg.__main__`` runs a program)."""
    return (
        len(name) <= 512
        and _MODULE_NAME.fullmatch(name) is not None
        and "__main__" not in name.split(".")
    )


def import_all(names: list[str], since: float) -> list[str]:
    """Import each of ``names`` that passes :func:`_wanted`, under :class:`_OnlyOlderFiles`
    (skipping any that fails in any way); returns the names imported here, in order (what
    a later warm parent of the same env_fns may import again, against the same ``since``)."""
    imported = []
    guard = _OnlyOlderFiles(since)
    sys.meta_path.insert(0, guard)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated aliases warn in the sandboxes
            for name in names:
                if not _wanted(name):
                    continue
                try:
                    importlib.import_module(name)
                except BaseException:
                    sys.modules.pop(name, None)
                    continue
                imported.append(name)
    finally:
        sys.meta_path.remove(guard)
    if imported:
        gc.collect()
        gc.freeze()
    return imported


def _wanted(name: object) -> bool:
    """A name worth importing: valid, not imported yet, its parent package imported
    already, and (for a top-level name) an installed package, found in a
    ``site-packages`` or ``dist-packages`` directory or under the user's ``PYTHONPATH``:
    not the standard library (small,
    and some of its modules act when imported: ``antigravity``, ``this``), not a
    script of the user's (a ``train.py`` next to the program runs when imported)."""
    if not isinstance(name, str) or not is_module_name(name) or name in sys.modules:
        return False
    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:
        return False
    if parent:
        return True  # the package was vetted (or imported before); its file is checked
    try:
        spec = importlib.util.find_spec(name)
    except BaseException:
        return False
    return spec is not None and spec.has_location and _installed(spec.origin or "")


class _OnlyOlderFiles(importlib.abc.MetaPathFinder):
    """While the warm parent pre-imports: every module it loads (the names asked for and
    whatever they import) must come from files whose status changed before ``since``.

    The names come from env code running as root: it could write a module where the warm
    parent would find it, or bytecode for an existing one. A write, a rename and ``utime``
    all set a file's ctime, and nothing in a sandbox can set it back (that needs the
    clock: CAP_SYS_TIME). A cached bytecode file newer than ``since`` (the build may have
    written it) is removed, so that the checked source is compiled instead."""

    def __init__(self, since: float) -> None:
        self.since = since

    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.has_location and not self._older(spec.origin, spec.cached):
            raise ImportError(f"{name}: its file changed after the pre-import build started")
        return spec

    def _older(self, origin: str | None, cached: str | None) -> bool:
        if origin is None:
            return False
        try:
            status = os.stat(origin)
        except (OSError, TypeError):
            return False
        if not stat.S_ISREG(status.st_mode) or status.st_ctime >= self.since:
            return False
        if cached and cached != origin:
            try:
                if os.stat(cached).st_ctime >= self.since:
                    os.unlink(cached)
            except FileNotFoundError:
                pass
            except OSError:
                return False
        return True


def _installed(path: str) -> bool:
    """In a ``site-packages``/``dist-packages`` directory, or under a directory the
    user put on ``PYTHONPATH`` (not gym_fork's own root, which the host adds)."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return True
    ours = os.path.realpath(Path(__file__).parents[3])  # the directory holding gym_fork
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        root = os.path.realpath(entry) if entry else ""
        if root and root != ours and real.startswith(root + os.sep):
            return True
    return False

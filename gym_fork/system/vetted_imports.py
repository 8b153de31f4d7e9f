"""Importing modules whose names come from untrusted code (env code, which may run as
root in a sandbox): only valid names of installed packages, never the standard library
or a user's script, and only from files whose status changed before a given time, so
that the importer runs code the user installed, never code a sandbox wrote.

Every sandbox sees the host read-only, so an installed file older than the moment a
sandbox started cannot be one it wrote: a write, a rename and ``utime`` all set a
file's ctime, and nothing in a sandbox can set the clock back (CAP_SYS_TIME).
"""

from __future__ import annotations

import gc
import importlib
import importlib.abc
import importlib.util
import os
import re
import stat
import sys
import warnings
from pathlib import Path

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


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
    a later importer may import again, against the same ``since``)."""
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
    """While :func:`import_all` runs: every module it loads (the names asked for and
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
            raise ImportError(f"{name}: its file changed after {self.since} (the vetting time)")
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
    ours = str(Path(os.path.realpath(__file__)).parents[2])  # the directory holding gym_fork
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        root = os.path.realpath(entry) if entry else ""
        if root and root != ours and real.startswith(root + os.sep):
            return True
    return False

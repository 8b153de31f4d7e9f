"""Envs for tests/system/test_writable_paths.py (importable by reference: env_fns are
pickled), probing writable_paths from inside a sandbox as a careless or hostile env."""

from __future__ import annotations

import os

from gymnasium import spaces

from tests.helpers import SpaceEnv


class WritingEnv(SpaceEnv):
    """A one-number env whose probes write files and plant symlinks where it is told."""

    def __init__(self) -> None:
        super().__init__(spaces.Box(0, 1, (1,)))

    def write(self, path, text="x"):
        """Write ``text`` at ``path`` (relative: against the sandbox's cwd); returns
        "written" or the error's strerror."""
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        except OSError as exc:
            return exc.strerror
        return "written"

    def plant_symlink(self, target, link):
        """Replace ``link`` (a directory or nothing) by a symlink to ``target``."""
        if os.path.isdir(link) and not os.path.islink(link):
            os.rmdir(link)
        os.symlink(target, link)
        return os.readlink(link)

    def write_or_raise(self, path):
        """Write ``path``, raising what the write raises (the user's view of EROFS)."""
        with open(path, "w") as f:
            f.write("x")

    def cwd(self):
        return os.getcwd()

    def exists(self, paths):
        return [os.path.exists(p) for p in paths]

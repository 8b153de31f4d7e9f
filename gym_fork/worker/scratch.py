"""A private scratch directory per sandbox, set as its TMPDIR.

Every sandbox gets its own directory under the host's temp dir, named
``gym_fork-scratch-<warm parent pid>-<pid>-*``; a clone starts with a copy of its
source's scratch (files there are part of the state a fork continues from), so a
branch's writes are invisible to its source and siblings. The worker removes its
directory on close; the controller removes it for a sandbox that died, and the warm
parent sweeps its own prefix when it exits. (Namespaced hosts replace this with a
private /tmp mount.)
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

_BASE_VAR = "GYM_FORK_SCRATCH_BASE"


def base_dir() -> str:
    """The host temp dir scratch directories live in (fixed at the first call)."""
    base = os.environ.get(_BASE_VAR)
    if base is None:
        base = tempfile.gettempdir()
        os.environ[_BASE_VAR] = base
    return base


def enter_scratch(warm_parent: int, copy_from: str | None = None) -> str:
    """Create this process's scratch dir (a copy of ``copy_from``) and make it TMPDIR."""
    path = tempfile.mkdtemp(prefix=f"gym_fork-scratch-{warm_parent}-{os.getpid()}-", dir=base_dir())
    if copy_from and os.path.isdir(copy_from):
        shutil.copytree(copy_from, path, symlinks=True, dirs_exist_ok=True)
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    return path


def remove_scratch(path: str | None) -> None:
    """Delete a scratch dir (missing is fine)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def sweep(warm_parent: int) -> None:
    """Remove every scratch dir of this warm parent's sandboxes (at its exit)."""
    for path in glob.glob(os.path.join(base_dir(), f"gym_fork-scratch-{warm_parent}-*")):
        remove_scratch(path)

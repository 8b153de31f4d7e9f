"""Where sandboxes' scratch directories live, and their removal.

With namespaces a sandbox's /tmp and /dev/shm are its own tmpfs mounts and there is
nothing on the host to remove. Without, each sandbox owns a host directory
``gym_fork-scratch-<warm parent pid>-<pid>-*`` set as its TMPDIR (made by
:func:`gym_fork.system.birth.be_born`). The worker removes its own on
close; the warm parent removes a dead sandbox's when it reaps it, and sweeps all of
them at exit.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from gym_fork import knobs

_BASE_VAR = "GYM_FORK_SCRATCH_BASE"


def base_dir() -> str:
    """The host temp dir scratch directories live in (fixed at the first call)."""
    base = knobs.given(_BASE_VAR)
    if base is None:
        base = tempfile.gettempdir()
        os.environ[_BASE_VAR] = base
    return base


def remove_scratch(path: str | None) -> None:
    """Delete a scratch dir (missing is fine)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def is_scratch_dir(path: object) -> bool:
    """True only for a real scratch directory of gym_fork's (a path a sandbox reports is
    not trusted: anything else is never deleted)."""
    if not isinstance(path, str) or not path:
        return False
    real = os.path.realpath(path)
    base = os.path.realpath(base_dir())
    return (
        os.path.dirname(real) == base
        and os.path.basename(real).startswith("gym_fork-scratch-")
        and os.path.isdir(real)
        and not os.path.islink(path)
    )


def remove_sandbox_scratch(warm_parent: int, pid: int) -> None:
    """Remove the scratch dir of one (dead) sandbox of this warm parent."""
    for path in glob.glob(os.path.join(base_dir(), f"gym_fork-scratch-{warm_parent}-{pid}-*")):
        remove_scratch(path)


def sweep(warm_parent: int) -> None:
    """Remove every scratch dir of this warm parent's sandboxes (at its exit)."""
    for path in glob.glob(os.path.join(base_dir(), f"gym_fork-scratch-{warm_parent}-*")):
        remove_scratch(path)

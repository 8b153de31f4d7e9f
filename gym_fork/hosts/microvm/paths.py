"""Where the microVM host keeps what it builds: kernels and guest images."""

from __future__ import annotations

import os
from pathlib import Path

from gym_fork import knobs


def cache_root() -> Path:
    """``$GYM_FORK_CACHE``, else ``$XDG_CACHE_HOME/gym_fork``, else ``~/.cache/gym_fork``."""
    given = knobs.given("GYM_FORK_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gym_fork"

"""Where the boot templates live on disk, and their removal.

:mod:`.template_cache` writes and reads the entries; this module only knows their
directory and name suffix, so that the image cache (:mod:`.image_cache`), which removes
an image's boot templates with the image, needs nothing above it.
``GYM_FORK_VM_BOOT_CACHE=0`` turns the cache off; a path there moves it (default:
``<cache root>/boot-templates``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from gym_fork import knobs
from gym_fork.hosts.microvm.paths import cache_root

SUFFIX = ".boot"


def enabled() -> bool:
    """False when ``GYM_FORK_VM_BOOT_CACHE`` is ``0``/``off``/``no``."""
    return knobs.read("GYM_FORK_VM_BOOT_CACHE").lower() not in ("0", "off", "no")


def cache_dir() -> Path:
    """Where entries live: ``$GYM_FORK_VM_BOOT_CACHE`` if it is a path, else
    ``<cache root>/boot-templates``."""
    given = knobs.read("GYM_FORK_VM_BOOT_CACHE")
    if os.sep in given:
        return Path(given)
    return cache_root() / "boot-templates"


def clear() -> int:
    """Remove every boot template entry (and leftover temporary files); their count."""
    directory = cache_dir()
    if not directory.is_dir():
        return 0
    removed = 0
    for path in directory.iterdir():
        if path.name.endswith(SUFFIX) or path.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed

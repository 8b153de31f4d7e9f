"""The baseline id: a hash of everything a warm parent's ready point depends on."""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import sys
from importlib import metadata
from typing import Any

PACKAGES = ("gym_fork", "gymnasium", "numpy", "cloudpickle", "msgpack", "cffi")


@functools.cache  # installed versions do not change while a process runs (~5 ms a call)
def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def baseline_inputs(
    *,
    env_identity: str,
    env_ids: list[str | None],
    config: dict[str, Any],
    seed: int | None,
    host: str,
    isolation: dict[str, Any],
    gpu: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON-able inputs of :func:`baseline_id` (also stored in the log)."""
    return {
        "env_identity": env_identity,
        "env_ids": env_ids,
        "packages": {name: _version(name) for name in PACKAGES},
        "python": sys.version.split()[0],
        "platform": {"machine": platform.machine(), "kernel": platform.release()},
        "config": config,
        "seed": seed,
        "host": host,
        "isolation": isolation,
        "gpu": gpu,
    }


def baseline_id(inputs: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``inputs``, first 16 hex digits."""
    canonical = json.dumps(inputs, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]

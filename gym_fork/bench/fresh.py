"""One measurement in a fresh interpreter: run it, read the JSON of its last line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from typing import Any


def last_json(argv: Sequence[str], timeout: float, what: str) -> Any:
    """Run ``argv`` and return the JSON on the last line of its stdout; SystemExit
    naming ``what`` with the tail of its stderr if it failed."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])

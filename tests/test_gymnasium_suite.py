"""Acceptance: Gymnasium's own vector tests with AsyncVectorEnv rebound to ForkVectorEnv.

Needs a Gymnasium git clone (its tests are not in the PyPI sdist, and CI reaches no
git host): set GYMNASIUM_GIT_DIR to it. The last recorded run is in
docs/compatibility.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GIT_DIR = os.environ.get("GYMNASIUM_GIT_DIR")


@pytest.mark.acceptance
@pytest.mark.skipif(
    not GIT_DIR,
    reason="GYMNASIUM_GIT_DIR is not set: Gymnasium's test suite is not on this machine "
    "(see docs/compatibility.md for the last recorded run)",
)
def test_gymnasium_vector_suite_passes_with_fork_vector_env():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "run_gymnasium_suite.py"), GIT_DIR],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

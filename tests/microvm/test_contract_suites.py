"""The process host's conformance and branching suites, re-run against microVMs.

The suites run in a child pytest with GYM_FORK_HOST=microvm, so every ForkVectorEnv
they make (that does not ask for a host) is a microVM one. Tests that need what only
the process host has are skipped there with their reason (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITES = ["tests/vector/test_conformance.py", "tests/vector/test_branching.py"]
ALLOWED_SKIPS = ("host='microvm': ", "GYMNASIUM_GIT_DIR")


@pytest.mark.timeout(1500)
def test_conformance_and_branching_suites_pass_on_the_microvm_host():
    env = dict(os.environ, GYM_FORK_HOST="microvm")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *SUITES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    summary = output.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 30, summary
    for line in output.splitlines():
        if line.startswith("SKIPPED"):
            assert any(reason in line for reason in ALLOWED_SKIPS), line

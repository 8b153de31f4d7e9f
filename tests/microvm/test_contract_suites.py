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
ALLOWED_SKIPS = ("host='microvm': ", "GYMNASIUM_GIT_DIR")
# The branching suite on VMs takes ~4 min here (every fork copies a VM's RAM under TCG);
# tests/microvm/test_microvm.py covers live-fork replay and reseeding in the default run.
FULL = os.environ.get("GYM_FORK_VM_FULL") == "1"
# By default the conformance suite's 28 observation-space cases (~1.7 s each on VMs
# under TCG) run on VMs for a sample of space kinds, each in its transport's mode:
# fixed-size in shared memory (an image, a half-float box, a dict, a tuple) and
# variable-size through the pickled path (text, a sequence, a graph). Every other case
# runs in full; GYM_FORK_VM_FULL=1 runs all of them.
OBSERVATION_SAMPLE = (
    "True-box-u8-image",
    "True-box-f16",
    "True-dict",
    "False-tuple",
    "False-text",
    "False-sequence",
    "False-graph",
)


@pytest.mark.timeout(1500)
def test_the_conformance_suite_passes_on_the_microvm_host():
    if FULL:
        run_on_microvms("tests/vector/test_conformance.py", at_least=40)
        return
    sample = " or ".join(OBSERVATION_SAMPLE)
    select = f"not test_every_observation_space or {sample}"
    run_on_microvms("tests/vector/test_conformance.py", at_least=22, select=select)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.skipif(
    not FULL, reason="the branching suite on VMs runs with GYM_FORK_VM_FULL=1 (~4 min here)"
)
def test_the_branching_suite_passes_on_the_microvm_host():
    run_on_microvms("tests/vector/test_branching.py", at_least=10)


def run_on_microvms(suite: str, at_least: int, select: str | None = None) -> None:
    env = dict(os.environ, GYM_FORK_HOST="microvm")
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", suite]
    done = subprocess.run(
        command + (["-k", select] if select else []),
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
    assert passed >= at_least, summary
    for line in output.splitlines():
        if line.startswith("SKIPPED"):
            assert any(reason in line for reason in ALLOWED_SKIPS), line

"""The type checker passes over the vector layer and the hosts (pyproject.toml's
``[tool.mypy]``), so that a host drifting from the ``Host`` Protocol fails here
(gym_fork/hosts/conformance.py holds each host against it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="needs the test extra (mypy)")
pytestmark = pytest.mark.slow  # runs mypy over the package

ROOT = Path(__file__).resolve().parents[1]
# A cold run takes ~25 s here (2 cores); a machine 3x slower stays well inside this.
TIMEOUT = 240


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One throw-away cache for this module's runs: the second one is incremental."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache_dir: Path, *arguments: str) -> subprocess.CompletedProcess:
    """``python -m mypy`` with the project's configuration, from the repository root."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(cache_dir),
            "--no-color-output",
            "--no-error-summary",
            *arguments,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_vector_and_hosts_type_check(cache_dir):
    proc = _mypy(cache_dir)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert proc.returncode == 0 and not errors, (
        f"mypy found {len(errors)} error(s):\n{proc.stdout[-20000:]}{proc.stderr[-3000:]}"
    )


DRIFTED_HOST = """
from gym_fork.hosts.base import Host
from gym_fork.hosts.inline import InlineHost


class DriftedHost(InlineHost):
    def check_slab(self, nbytes: int, rows: int) -> None:  # type: ignore[override]
        pass


def _check(host: DriftedHost) -> Host:
    return host
"""


def test_a_host_that_drifts_from_the_protocol_is_caught(cache_dir, tmp_path):
    """The conformance check is real: a host whose method no longer has the Protocol's
    signature (its own override error silenced) is still refused where a Host is due."""
    drifted = tmp_path / "drifted_host.py"
    drifted.write_text(DRIFTED_HOST)
    # The other test's options, so that its cache serves gym_fork's modules (an option
    # that changes the cache, --follow-imports=silent, made this a second cold run);
    # only this file's errors are looked at: gym_fork's own are the other test's business.
    proc = _mypy(cache_dir, str(drifted))
    assert proc.returncode != 0, proc.stdout + proc.stderr
    refused = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(str(drifted)) and '(got "DriftedHost", expected "Host")' in line
    ]
    assert refused, proc.stdout[-5000:]
    assert "def check_slab(self, nbytes: int, rows: int) -> None" in proc.stdout, proc.stdout

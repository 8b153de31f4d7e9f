"""The documentation site builds offline with `mkdocs build --strict`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="needs the docs extra (mkdocs)")
pytest.importorskip("material", reason="needs the docs extra (mkdocs-material)")
pytest.importorskip("mkdocstrings_handlers.python", reason="needs mkdocstrings[python]")

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for page in ("guides/sb3", "guides/cleanrl", "branching", "microvm", "compatibility"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "guides" / "api" / "index.html").read_text()
    # The reference really came from the docstrings, not just the headings of the page.
    for text in ("Branch running sub-envs", "SB3 <code>VecEnv</code> over", "Split a vector"):
        assert text in api, text

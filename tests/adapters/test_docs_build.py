"""The documentation site builds offline with `mkdocs build --strict`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the documentation site with mkdocs

pytest.importorskip("mkdocs", reason="needs the docs extra (mkdocs)")
pytest.importorskip("material", reason="needs the docs extra (mkdocs-material)")
pytest.importorskip("mkdocstrings_handlers.python", reason="needs mkdocstrings[python]")

ROOT = Path(__file__).resolve().parents[2]


README_COMMAND = ["mkdocs", "build", "--strict"]  # README.md and docs/guides/install.md


def _build(where: Path) -> subprocess.CompletedProcess:
    """The README's command, exactly (no -q: a warning in strict mode must show and
    fail), run in ``where`` (a copy of the docs and mkdocs.yml: site/ lands there)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    mkdocs = Path(sys.executable).with_name("mkdocs")
    return subprocess.run(
        [str(mkdocs), *README_COMMAND[1:]],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def _copy_site_sources(target: Path) -> Path:
    shutil.copytree(ROOT / "docs", target / "docs")
    shutil.copy(ROOT / "mkdocs.yml", target / "mkdocs.yml")
    return target


def test_the_readme_command_is_the_one_tested():
    readme = (ROOT / "README.md").read_text()
    assert " ".join(README_COMMAND) in readme


def test_site_builds_strict(tmp_path):
    proc = _build(_copy_site_sources(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    site = tmp_path / "site"
    for page in ("guides/sb3", "guides/cleanrl", "branching", "microvm", "compatibility", "scale"):
        assert (site / page / "index.html").is_file(), page
    api = (site / "guides" / "api" / "index.html").read_text()
    # The reference really came from the docstrings, not just the headings of the page.
    # (isolation is inherited from vector/reports.py: the page must still hold it)
    for text in (
        "Branch running sub-envs",
        "SB3 <code>VecEnv</code> over",
        "Split a vector",
        "The isolation this vector env",
    ):
        assert text in api, text


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    sources = _copy_site_sources(tmp_path)
    (sources / "docs" / "orphan.md").write_text("# A page no nav entry points to\n")
    proc = _build(sources)
    assert proc.returncode != 0
    assert "orphan.md" in proc.stdout + proc.stderr

"""Every GYM_FORK_ environment variable is declared once, in gym_fork/knobs.py, and the
page that lists them is that declaration (issue 33)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gym_fork import knobs

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"GYM_FORK_[A-Z0-9_]*[A-Z0-9]")
CODE_DIRS = ("gym_fork", "tests", "benchmarks", "tools", "examples")
PAGE = ROOT / "docs" / "guides" / "knobs.md"


def names_in_code() -> dict[str, set[str]]:
    """Each GYM_FORK_ name in the code, with the files that say it."""
    found: dict[str, set[str]] = {}
    for directory in CODE_DIRS:
        for path in (ROOT / directory).rglob("*.py"):
            for name in NAME.findall(path.read_text()):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_name_the_code_reads_is_declared() -> None:
    undeclared = {n: sorted(f) for n, f in names_in_code().items() if n not in knobs.BY_NAME}
    assert not undeclared, f"declare these in gym_fork/knobs.py: {undeclared}"


def test_every_declared_knob_is_used_outside_its_declaration() -> None:
    used = {n for n, files in names_in_code().items() if files - {"gym_fork/knobs.py"}}
    assert set(knobs.BY_NAME) <= used, f"declared, never read: {set(knobs.BY_NAME) - used}"


def test_each_knob_is_declared_once_with_a_doc_and_a_kind() -> None:
    assert len(knobs.KNOBS) == len(knobs.BY_NAME)
    for knob in knobs.KNOBS:
        assert knob.doc.strip() and knob.kind.strip(), knob.name
        assert knob.audience in ("users", "tuning", "tests", "internal"), knob.name


def test_the_docs_page_is_the_declaration() -> None:
    page = PAGE.read_text()
    table = subprocess.run(
        [sys.executable, "-m", "gym_fork.knobs"], capture_output=True, text=True, check=True
    ).stdout
    assert table in page, (
        "docs/guides/knobs.md's table differs from gym_fork/knobs.py: paste the output of "
        "`python -m gym_fork.knobs`"
    )
    assert table == knobs.markdown()


def test_an_undeclared_name_is_a_key_error_and_a_default_stands_for_unset(monkeypatch) -> None:
    with pytest.raises(KeyError):
        knobs.read("GYM_FORK_" + "NO_SUCH_KNOB")  # built here: the name must not be in the code
    monkeypatch.delenv("GYM_FORK_IDLE_SANDBOXES", raising=False)
    assert knobs.read("GYM_FORK_IDLE_SANDBOXES") == "2"
    assert knobs.given("GYM_FORK_IDLE_SANDBOXES") is None
    monkeypatch.setenv("GYM_FORK_IDLE_SANDBOXES", "0")
    assert knobs.read("GYM_FORK_IDLE_SANDBOXES") == "0"


def test_every_name_the_docs_mention_is_declared() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    mentioned = {
        name: str(page.relative_to(ROOT))
        for page in pages
        for name in NAME.findall(page.read_text())
        if page.name != "benchmarks-notebook.md"  # a dated log: it names knobs since removed
    }
    unknown = {n: p for n, p in mentioned.items() if n not in knobs.BY_NAME}
    assert not unknown, f"pages name knobs gym_fork/knobs.py does not declare: {unknown}"

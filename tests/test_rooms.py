"""Each module is one job: one past ~450 lines says at its top why it stays one file
(CONTRIBUTING.md, "Rooms"), and tests/ mirrors gym_fork/'s rooms."""

from __future__ import annotations

import ast
from pathlib import Path

import gym_fork

ROOT = Path(gym_fork.__file__).resolve().parent
TESTS = Path(__file__).resolve().parent
MOST_LINES = 450
REASON = "(Over ~450 lines"  # how the module docstring starts its reason


def long_modules_without_a_reason() -> list[str]:
    """Modules over MOST_LINES lines whose docstring does not say why."""
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines <= MOST_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if REASON not in docstring:
            missing.append(f"{path.relative_to(ROOT.parent)} ({lines} lines)")
    return missing


def test_every_module_past_450_lines_says_why_at_its_top():
    missing = long_modules_without_a_reason()
    assert not missing, (
        f"split these, or start a paragraph of their docstring with {REASON!r} and the "
        f"reason: {missing}"
    )


def test_the_check_sees_a_long_module_without_a_reason(tmp_path, monkeypatch):
    package = tmp_path / "gym_fork"
    package.mkdir()
    (package / "long.py").write_text('"""One job."""\n' + "x = 1\n" * (MOST_LINES + 1))
    (package / "said.py").write_text(
        f'"""One job.\n\n{REASON}: why.)\n"""\n' + "x = 1\n" * (MOST_LINES + 1)
    )
    monkeypatch.setitem(globals(), "ROOT", package)
    assert long_modules_without_a_reason() == [f"gym_fork/long.py ({MOST_LINES + 2} lines)"]


def rooms_without_tests(package: Path, tests: Path) -> list[str]:
    """The package's rooms (sub-packages) with no folder of tests named after them
    holding at least one test module."""
    rooms = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return sorted(r for r in rooms if not any((tests / r).glob("test_*.py")))


def test_every_room_of_the_package_has_its_test_room():
    missing = rooms_without_tests(ROOT, TESTS)
    assert not missing, f"tests/ has no room with tests for gym_fork/{missing}"


def test_the_check_sees_a_room_without_tests(tmp_path):
    package, tests = tmp_path / "gym_fork", tmp_path / "tests"
    for room in ("kept", "empty", "none"):
        (package / room).mkdir(parents=True)
        (package / room / "__init__.py").write_text("")
    (tests / "kept").mkdir(parents=True)
    (tests / "kept" / "test_it.py").write_text("")
    (tests / "empty").mkdir()
    assert rooms_without_tests(package, tests) == ["empty", "none"]

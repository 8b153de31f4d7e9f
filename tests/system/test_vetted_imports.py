"""Which untrusted module names get imported (gym_fork/system/vetted_imports.py)."""

from __future__ import annotations

import os
import sys
import time

import pytest

import gym_fork
from gym_fork.system import vetted_imports


@pytest.mark.parametrize("name", ["numpy", "gymnasium.envs", "a_b.c9", "_private"])
def test_a_dotted_name_is_a_module_name(name):
    assert vetted_imports.is_module_name(name)


@pytest.mark.parametrize(
    "name",
    ["", "9lives", "a..b", "a.", "os.path/x", "pkg.__main__", "__main__", "a b", "x" * 513],
)
def test_anything_else_is_refused(name):
    assert not vetted_imports.is_module_name(name)


def test_only_installed_packages_are_wanted(tmp_path, monkeypatch):
    (tmp_path / "gf_user_script.py").write_text("raise SystemExit('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # on sys.path, not an installed package
    assert vetted_imports._wanted("gymnasium") is False  # imported already
    assert vetted_imports._wanted("gf_user_script") is False  # a script next to the program
    assert vetted_imports._wanted("antigravity") is False  # the standard library
    assert vetted_imports._wanted(42) is False
    assert vetted_imports._wanted("gf_not_imported_pkg.sub") is False  # its package is not in
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the user's PYTHONPATH: installed
    assert vetted_imports._wanted("gf_user_script") is True


def test_import_all_skips_refused_and_failing_names(tmp_path, monkeypatch):
    (tmp_path / "gf_pre_ok.py").write_text("VALUE = 1\n")
    (tmp_path / "gf_pre_broken.py").write_text("raise RuntimeError('broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    time.sleep(0.05)
    since = time.time()
    try:
        names = ["gf_pre_ok", "gf_pre_broken", "pkg.__main__", "gf_pre_ok"]
        assert vetted_imports.import_all(names, since) == ["gf_pre_ok"]
        assert "gf_pre_broken" not in sys.modules
    finally:
        for name in ("gf_pre_ok", "gf_pre_broken"):
            sys.modules.pop(name, None)


def test_a_file_changed_after_the_build_began_is_not_imported(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    since = time.time() - 0.05
    (tmp_path / "gf_pre_new.py").write_text("VALUE = 1\n")  # written "by the build"
    try:
        assert vetted_imports.import_all(["gf_pre_new"], since) == []
    finally:
        sys.modules.pop("gf_pre_new", None)


def test_gym_forks_own_root_on_pythonpath_is_not_an_installed_place(tmp_path, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.abspath(gym_fork.__file__)))
    monkeypatch.setenv("PYTHONPATH", root)  # the host adds it for the warm parent
    assert not vetted_imports._installed(os.path.join(root, "train.py"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # one the user added
    assert vetted_imports._installed(str(tmp_path / "train.py"))

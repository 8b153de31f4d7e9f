"""Copying a source's private files into a clone (gym_fork/system/snapshot.py) while a
thread of the source's env goes on writing: what is removed after it was listed is not
copied, and the rest is (a clone used to die in its birth on FileNotFoundError)."""

from __future__ import annotations

import os

from gym_fork.system import snapshot


def test_entries_removed_or_replaced_while_they_are_copied_are_skipped(tmp_path, monkeypatch):
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    (source / "kept.txt").write_text("kept")
    (source / "gone.txt").write_text("gone")
    (source / "swapped.txt").write_text("swapped")
    (source / "sub").mkdir()
    (source / "sub" / "deep.txt").write_text("deep")
    os.symlink("kept.txt", source / "link")
    copy_file = snapshot._copy_file
    real_readlink = os.readlink

    def removed_first(src, dst, info):
        if src.endswith("gone.txt"):
            os.unlink(src)  # a thread of the source's, between the listing and the copy
        if src.endswith("swapped.txt"):  # replaced by another kind of entry (a whiteout...)
            os.unlink(src)
            os.mkfifo(src)
        copy_file(src, dst, info)

    def link_removed_first(path, *args, **kwargs):
        if str(path).endswith("link"):
            os.unlink(path)
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(snapshot, "_copy_file", removed_first)
    monkeypatch.setattr(os, "readlink", link_removed_first)
    snapshot.copy_tree(str(source), str(target))
    assert sorted(os.listdir(target)) == ["kept.txt", "sub"]
    assert (target / "kept.txt").read_text() == "kept"
    assert (target / "sub" / "deep.txt").read_text() == "deep"

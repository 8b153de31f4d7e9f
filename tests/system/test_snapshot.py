"""Copying a source's private files into a clone (gym_fork/system/snapshot.py) while a
thread of the source's env goes on writing: what is removed after it was listed is not
copied, and the rest is (a clone used to die in its birth on FileNotFoundError); and an
overlay's upper layer, with what hides the layers below it."""

from __future__ import annotations

import os
import stat

import pytest

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


def test_an_upper_layer_is_copied_with_what_hides_the_layers_below(tmp_path):
    """A clone's copy of its source's upper layer keeps the whiteouts (files the source
    removed from a layer below) and opaque directories (one it removed and made again):
    without them its overlay would show the removed files again. A plain copy skips
    devices and copies no marks."""
    upper, copy, plain = tmp_path / "upper", tmp_path / "copy", tmp_path / "plain"
    for folder in (upper, copy, plain):
        folder.mkdir()
    os.mknod(upper / "removed.txt", stat.S_IFCHR, 0)  # what overlayfs writes for a removal
    os.mknod(upper / "a-real-device", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    (upper / "remade").mkdir()
    (upper / "remade" / "new.txt").write_text("new\n")
    try:
        os.setxattr(upper / "remade", "user.overlay.opaque", b"y")
    except OSError as exc:
        pytest.skip(f"no user.* xattrs on {tmp_path}'s file system: {exc}")

    snapshot.copy_tree(str(upper), str(copy), layer=True)
    snapshot.copy_tree(str(upper), str(plain))

    whiteout = os.lstat(copy / "removed.txt")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert not os.path.lexists(copy / "a-real-device")  # never a device of the source's
    assert os.getxattr(copy / "remade", "user.overlay.opaque") == b"y"
    assert (copy / "remade" / "new.txt").read_text() == "new\n"
    assert sorted(os.listdir(plain)) == ["remade"]
    with pytest.raises(OSError):
        os.getxattr(plain / "remade", "user.overlay.opaque")


def test_a_file_closed_by_a_thread_before_it_is_reopened_is_let_be(tmp_path, monkeypatch):
    """A source's thread may close a /tmp file between the listing of its fds and their
    reopening on its new layer: the reopening's open then gets that very number back
    (the lowest free), and a dup2 onto itself would fail the fork (EINVAL); the file is
    let be, and no fd is left open."""
    held, shown = tmp_path / "held", tmp_path / "shown"  # its new layer shows another
    held.write_text("x")
    shown.write_text("y")
    fd = os.open(held, os.O_RDONLY)  # the lowest free number: free again once closed
    flags_of = snapshot._fd_flags_and_position

    def closed_after_its_flags_were_read(target):
        result = flags_of(target)
        os.close(target)  # the thread closes it right after it was looked at
        return result

    monkeypatch.setattr(snapshot, "_fd_flags_and_position", closed_after_its_flags_were_read)
    assert snapshot.reopen_copied_files([(fd, str(shown))]) == (0, [])
    with pytest.raises(OSError):
        os.fstat(fd)  # closed: the reopening took nothing of it

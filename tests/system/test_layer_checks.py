"""The controller's own look at a source's layer before a freeze
(gym_fork/system/layer_checks.py ``wrote_nothing``): True only for a tmpfs directory
whose ``upper`` is certainly empty; anything else is for the layer helper to judge."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from gym_fork.system.layer_checks import wrote_nothing

pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open") or not os.path.isdir("/dev/shm"), reason="no pidfd or /dev/shm"
)


@pytest.fixture
def layer():
    """A directory on a tmpfs (/dev/shm) with an empty ``upper``, held open by an fd of
    this process, as a source holds its private layer; and our pidfd."""
    path = tempfile.mkdtemp(dir="/dev/shm")
    os.mkdir(os.path.join(path, "upper"))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    pidfd = os.pidfd_open(os.getpid())
    try:
        yield path, fd, pidfd
    finally:
        os.close(fd)
        os.close(pidfd)
        shutil.rmtree(path)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_empty_upper_is_nothing_written(layer):
    _path, fd, pidfd = layer
    before = open_fds()
    assert wrote_nothing(pidfd, fd)
    assert open_fds() == before  # the fd it took and the one it opened are closed


@pytest.mark.parametrize("entry", ["file", "directory", "hidden"])
def test_any_entry_is_something_written(layer, entry):
    path, fd, pidfd = layer
    upper = os.path.join(path, "upper")
    if entry == "directory":
        os.mkdir(os.path.join(upper, "d"))
    else:
        open(os.path.join(upper, ".f" if entry == "hidden" else "f"), "w").close()
    before = open_fds()
    assert not wrote_nothing(pidfd, fd)
    assert open_fds() == before


def test_what_is_not_as_expected_is_left_to_the_helper(layer):
    path, fd, pidfd = layer
    not_tmpfs = os.open(os.path.dirname(os.path.abspath(__file__)), os.O_RDONLY)
    try:
        if os.statvfs(os.path.dirname(os.path.abspath(__file__))).f_fsid == os.statvfs(path).f_fsid:
            pytest.skip("the tests' directory is on /dev/shm's tmpfs")
        assert not wrote_nothing(pidfd, not_tmpfs)  # a layer that is no tmpfs
    finally:
        os.close(not_tmpfs)
    assert not wrote_nothing(pidfd, 10_000)  # no such fd in the source
    os.rmdir(os.path.join(path, "upper"))
    os.symlink("/dev/shm", os.path.join(path, "upper"))  # an upper that leads elsewhere
    assert not wrote_nothing(pidfd, fd)
    os.unlink(os.path.join(path, "upper"))
    assert not wrote_nothing(pidfd, fd)  # no upper at all
    gone = os.pidfd_open(os.getpid())
    os.close(gone)
    assert not wrote_nothing(gone, fd)  # not a pidfd (closed)

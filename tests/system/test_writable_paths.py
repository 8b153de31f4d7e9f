"""``writable_paths`` (issue 30, item 7), tried as a hostile or careless env would: a
symlink a sandbox planted in a directory it could write is never followed by a later
run's bind, and relative paths mean the caller's working directory (where sandboxes
start)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gym_fork import ForkVectorEnv
from gym_fork.system import namespaces as ns
from gym_fork.system import paths as no_follow
from tests.system.writable_envs import WritingEnv

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root here")


def _envs(**kwargs) -> ForkVectorEnv:
    envs = ForkVectorEnv([WritingEnv], lineage_log=False, **kwargs)
    envs.reset(seed=0)
    return envs


def _listing(root) -> dict[str, str]:
    return {
        os.path.join(where, name): open(os.path.join(where, name)).read()
        for where, _, names in os.walk(root)
        for name in names
    }


def test_a_symlink_a_sandbox_planted_is_refused_by_the_next_run(tmp_path):
    runs = tmp_path / "runs"
    victim = tmp_path / "victim"  # stands in for ~/.ssh
    (victim / "inner").mkdir(parents=True)
    (victim / "authorized_keys").write_text("the user's keys\n")
    runs.mkdir()
    os.chmod(runs, 0o777)  # writable whatever uid the sandbox runs as
    before = _listing(victim)
    envs = _envs(writable_paths=[runs])
    try:  # run 1: a hostile env plants links where it may write
        envs.call("plant_symlink", str(victim), str(runs / "exp"))
        envs.call("plant_symlink", str(victim), str(runs / "mid"))
    finally:
        envs.close()
    assert os.path.islink(runs / "exp")
    # Run 2 names the planted link, then a path through it: refused at construction,
    # naming the link and the real path to pass if that is what the user means.
    for asked, link in ((runs / "exp", runs / "exp"), (runs / "mid" / "inner", runs / "mid")):
        with pytest.raises(ValueError, match="symlink") as info:
            ForkVectorEnv([WritingEnv], lineage_log=False, writable_paths=[asked])
        assert repr(str(link)) in str(info.value)
        assert repr(os.path.realpath(asked)) in str(info.value)
    assert _listing(victim) == before


@pytest.fixture
def project(monkeypatch):
    """The caller's working directory, outside /tmp as a project's is (a write under
    /tmp lands in the sandbox's private /tmp, not EROFS)."""
    directory = tempfile.mkdtemp(prefix="gym_fork-project-", dir="/var/tmp")
    os.chmod(directory, 0o777)  # writable whatever uid the sandbox runs as
    monkeypatch.chdir(directory)
    yield Path(directory)
    shutil.rmtree(directory)


def test_relative_paths_are_the_callers_working_directory(project):
    tmp_path = project
    (tmp_path / "runs").mkdir()
    os.chmod(tmp_path / "runs", 0o777)
    envs = _envs(writable_paths=["."])
    try:
        assert envs.call("cwd") == (str(tmp_path),)
        assert envs.call("write", "runs/x.txt", "x") == ("written",)
        assert envs.call("write", "./y.txt", "y") == ("written",)
        assert envs.isolation["writable"] == [str(tmp_path)]
    finally:
        envs.close()
    assert (tmp_path / "runs" / "x.txt").read_text() == "x"
    assert (tmp_path / "y.txt").read_text() == "y"
    envs = _envs(writable_paths=["runs"])
    try:
        assert envs.call("write", "runs/z.txt", "z") == ("written",)
        # The rest of the working directory stays read-only, and the error says how to
        # lift that in a way that works.
        with pytest.raises(OSError) as info:
            envs.call("write_or_raise", "w.txt")
        assert 'writable_paths=["."]' in "".join(getattr(info.value, "__notes__", []))
    finally:
        envs.close()
    assert (tmp_path / "runs" / "z.txt").read_text() == "z"
    assert not (tmp_path / "w.txt").exists()


def test_relative_writes_under_tmp_stay_private_and_a_clone_keeps_off_its_source(
    tmp_path, monkeypatch
):
    """The working directory under /tmp (no writable_paths): relative writes land in the
    sandbox's own /tmp, and a clone's in its own, not in its source's. As root: a clone
    of an unprivileged sandbox cannot write under the directories its source copied up
    from the host's root-owned ones (EOVERFLOW: root is not mapped in its namespace)."""
    monkeypatch.chdir(tmp_path)
    envs = _envs(sandbox_user="root")
    try:
        assert envs.call("write", "source.txt") == ("written",)
        clone = envs.fork("clone", indices=[0])
        try:
            assert clone.call("write", "clone.txt") == ("written",)
            assert clone.call("exists", ["source.txt", "clone.txt"]) == ([True, True],)
        finally:
            clone.close()
        assert envs.call("exists", ["source.txt", "clone.txt"]) == ([True, False],)
    finally:
        envs.close()
    assert list(tmp_path.iterdir()) == []


def test_the_bind_is_taken_from_the_fd_not_the_path(tmp_path):
    """Swap the directory for a symlink between the no-symlink open and the bind (in a
    child with a mount namespace of its own): the bind shows the directory opened."""
    (tmp_path / "asked").mkdir()
    (tmp_path / "asked" / "marker").write_text("asked")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "marker").write_text("elsewhere")
    (tmp_path / "target").mkdir()
    (tmp_path / "by_path").mkdir()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            ns.unshare(ns.CLONE_NEWNS)
            ns.make_mounts_private()
            fd = no_follow.open_directory(str(tmp_path / "asked"))
            os.rename(tmp_path / "asked", tmp_path / "moved")
            os.symlink(tmp_path / "elsewhere", tmp_path / "asked")
            ns.attach_mount(ns.clone_mount_of(fd), str(tmp_path / "target"))
            # What a bind by path would have shown: the symlink's target.
            ns.attach_mount(ns.clone_mount(str(tmp_path / "asked")), str(tmp_path / "by_path"))
            seen = [(tmp_path / d / "marker").read_text() for d in ("target", "by_path")]
            os.write(write, " ".join(seen).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        seen = pipe.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert seen == "asked elsewhere"


def test_the_no_symlink_walk_agrees_with_openat2(tmp_path):
    """The walk (kernels without openat2) refuses what openat2 refuses, naming the link."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "file").write_text("")
    os.symlink(tmp_path / "real", tmp_path / "link")
    os.close(no_follow._walk(str(tmp_path / "real" / "sub")))
    with pytest.raises(no_follow.SymlinkInPath, match=repr(str(tmp_path / "link"))):
        no_follow._walk(str(tmp_path / "link" / "sub"))
    with pytest.raises(no_follow.SymlinkInPath, match=repr(str(tmp_path / "link"))):
        no_follow.open_directory(str(tmp_path / "link" / "sub"))
    with pytest.raises(NotADirectoryError):
        no_follow._walk(str(tmp_path / "file"))
    with pytest.raises(NotADirectoryError):
        no_follow.open_directory(str(tmp_path / "file"))

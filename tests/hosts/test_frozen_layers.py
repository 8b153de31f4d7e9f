"""Frozen /tmp layers (issue 32): a fork copies nothing of the source's workspace, and the
source and its branches still each own their files; tried from inside sandboxes the way
an env (a careless or hostile one) would use /tmp."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from tests.helpers import alive, kill_marked, marked_processes, wait_until, why_no_frozen_layers

WHY_OFF = why_no_frozen_layers()
pytestmark = pytest.mark.skipif(bool(WHY_OFF), reason=f"no frozen layers here: {WHY_OFF}")


class Workspace(gym.Env):
    """An agent's workspace in /tmp, and the ways an env holds on to it."""

    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}

    def write(self, path, text, mode="a"):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, mode) as f:
            f.write(text)

    def read(self, path):
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def listing(self, path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else None

    def remove(self, path):
        if os.path.isdir(path):
            for name in os.listdir(path):
                os.unlink(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)

    def layers(self):
        from gym_fork.system import layer_slots

        return len(layer_slots.layer_paths())

    def hold_log(self):
        self._log = open("/tmp/ws/held.log", "a")  # noqa: SIM115
        self._log.write("before\n")
        self._log.flush()

    def log(self, text):
        self._log.write(text)
        self._log.flush()

    def enter(self, path):
        os.makedirs(path, exist_ok=True)
        os.chdir(path)

    def write_here(self, name, text):
        with open(name, "a") as f:
            f.write(text)


def workspace_env():
    """An env with a workspace of 50 files in /tmp."""
    envs = ForkVectorEnv([Workspace], lineage_log=False)
    try:
        envs.reset(seed=0)
        for i in range(50):
            envs.call("write", f"/tmp/ws/f{i}.txt", f"file {i}\n")
    except BaseException:
        envs.close()
        raise
    return envs


def test_a_branch_starts_from_the_frozen_workspace_and_each_side_writes_its_own():
    envs = workspace_env()
    try:
        branch = envs.fork("b")
        try:
            assert envs.call("layers")[0] == 1 and branch.call("layers")[0] == 1
            for env in (envs, branch):
                assert env.call("read", "/tmp/ws/f49.txt")[0] == "file 49\n"
            branch.call("write", "/tmp/ws/f0.txt", "by the branch\n")
            envs.call("write", "/tmp/ws/f0.txt", "by the source\n")
            envs.call("remove", "/tmp/ws/f1.txt")
            assert branch.call("read", "/tmp/ws/f0.txt")[0] == "file 0\nby the branch\n"
            assert envs.call("read", "/tmp/ws/f0.txt")[0] == "file 0\nby the source\n"
            assert branch.call("read", "/tmp/ws/f1.txt")[0] == "file 1\n"
            assert envs.call("read", "/tmp/ws/f1.txt")[0] is None
            later = envs.fork("c")  # a second freeze: the source's later writes
            try:
                assert later.call("layers")[0] == 2
                assert later.call("read", "/tmp/ws/f0.txt")[0] == "file 0\nby the source\n"
                assert later.call("read", "/tmp/ws/f1.txt")[0] is None
                deeper = branch.fork("d")  # a branch's own freeze
                try:
                    assert deeper.call("layers")[0] == 2
                    assert deeper.call("read", "/tmp/ws/f0.txt")[0] == "file 0\nby the branch\n"
                    branch.call("write", "/tmp/ws/after.txt", "after\n")
                    assert deeper.call("read", "/tmp/ws/after.txt")[0] is None
                finally:
                    deeper.close()
            finally:
                later.close()
            assert branch.call("read", "/tmp/ws/after.txt")[0] == "after\n"
            assert envs.call("read", "/tmp/ws/after.txt")[0] is None
        finally:
            branch.close()
    finally:
        envs.close()


CORES = len(os.sched_getaffinity(0))


@pytest.mark.skipif(
    CORES > 8, reason=f"{CORES} cores: a crowded fork would take {CORES + 1} clones"
)
def test_a_fork_of_more_clones_than_cores_stands_each_on_the_frozen_layer(monkeypatch):
    """With more clones than cores (told of the layer once their source has adopted it),
    every clone waits for the word before its namespaces and stands on the frozen
    workspace, though the freeze comes late, and writes its own /tmp, as one clone
    does."""
    from gym_fork.hosts.process.layers import TmpLayers

    envs = workspace_env()
    try:
        envs.call("write", "/tmp/ws/f3.txt", "before the fork\n")
        freeze = TmpLayers.freeze

        def late(self, source):
            time.sleep(0.3)  # the clones are forked meanwhile: they must wait for it
            return freeze(self, source)

        monkeypatch.setattr(TmpLayers, "freeze", late)
        branch = envs.fork("crowd", copies=CORES + 1)
        monkeypatch.undo()
        try:
            assert branch.call("layers") == (1,) * (CORES + 1)
            assert set(branch.call("read", "/tmp/ws/f3.txt")) == {"file 3\nbefore the fork\n"}
            branch.call("write", "/tmp/ws/mine.txt", "x\n")  # appended: shared, it would grow
            assert branch.call("read", "/tmp/ws/mine.txt") == ("x\n",) * (CORES + 1)
            assert envs.call("read", "/tmp/ws/mine.txt")[0] is None
            envs.call("write", "/tmp/ws/f3.txt", "after\n")
            assert set(branch.call("read", "/tmp/ws/f3.txt")) == {"file 3\nbefore the fork\n"}
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_deleted_file_and_a_replaced_directory_stay_so_in_later_layers():
    """A whiteout and an opaque directory written over a frozen layer hold in the next
    one (every layer's overlay marks them alike: user.* xattrs, char 0/0 whiteouts)."""
    envs = workspace_env()
    try:
        envs.call("write", "/tmp/ws/dir/old.txt", "old\n")
        first = envs.fork("b")
        try:
            envs.call("remove", "/tmp/ws/f7.txt")
            envs.call("remove", "/tmp/ws/dir")
            envs.call("write", "/tmp/ws/dir/new.txt", "new\n")
            second = envs.fork("c")
            try:
                assert second.call("layers")[0] == 2
                for env in (envs, second):
                    assert env.call("read", "/tmp/ws/f7.txt")[0] is None
                    assert env.call("listing", "/tmp/ws/dir")[0] == ["new.txt"]
                assert first.call("read", "/tmp/ws/f7.txt")[0] == "file 7\n"
                assert first.call("listing", "/tmp/ws/dir")[0] == ["old.txt"]
            finally:
                second.close()
        finally:
            first.close()
    finally:
        envs.close()


class Remover(Workspace):
    def bind_socket(self):
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind("/tmp/server.sock")


@pytest.mark.parametrize("copied_because", ["freeze refused", "written after the check"])
def test_what_a_source_removed_over_a_frozen_layer_stays_removed_in_a_copying_branch(
    copied_because, monkeypatch
):
    """A branch that copies its source's writes instead of freezing them (a unix socket
    bound in /tmp refuses the freeze; or the source wrote after its fork's ahead-of-time
    check said there was nothing to freeze) copies the whiteout of a file the source
    removed from a frozen layer and the opaque mark of a directory it made again: the
    removed file and the old directory's files stay gone in the branch."""
    from gym_fork.vector.lifecycle import Sandboxes

    envs = ForkVectorEnv([Remover], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "frozen\n")
        envs.call("write", "/tmp/ws/dir/old.txt", "old\n")
        envs.fork("first").close()
        assert envs.call("layers")[0] == 1
        helper = envs.sandboxes.host.tmp_layers.helper
        if copied_because == "freeze refused":
            envs.call("remove", "/tmp/ws/f.txt")
            envs.call("remove", "/tmp/ws/dir")
            envs.call("write", "/tmp/ws/dir/new.txt", "new\n")
            envs.call("bind_socket")
        else:  # as an env's own thread would, between the check and the FORK
            seen = f"/proc/{envs.worker_pids[0]}/root/tmp/ws"
            real = Sandboxes.open_slabs

            def remove_first(*args, **kwargs):
                layers = envs.sandboxes.host.tmp_layers
                number, _watch = layers.checks[envs.worker_pids[0]]
                helper._answers[number] = helper._answer(number)  # "nothing": it is in
                os.unlink(f"{seen}/f.txt")
                os.unlink(f"{seen}/dir/old.txt")
                os.rmdir(f"{seen}/dir")
                os.mkdir(f"{seen}/dir")
                with open(f"{seen}/dir/new.txt", "w") as f:
                    f.write("new\n")
                return real(*args, **kwargs)

            monkeypatch.setattr(Sandboxes, "open_slabs", remove_first)
        branch = envs.fork("second")
        monkeypatch.undo()
        try:
            assert envs.call("layers")[0] == branch.call("layers")[0] == 1  # copied
            for env in (envs, branch):
                assert env.call("read", "/tmp/ws/f.txt")[0] is None
                assert env.call("listing", "/tmp/ws/dir")[0] == ["new.txt"]
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_source_keeps_writing_its_own_files_through_what_it_held_open():
    """A log held open and a working directory in /tmp: after the freeze the source
    writes its own new layer through them, never the frozen one its branch stands on."""
    envs = workspace_env()
    try:
        envs.call("hold_log")
        envs.call("enter", "/tmp/ws/cwd")
        branch = envs.fork("b")
        try:
            assert envs.call("layers")[0] == 1
            envs.call("log", "source after\n")
            envs.call("write_here", "here.txt", "source here\n")
            branch.call("log", "branch after\n")
            assert envs.call("read", "/tmp/ws/held.log")[0] == "before\nsource after\n"
            assert branch.call("read", "/tmp/ws/held.log")[0] == "before\nbranch after\n"
            assert envs.call("read", "/tmp/ws/cwd/here.txt")[0] == "source here\n"
            assert branch.call("read", "/tmp/ws/cwd/here.txt")[0] is None
        finally:
            branch.close()
    finally:
        envs.close()


class HoldsEndpoints(Workspace):
    def map_shared(self):
        import mmap

        with open("/tmp/ws/mapped", "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open("/tmp/ws/mapped", os.O_RDWR)
        self._map = mmap.mmap(fd, 4096)
        os.close(fd)

    def open_fifo(self):
        os.mkfifo("/tmp/ws/fifo")  # /tmp/ws: the test wrote a file there
        self._fifo = os.open("/tmp/ws/fifo", os.O_RDONLY | os.O_NONBLOCK)

    def bind_socket(self):
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.bind("/tmp/ws/server.sock")
        self._sock.listen()

    def bind_if_asked(self):
        if getattr(self, "binds", False):
            self.bind_socket()

    def _lock(self, how):
        import fcntl

        self._locked = os.open("/tmp/ws/locked", os.O_RDWR | os.O_CREAT, 0o600)
        if how == "flock":
            fcntl.flock(self._locked, fcntl.LOCK_EX)
        else:  # an OFD lock, or a POSIX one (the process's)
            command = fcntl.F_OFD_SETLK if how == "ofd" else fcntl.F_SETLK
            fcntl.fcntl(self._locked, command, bytes(32))  # struct flock: F_RDLCK, whole file

    def lock_flock(self):
        self._lock("flock")

    def lock_ofd(self):
        self._lock("ofd")

    def lock_posix(self):
        self._lock("posix")

    def locks(self):
        with open(f"/proc/self/fdinfo/{self._locked}") as f:
            return sum(line.startswith("lock:") for line in f)

    def connect(self):
        client = socket.socket(socket.AF_UNIX)
        try:
            client.connect("/tmp/ws/server.sock")
            return "connected"
        except OSError as exc:
            return errno.errorcode[exc.errno]
        finally:
            client.close()


@pytest.mark.parametrize(
    "hold", ["map_shared", "open_fifo", "bind_socket", "lock_flock", "lock_ofd", "lock_posix"]
)
def test_what_a_new_tmp_would_break_makes_the_fork_copy_instead(hold):
    """A shared mapping of a /tmp file, a fifo held open, a unix socket bound in /tmp or
    a lock on a /tmp file: no freeze (the source keeps its /tmp; its clients still reach
    its socket; its lock, which its file reopened on a new layer would not have, stays)."""
    envs = ForkVectorEnv([HoldsEndpoints], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "content\n")
        envs.call(hold)
        branch = envs.fork("b")
        try:
            assert envs.call("layers")[0] == 0 and branch.call("layers")[0] == 0
            assert branch.call("read", "/tmp/ws/file.txt")[0] == "content\n"  # copied
            if hold == "bind_socket":
                assert envs.call("connect")[0] == "connected"
            if hold.startswith("lock"):
                assert envs.call("locks")[0] == 1
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_socket_another_sandbox_bound_in_its_own_tmp_does_not_stop_a_freeze():
    """Sandboxes of one tree may share a network namespace, whose unix socket table
    lists every socket bound in it: only the source's own sockets stop its freeze."""
    envs = ForkVectorEnv([HoldsEndpoints] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "content\n")
        envs.set_attr("binds", [True, False])
        envs.call("bind_if_asked")
        with contextlib.closing(envs.fork("b", indices=[1])) as branch:
            assert branch.call("read", "/tmp/ws/file.txt")[0] == "content\n"
            assert branch.call("layers")[0] == 1
        assert envs.call("layers") == (0, 1)  # frozen: sub-env 1 only
        assert envs.call("connect")[0] == "connected"  # sub-env 0's socket is untouched
    finally:
        envs.close()


class Fifos(Workspace):
    def make_fifo(self):
        os.makedirs("/tmp/ws", exist_ok=True)
        os.mkfifo("/tmp/ws/pipe")

    def open_end(self, flags):
        try:
            self._end = os.open("/tmp/ws/pipe", flags | os.O_NONBLOCK)
            return "open"
        except OSError as exc:
            return errno.errorcode[exc.errno]


def test_a_fifo_in_a_frozen_layer_is_no_channel_between_source_and_branch():
    envs = ForkVectorEnv([Fifos], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("make_fifo")
        branch = envs.fork("b")
        try:
            assert branch.call("layers")[0] == 1
            assert envs.call("open_end", os.O_RDONLY)[0] == "open"  # a reader at the source
            # the branch's fifo is another pipe: no reader there
            assert branch.call("open_end", os.O_WRONLY)[0] == "ENXIO"
        finally:
            branch.close()
    finally:
        envs.close()


class PointsElsewhere(Workspace):
    """Puts another directory at the fd number its HELLO gave for its layer."""

    def swap_layer_fd(self, path):
        from gym_fork.system import sandbox_isolation

        number = sandbox_isolation.private_layer_fd()
        other = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        os.dup2(other, number)
        os.close(other)


@pytest.mark.parametrize("elsewhere", ["/dev/shm", "/etc"])
def test_a_source_cannot_point_the_layer_helper_at_another_directory(elsewhere):
    envs = ForkVectorEnv([PointsElsewhere], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "content\n")
        envs.call("write", "/dev/shm/upper/kept.txt", "kept\n")
        envs.call("swap_layer_fd", elsewhere)
        branch = envs.fork("b")
        try:
            assert envs.call("layers")[0] == 0
            assert envs.call("read", "/dev/shm/upper/kept.txt")[0] == "kept\n"
            assert envs.call("listing", "/dev/shm/upper")[0] == ["kept.txt"]
        finally:
            branch.close()
    finally:
        envs.close()


@pytest.mark.parametrize("zygote", ["1", "0"])
def test_the_layer_helper_ends_with_its_host(monkeypatch, zygote):
    """Forked by the controller's zygote where one is ready (ms), else a fresh
    interpreter: either ends when its host closes."""
    monkeypatch.setenv("GYM_FORK_ZYGOTE", zygote)
    envs = workspace_env()
    try:
        branch = envs.fork("b")
        assert branch.call("read", "/tmp/ws/f1.txt")[0] == "file 1\n"
        branch.close()
        helper = envs.sandboxes.host.tmp_layers.helper
        assert helper is not None and helper.alive()
        assert (helper.watch is not None) == (zygote == "1")  # a zygote's child
        assert (helper.process is not None) == (zygote == "0")  # ours
        assert helper.sock.type == socket.SOCK_SEQPACKET  # one message a packet
    finally:
        envs.close()
    assert not helper.alive()


KILLED_CONTROLLER = """
import time
from tests.hosts.test_frozen_layers import workspace_env
envs = workspace_env()
envs.fork("b")
helper = envs.sandboxes.host.tmp_layers.helper
print(helper.watch.pid if helper.watch is not None else helper.process.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.slow  # ~2 s here
@pytest.mark.parametrize("zygote", ["1", "0"])
def test_the_layer_helper_does_not_outlive_a_sigkilled_controller(zygote):
    """A zygote's child is no child of the controller's: EOF on its socket ends it."""
    environ = {**os.environ, "GYM_FORK_ZYGOTE": zygote}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONTROLLER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env=environ,
    )
    try:
        helper = int(proc.stdout.readline())
        assert alive({helper})
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not alive({helper}), 5.0)
        assert wait_until(lambda: not marked_processes(proc.pid), 5.0)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        kill_marked(proc.pid)


class KeepsItsLayer(Workspace):
    """Keeps fds past /tmp's overlay: a dup of its layer's fd, or a file of the layer
    opened for writing through it."""

    def stash_layer(self):
        from gym_fork.system import sandbox_isolation

        self._stash = os.dup(sandbox_isolation.private_layer_fd())
        return self._stash

    def write_through_stash(self, relative, text):
        root = f"/proc/self/fd/{self._stash}"
        frozen = [n for n in os.listdir(root) if n.startswith("frozen-")]
        try:
            with open(f"{root}/{frozen[0]}/{relative}", "w") as f:
                f.write(text)
            return "written"
        except OSError as exc:
            return errno.errorcode[exc.errno]

    def open_for_writing_past_the_overlay(self):
        from gym_fork.system import sandbox_isolation

        layer = sandbox_isolation.private_layer_fd()
        self._raw = open(f"/proc/self/fd/{layer}/upper/ws/file.txt", "a")  # noqa: SIM115

    def close_raw(self):
        self._raw.close()

    def point_layer_fd_at(self, fd):
        from gym_fork.system import sandbox_isolation

        os.dup2(fd, sandbox_isolation.private_layer_fd())


def test_a_frozen_layer_is_read_only_even_through_an_fd_kept_past_the_overlay():
    """The source kept a dup of its layer's fd (so does its branch, by inheritance):
    after the fork neither writes the frozen files through it (the layer's file system
    is read-only: sealed), so neither sees the other's writes."""
    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("stash_layer")
        branch = envs.fork("b")
        try:
            assert branch.call("layers")[0] == 1
            assert envs.call("write_through_stash", "ws/file.txt", "by source\n")[0] == "EROFS"
            assert branch.call("write_through_stash", "ws/new.txt", "by branch\n")[0] == "EROFS"
            assert branch.call("read", "/tmp/ws/file.txt")[0] == "original\n"
            assert envs.call("listing", "/tmp/ws")[0] == ["file.txt"]
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_source_writing_its_layer_past_the_overlay_is_not_forked():
    """A file of its layer open for writing past /tmp's overlay would keep changing the
    frozen layer under its clones: the layer cannot be sealed, the fork fails saying so
    (no clone is made), and so does every later fork of that source."""
    from gym_fork import SubEnvError

    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("open_for_writing_past_the_overlay")
        for _ in range(2):
            with pytest.raises((SubEnvError, RuntimeError), match="not read-only"):
                envs.fork("b")
        assert envs.call("read", "/tmp/ws/file.txt")[0] == "original\n"  # its own view
        envs.call("close_raw")  # nothing writes the frozen layer any more: sealed now
        with contextlib.closing(envs.fork("b")) as branch:
            assert branch.call("read", "/tmp/ws/file.txt")[0] == "original\n"
            branch.call("write", "/tmp/ws/file.txt", "branch\n")
            assert envs.call("read", "/tmp/ws/file.txt")[0] == "original\n"
    finally:
        envs.close()


def test_a_branch_cannot_have_its_sources_live_layer_frozen():
    """The source handed its branch a dup of its live layer's fd; the branch puts it at
    its own layer's fd number and forks: the helper sees that layer is not the branch's
    /tmp (its probe file does not appear there) and freezes nothing of the source's."""
    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/first.txt", "1\n")
        first = envs.fork("b1")  # the source's writes frozen: it writes a new layer now
        try:
            stash = envs.call("stash_layer")[0]
            second = envs.fork("b2")  # nothing new: no freeze; b2 inherits the stash
            try:
                envs.call("write", "/tmp/ws/live.txt", "live\n")
                second.call("point_layer_fd_at", stash)
                third = second.fork("c")
                try:
                    assert second.call("layers")[0] == 1  # no freeze of "its" layer
                    assert envs.call("listing", "/tmp/ws")[0] == ["first.txt", "live.txt"]
                    envs.call("write", "/tmp/ws/new.txt", "new\n")
                    assert envs.call("read", "/tmp/ws/new.txt")[0] == "new\n"
                    assert "new.txt" not in third.call("listing", "/tmp/ws")[0]
                finally:
                    third.close()
            finally:
                second.close()
        finally:
            first.close()
    finally:
        envs.close()


def test_the_helper_seals_at_once_unless_a_file_of_the_layer_is_open_for_writing(monkeypatch):
    """The usual workspace (no file of it held open for writing) is sealed by the layer
    helper within the freeze: no LayerAdopted / LayerSealed round trip. A source holding
    a log open seals only once it has reopened it, and both keep their promises."""
    envs = workspace_env()
    try:
        layers = envs.sandboxes.host.tmp_layers
        late: list[int] = []
        seal = layers.seal

        def counting_seal(source, token):
            late.append(token)
            return seal(source, token)

        monkeypatch.setattr(layers, "seal", counting_seal)
        branches = [envs.fork("a")]
        try:
            assert late == [] and len(layers.swap_ms) == 1
            envs.call("hold_log")
            branches.append(envs.fork("b"))
            first, second = branches
            assert len(late) == 1 and len(layers.swap_ms) == 2
            assert envs.call("layers")[0] == 2
            envs.call("log", "source after\n")
            second.call("log", "branch after\n")
            assert envs.call("read", "/tmp/ws/held.log")[0] == "before\nsource after\n"
            assert second.call("read", "/tmp/ws/held.log")[0] == "before\nbranch after\n"
            assert first.call("read", "/tmp/ws/held.log")[0] is None
            assert first.call("read", "/tmp/ws/f3.txt")[0] == "file 3\n"
        finally:
            for branch in branches:
                branch.close()
    finally:
        envs.close()


class Careless(Workspace):
    """What envs do to /tmp without meaning harm: a thread churning scratch files at its
    top, a working directory deleted under it, a file mapped then deleted (a .so loaded
    from /tmp)."""

    def start_churn(self):
        import threading

        self._churning = True

        def churn():
            i = 0
            while self._churning:
                i += 1
                name = f"/tmp/scratch{i % 8}"
                with contextlib.suppress(OSError):
                    with open(name, "w") as f:
                        f.write("x")
                    os.rename(name, name + "-renamed")
                    os.unlink(name + "-renamed")

        self._churner = threading.Thread(target=churn, daemon=True)
        self._churner.start()

    def stop_churn(self):
        self._churning = False
        self._churner.join()

    def missing(self, count):
        return [k for k in range(count) if not os.path.exists(f"/tmp/round{k}")]

    def work_in_a_deleted_directory(self):
        import tempfile

        path = tempfile.mkdtemp(dir="/tmp")
        os.chdir(path)
        os.rmdir(path)

    def leave(self):
        os.chdir("/")

    def map_then_delete(self):
        """As dlopen maps a library: MAP_PRIVATE, read-only, no fd kept (Python's
        mmap keeps one, which the helper would see)."""
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3
        libc.mmap.argtypes += [ctypes.c_long]
        with open("/tmp/lib.so", "wb") as f:
            f.write(b"\x7fELF" + b"\0" * 4092)
        fd = os.open("/tmp/lib.so", os.O_RDONLY)
        self._map = libc.mmap(None, 4096, 1, 2, fd, 0)  # PROT_READ, MAP_PRIVATE
        os.close(fd)
        os.unlink("/tmp/lib.so")
        assert self._map not in (None, ctypes.c_void_p(-1).value)

    def unmap(self):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        assert libc.munmap(self._map, 4096) == 0


def _fork_past_transient_writers(envs, name):
    """A fork, asked again (at most 3 times) where a thread of the source still held a
    file it opened before the freeze past the helper's patience (a loaded box can
    deschedule it that long): the next fork seals the layer once the file is closed."""
    from gym_fork import SubEnvError

    for attempt in range(3):
        try:
            return envs.fork(f"{name}-{attempt}")
        except (SubEnvError, RuntimeError) as exc:
            if "not read-only" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_a_thread_churning_the_top_of_tmp_loses_no_file_across_forks():
    """Entries a thread removes or renames while the helper moves them are skipped, not
    an error halfway through (that left files in an orphan layer, lost to source and
    branch), and nothing after the new /tmp is mounted fails the freeze."""
    envs = ForkVectorEnv([Careless], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("start_churn")
        try:
            for r in range(12):
                envs.call("write", f"/tmp/round{r}", "r\n")
                with contextlib.closing(_fork_past_transient_writers(envs, f"b{r}")) as branch:
                    assert branch.call("missing", r + 1)[0] == []
                    assert envs.call("missing", r + 1)[0] == []
        finally:
            envs.call("stop_churn")
        assert envs.call("layers")[0] >= 1
    finally:
        envs.close()


def test_a_deleted_working_directory_makes_the_fork_copy_and_pins_nothing():
    """Its deleted inode would keep the frozen layer writable for good: the helper says
    so before it changes anything, the clones copy, and once the source works elsewhere
    its next fork freezes again."""
    envs = ForkVectorEnv([Careless], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/a.txt", "a\n")
        envs.call("work_in_a_deleted_directory")
        with contextlib.closing(envs.fork("b0")) as branch:
            assert branch.call("read", "/tmp/ws/a.txt")[0] == "a\n"
        assert envs.call("layers")[0] == 0  # copied, not frozen
        envs.call("leave")
        envs.call("write", "/tmp/ws/b.txt", "b\n")
        with contextlib.closing(envs.fork("b1")) as branch:
            assert branch.call("read", "/tmp/ws/b.txt")[0] == "b\n"
        assert envs.call("layers")[0] == 1
    finally:
        envs.close()


def test_a_deleted_file_still_mapped_fails_the_fork_until_it_is_unmapped():
    """A private mapping of a deleted /tmp file keeps the frozen layer from being made
    read-only: the fork fails naming that cause, and succeeds once it is unmapped."""
    from gym_fork import SubEnvError

    envs = ForkVectorEnv([Careless], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/a.txt", "a\n")
        envs.call("map_then_delete")
        with pytest.raises((SubEnvError, RuntimeError), match="deleted and still in use"):
            envs.fork("b0")
        envs.call("unmap")
        with contextlib.closing(envs.fork("b1")) as branch:
            assert branch.call("read", "/tmp/ws/a.txt")[0] == "a\n"
    finally:
        envs.close()


def _open_fds_of(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_an_unsealable_source_that_exits_leaves_no_layer_pinned():
    """A branch whose frozen layer could not be sealed is closed: the helper lets go of
    that layer (a whole workspace's memory) and the host forgets it."""
    from gym_fork import SubEnvError

    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        branch = envs.fork("b")
        try:
            branch.call("write", "/tmp/ws/file.txt", "branch\n")
            branch.call("open_for_writing_past_the_overlay")
            with pytest.raises((SubEnvError, RuntimeError), match="not read-only"):
                branch.fork("bb")
            layers = envs.sandboxes.host.tmp_layers
            helper = layers.helper
            pid = helper.watch.pid if helper.watch is not None else helper.process.pid
            pinned = _open_fds_of(pid)
            gone = branch.worker_pids[0]
        finally:
            branch.close()
        assert wait_until(lambda: _open_fds_of(pid) <= pinned - 2, 5.0)  # layer + pidfd
        envs.call("write", "/tmp/ws/more.txt", "more\n")
        with contextlib.closing(envs.fork("c")) as again:
            assert again.call("read", "/tmp/ws/more.txt")[0] == "more\n"
        assert gone not in layers.unsealed
    finally:
        envs.close()


def test_two_threads_forking_two_sources_of_one_host_each_get_their_own_layer():
    """One helper serves a host: concurrent freezes must not take each other's answer
    (a new layer handed to the wrong source would be another sandbox's /tmp)."""
    import threading

    envs = workspace_env()
    try:
        first = envs.fork("first")
        try:
            sources = {"root": envs, "first": first}
            failures: list[str] = []

            def fork_repeatedly(name):
                source = sources[name]
                for r in range(6):
                    source.call("write", "/tmp/ws/owner.txt", f"{name} {r}\n", "w")
                    with contextlib.closing(source.fork(f"{name}-{r}")) as branch:
                        seen = branch.call("read", "/tmp/ws/owner.txt")[0]
                        if seen != f"{name} {r}\n":
                            failures.append(f"{name} {r}: {seen!r}")

            threads = [threading.Thread(target=fork_repeatedly, args=(n,)) for n in sources]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert not failures
            assert all(not thread.is_alive() for thread in threads)
        finally:
            first.close()
    finally:
        envs.close()


class CopyFailsIntoClones(Workspace):
    """Makes a clone's copy of its /tmp writes fail, but not a copy into a scratch
    directory: what an entry replaced mid-copy did (an overlay whiteout: EACCES)."""

    def break_the_copy(self):
        from gym_fork.system import sandbox_isolation

        real = sandbox_isolation.copy_tree

        def failing(source, target, *args, **kwargs):
            if "scratch" not in target:
                raise PermissionError(13, "made to fail here", source)
            return real(source, target, *args, **kwargs)

        sandbox_isolation.copy_tree = failing  # the clones inherit it


def test_a_clone_whose_own_tmp_cannot_be_made_fails_the_fork(monkeypatch):
    """It used to go on with its source's /tmp (its mount namespace's copy) and a
    warning: the branch's writes landed in the source's files."""
    from gym_fork.errors import GymForkError

    monkeypatch.setenv("GYM_FORK_TMP_LAYERS", "0")  # clones copy the source's writes
    envs = ForkVectorEnv([CopyFailsIntoClones], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "source\n")
        envs.call("break_the_copy")
        with pytest.raises(GymForkError, match="own /tmp"):
            envs.fork("b")
        assert envs.call("read", "/tmp/ws/f.txt")[0] == "source\n"  # the source goes on
        assert envs.call("listing", "/tmp/ws")[0] == ["f.txt"]
    finally:
        envs.close()


def test_a_fork_asks_ahead_whether_there_is_anything_to_freeze():
    """The helper is asked as a fork begins (read-only, ~0.5 ms that overlap the
    controller's preparation, not waited for); a source that wrote nothing is not
    frozen, one that wrote is, with what its check found (its mount table, what it
    holds); an answer a failed fork never took is forgotten, and the next fork gets its
    own."""
    from gym_fork.vector.lifecycle import Sandboxes

    envs = ForkVectorEnv([Workspace], lineage_log=False)
    try:
        envs.reset(seed=0)
        layers = envs.sandboxes.host.tmp_layers
        envs.fork("quiet").close()
        helper = layers.helper
        assert helper is not None and helper.asked["check"] == 1
        # The freeze is asked at once where the check's answer is not in yet (it follows
        # the check in the helper, which then finds nothing to freeze): none is frozen.
        quiet_freezes = helper.asked.get("freeze", 0)
        assert quiet_freezes <= 1 and not helper.freeze_ms
        envs.call("write", "/tmp/ws/f.txt", "source\n")
        real = Sandboxes.open_slabs

        def failing(*args, **kwargs):
            raise OSError(24, "made to fail: too many open files")

        Sandboxes.open_slabs = failing
        try:
            with pytest.raises(OSError, match="made to fail"):
                envs.fork("failed")  # after the ask, before any freeze
        finally:
            Sandboxes.open_slabs = real
        assert helper.asked.get("freeze", 0) == quiet_freezes and helper.asked["check"] == 2
        branch = envs.fork("written")
        try:
            assert helper.asked == {"check": 3, "freeze": quiet_freezes + 1}  # no other
            assert len(helper.freeze_ms) == 1  # frozen: what the source wrote
            assert helper.found_ahead == 1  # the freeze took what its check found
            assert branch.call("layers")[0] == 1
            assert branch.call("read", "/tmp/ws/f.txt")[0] == "source\n"
            assert not helper._answers and not helper._unanswered  # none left behind
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_fork_of_many_sources_checked_ahead_does_not_stall_the_helper(monkeypatch):
    """A fork of hundreds of one-env sources asks the helper as many checks before it
    reads any answer: past what the socket's buffers hold (~350 answers), a helper
    blocked on its answers would take no request, and be killed past the deadline
    (frozen layers off for the host). The controller reads ahead instead."""
    from gym_fork.system import layer_helper

    monkeypatch.setattr(layer_helper, "ANSWER_TIMEOUT_S", 2.0)
    monkeypatch.setattr(layer_helper, "ANSWER_WAIT_S", 4.0)
    helper = layer_helper.LayerHelper(1 << 20)
    pidfd = os.pidfd_open(os.getpid())
    try:
        numbers = [helper.ask_wrote_since(pidfd, 0) for _ in range(1000)]
        assert len(helper._unanswered) <= layer_helper.MAX_QUEUED
        helper.forget(numbers[500])
        answers = [helper.wrote_since(n) for n in numbers if n != numbers[500]]
        assert len(answers) == 999 and not helper.broken
        assert not helper._answers and not helper._unanswered and helper.alive()
    finally:
        os.close(pidfd)
        helper.close()


def test_the_check_of_a_fork_that_failed_is_forgotten_once_its_source_is_gone(monkeypatch):
    """A fork that fails before its freeze leaves its source's check answered and
    untaken: the source's next fork forgets it, and so does the next fork of another
    source once that one is gone (nothing kept for a sandbox that no longer exists)."""
    from gym_fork.vector.lifecycle import Sandboxes

    envs = ForkVectorEnv([Workspace] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        layers = envs.sandboxes.host.tmp_layers
        envs.fork("first", indices=[0]).close()
        helper = layers.helper

        def failing(*args, **kwargs):
            raise OSError(24, "made to fail: too many open files")

        monkeypatch.setattr(Sandboxes, "open_slabs", failing)
        with pytest.raises(OSError, match="made to fail"):
            envs.fork("failed", indices=[1])
        monkeypatch.undo()
        gone = envs.worker_pids[1]
        assert gone in layers.checks
        os.kill(gone, 9)
        assert wait_until(lambda: not alive([gone]), timeout=10)
        envs.fork("second", indices=[0]).close()
        assert not layers.checks and not helper._answers and not helper._unanswered
    finally:
        envs.close(terminate=True)


def test_an_answer_whose_wait_was_interrupted_is_dropped_when_read(monkeypatch):
    """A Ctrl-C while the controller waits for an answer: the answer, filed when it
    comes, is dropped (its fds closed), never kept for no one."""
    from gym_fork.system import layer_helper

    helper = layer_helper.LayerHelper(1 << 20)
    pidfd = os.pidfd_open(os.getpid())
    stopped = helper.process.pid
    try:
        os.kill(stopped, signal.SIGSTOP)  # it answers only once the wait was cut short
        interrupted = helper.ask_wrote_since(pidfd, 0)
        real = layer_helper.LayerHelper._wait_for_answers

        def interrupt(self, timeout):
            monkeypatch.setattr(layer_helper.LayerHelper, "_wait_for_answers", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(layer_helper.LayerHelper, "_wait_for_answers", interrupt)
        with pytest.raises(KeyboardInterrupt):
            helper.wrote_since(interrupted)
        os.kill(stopped, signal.SIGCONT)
        later = helper.ask_wrote_since(pidfd, 0)
        helper.wrote_since(later)  # answered after the interrupted one
        assert not helper._answers and not helper._unanswered and not helper._abandoned
    finally:
        os.kill(stopped, signal.SIGCONT)
        os.close(pidfd)
        helper.close()


def test_a_fork_given_up_while_its_source_waits_for_its_layer_leaves_the_source_whole(
    monkeypatch,
):
    """The FORK request goes out before the freeze (the source wakes while the helper
    works) and the source waits for its layer: a controller that fails between the two
    tells it so, takes its answer, and the source steps and forks on as before."""
    from gym_fork.hosts.process import sandbox
    from gym_fork.hosts.process.layers import TmpLayers

    envs = workspace_env()
    try:

        def failing(self, source):
            raise OSError(24, "made to fail: too many open files")

        monkeypatch.setattr(TmpLayers, "freeze", failing)
        started = time.monotonic()
        with pytest.raises(OSError, match="made to fail"):
            envs.fork("given up")
        monkeypatch.undo()
        envs.step(np.zeros(1, np.int64))
        # Told at once: it did not wait out its deadline for a layer that never came.
        assert time.monotonic() - started < sandbox.SIDE_TIMEOUT_S / 6
        envs.call("write", "/tmp/ws/f0.txt", "after\n")
        branch = envs.fork("b")
        try:
            assert envs.call("layers")[0] == branch.call("layers")[0] == 1
            assert branch.call("read", "/tmp/ws/f0.txt")[0] == "file 0\nafter\n"
            branch.step(np.zeros(1, np.int64))
        finally:
            branch.close()
    finally:
        envs.close()


class SideSocketWriter(KeepsItsLayer):
    """What a buggy or hostile env can do with its worker's side socket."""

    @staticmethod
    def _sock():
        from gym_fork.hosts.process.worker import ProcessWorker

        frame = sys._getframe()  # the worker serving this call is up the stack
        while not isinstance(frame.f_locals.get("self"), ProcessWorker):
            frame = frame.f_back
        return frame.f_locals["self"].sock

    def send_stale(self):
        from gym_fork.hosts.process import messages as M

        M.send(self._sock(), M.LayerAdopted(fork_id=0))
        M.send_with_pidfds(self._sock(), M.ClonesForked([os.getpid()], fork_id=0), [os.getpid()])

    def never_say_adopted(self):
        """Its next FORK takes its new layer and says nothing more (no LayerAdopted)."""
        from gym_fork.hosts.process import messages as M
        from gym_fork.hosts.process import sandbox

        real = sandbox._take_frozen_layer

        def take(worker, fork_id, tell=None):
            sandbox._take_frozen_layer = real
            _layer, fds = M.receive_for(worker.sock, fork_id, M.FrozenLayer, 10.0, "layer")
            sandbox.adopt_frozen_layer(fds[0])
            raise RuntimeError("hostile: no LayerAdopted")

        sandbox._take_frozen_layer = take


def test_side_socket_messages_of_an_earlier_fork_are_dropped_not_taken_for_this_ones():
    """Each side-socket message carries its FORK's id: what an earlier FORK left unread
    (a fork given up midway, a worker that timed out, or an env writing its socket) is
    dropped with its fds, so one lost exchange never shifts the later ones."""
    from gym_fork.hosts.process import messages as M

    envs = ForkVectorEnv([SideSocketWriter], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.fork("warm").close()  # the layer helper started: its fds are there
        envs.call("write", "/tmp/ws/f.txt", "source\n")
        link = envs.sandboxes.pool.workers[0].host_data
        M.send(link.sock, M.FrozenLayer(False, fork_id=0))  # controller -> worker, stale
        M.send(link.sock, M.LayerSealed(True, fork_id=0))
        envs.call("send_stale")  # worker -> controller, stale (a pidfd of its own with it)
        source = envs.worker_pids[0]
        held = _pidfds_of(source)  # the controller's watch of it
        branch = envs.fork("b")
        try:
            assert branch.call("read", "/tmp/ws/f.txt")[0] == "source\n"
            assert branch.worker_pids[0] != source
            assert _pidfds_of(source) == held  # the stale one was closed
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_source_that_never_says_its_layer_is_adopted_is_not_forked_on_it(monkeypatch):
    """A frozen layer that could not be sealed at once (a file of it open for writing)
    waits for the source's word that it reopened its files. Without it (a hostile env),
    the layer is sealed all the same, or where it cannot be (the env keeps a file of it
    open past the overlay), the source is not forked again until it can: its branches
    never stand on a layer it still writes."""
    from gym_fork.hosts.process import forking

    monkeypatch.setattr(forking, "SEAL_WAIT_S", 1.0)
    envs = ForkVectorEnv([SideSocketWriter], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("hold_log")  # a file open for writing: the freeze does not seal at once
        envs.call("open_for_writing_past_the_overlay")
        envs.call("never_say_adopted")
        with pytest.raises(Exception, match=r"not adopted|hostile"):
            envs.fork("b0")
        with pytest.raises(RuntimeError, match="not read-only"):
            envs.fork("b1")  # its frozen layer is still written past the overlay
        envs.call("close_raw")
        branch = envs.fork("b2")  # sealed now
        try:
            assert branch.call("read", "/tmp/ws/file.txt")[0] == "original\n"
        finally:
            branch.close()
    finally:
        envs.close()


def _ctrl_c_in_the_freeze(monkeypatch, ctrl_c):
    """A Ctrl-C once the helper's freeze answer is filed, before it is taken."""
    from gym_fork.system.layer_helper import LayerHelper

    freeze, answer = LayerHelper.freeze, LayerHelper._answer

    def interrupted_freeze(self, *args):
        def interrupted(helper, number):
            assert wait_until(lambda: number in helper._answers, timeout=10)
            ctrl_c()
            return answer(helper, number)

        monkeypatch.setattr(LayerHelper, "_answer", interrupted)
        try:
            return freeze(self, *args)
        finally:
            monkeypatch.setattr(LayerHelper, "_answer", answer)

    monkeypatch.setattr(LayerHelper, "freeze", interrupted_freeze)


def _fork_interrupted_promptly(envs, branch_id):
    """A fork a Ctrl-C cuts short comes out as KeyboardInterrupt within 10 s: its source
    was told (it does not sit out its own 60 s wait for a word from the controller)."""
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        envs.fork(branch_id)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(("sealed_at_once", "twice"), [(True, False), (False, False), (True, True)])
def test_a_freeze_interrupted_by_ctrl_c_still_reaches_its_source(
    monkeypatch, ctrl_c, sealed_at_once, twice
):
    """The helper froze the source's /tmp, and a Ctrl-C comes while the controller waits
    for its answer (``twice``: another as the layer is sent): the Ctrl-C waits until the
    source has its new layer (the frozen one sealed, or left to seal at its next fork),
    then the fork is given up; its later writes reach its next branch, and never a
    branch made before them."""
    from gym_fork.hosts.process import forking

    envs = workspace_env()
    try:
        if not sealed_at_once:
            envs.call("hold_log")
            envs.call("enter", "/tmp/ws")
        _ctrl_c_in_the_freeze(monkeypatch, ctrl_c)
        if twice:
            send_layer = forking._send_layer

            def interrupted_again(*args, **kwargs):
                ctrl_c()
                return send_layer(*args, **kwargs)

            monkeypatch.setattr(forking, "_send_layer", interrupted_again)
        _fork_interrupted_promptly(envs, "interrupted")
        monkeypatch.undo()
        envs.step(np.zeros(1, np.int64))
        first = envs.fork("first")
        try:
            envs.call("write", "/tmp/ws/f0.txt", "after\n")
            envs.call("write", "/tmp/ws/new.txt", "new\n")
            if not sealed_at_once:
                envs.call("write_here", "f2.txt", "source's write after the fork\n")
            second = envs.fork("second")
            try:
                assert second.call("read", "/tmp/ws/new.txt")[0] == "new\n"
                assert second.call("read", "/tmp/ws/f0.txt")[0] == "file 0\nafter\n"
            finally:
                second.close()
            assert first.call("read", "/tmp/ws/f0.txt")[0] == "file 0\n"
            assert first.call("read", "/tmp/ws/f2.txt")[0] == "file 2\n"
            assert first.call("read", "/tmp/ws/new.txt")[0] is None
        finally:
            first.close()
    finally:
        envs.close()


def test_a_fork_refused_as_unsealable_leaks_no_cgroup_fd():
    """A source whose frozen layer cannot be sealed is refused before its clones' fds
    are sent: the fds of their cgroups (made for them) are closed all the same."""
    from gym_fork.system.isolation import SandboxLimits

    envs = ForkVectorEnv(
        [KeepsItsLayer], limits=SandboxLimits(memory_bytes=1 << 30), lineage_log=False
    )
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("open_for_writing_past_the_overlay")
        with pytest.raises(Exception, match="not read-only"):
            envs.fork("b")
        before = set(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with pytest.raises(RuntimeError, match="not read-only"):
                envs.fork("b")
        new = set(os.listdir("/proc/self/fd")) - before
        assert not [fd for fd in new if "cgroup" in _target(fd)]
        envs.call("close_raw")
    finally:
        envs.close()


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _pidfds_of(pid: int) -> int:
    """How many pidfds of process ``pid`` this process holds."""
    count = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        with contextlib.suppress(OSError), open(f"/proc/self/fdinfo/{fd}") as info:
            count += f"Pid:\t{pid}\n" in info.read()
    return count


def test_each_source_is_sealed_as_soon_as_it_adopted_its_layer(monkeypatch):
    """A layer that waits for its source's word before it is sealed is sealed right
    then, not once the fork's earlier sources have finished forking (a source waiting
    for its seal behind a slow fan-out of another timed out, and its side socket went
    out of step)."""
    from gym_fork.hosts.process import forking
    from gym_fork.hosts.process.layers import TmpLayers

    events: list[str] = []
    seal, hand_over = TmpLayers.seal, forking.hand_over

    def sealing(self, source, token):
        events.append("seal")
        return seal(self, source, token)

    def handing_over(ends, exchange):
        events.append("hand over")
        return hand_over(ends, exchange)

    envs = ForkVectorEnv([Workspace] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "x\n")
        envs.call("hold_log")  # each: a file open for writing, sealed after it reopened
        monkeypatch.setattr(TmpLayers, "seal", sealing)
        monkeypatch.setattr(forking, "hand_over", handing_over)
        branch = envs.fork("b")
        try:
            assert events == ["seal", "seal", "hand over", "hand over"]
            branch.call("log", "branch\n")
            envs.call("log", "source\n")
            assert list(branch.call("read", "/tmp/ws/held.log")) == ["before\nbranch\n"] * 2
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_second_ctrl_c_while_a_fork_is_given_up_leaks_no_end(monkeypatch):
    """A Ctrl-C gives a fork up, and another cuts the giving up short: the clones'
    channels, pipes and cgroups made for the fork are let go of all the same."""
    from gym_fork.hosts.process import forking
    from gym_fork.hosts.process.layers import TmpLayers

    envs = workspace_env()
    try:
        envs.fork("warm").close()  # the helper and its fds exist before the count
        before = set(os.listdir("/proc/self/fd"))

        def first(self, source):
            raise KeyboardInterrupt

        give_up = forking._give_up

        def second(host, source, link, waiting, *rest):
            def interrupted():
                try:
                    waiting()  # the source's answer: its FORK failed
                finally:
                    raise KeyboardInterrupt

            return give_up(host, source, link, interrupted, *rest)

        monkeypatch.setattr(TmpLayers, "wrote", first)
        monkeypatch.setattr(forking, "_give_up", second)
        with pytest.raises(KeyboardInterrupt) as caught:  # its frames kept, as a REPL does
            envs.fork("interrupted")
        monkeypatch.undo()
        left = [_target(fd) for fd in set(os.listdir("/proc/self/fd")) - before]
        assert not [t for t in left if "memfd" in t or "pipe" in t or "cgroup" in t], left
        del caught
        envs.fork("after").close()
    finally:
        envs.close()


def test_a_ctrl_c_while_a_layer_waits_for_its_seal_leaves_it_to_be_sealed_first(monkeypatch):
    """A frozen layer is recorded unsealed from its freeze on: a Ctrl-C while its source's
    word or the seal is awaited leaves it so, and the source's next fork seals it before
    anything else (a branch never stands on a layer its source can still write)."""
    from gym_fork.hosts.process import messages as M

    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("hold_log")  # a file open for writing: not sealed within the freeze
        envs.call("stash_layer")  # a dup of its layer's fd, past /tmp's overlay
        real = M.receive_for

        def interrupted(sock, fork_id, expected, *args, **kwargs):
            message = real(sock, fork_id, expected, *args, **kwargs)
            if expected is M.LayerAdopted:
                monkeypatch.setattr(M, "receive_for", real)
                raise KeyboardInterrupt  # right after the source's word came
            return message

        monkeypatch.setattr(M, "receive_for", interrupted)
        _fork_interrupted_promptly(envs, "b0")
        monkeypatch.undo()
        assert envs.sandboxes.host.tmp_layers.unsealed
        envs.call("write", "/tmp/ws/new.txt", "new\n")
        branch = envs.fork("b1")  # sealed first: the source has reopened its files
        try:
            assert envs.call("write_through_stash", "ws/file.txt", "later\n")[0] == "EROFS"
            assert branch.call("read", "/tmp/ws/file.txt")[0] == "original\n"
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_ctrl_c_while_sealing_again_keeps_the_source_refused(monkeypatch):
    """A source refused because its frozen layer cannot be sealed stays refused when a
    Ctrl-C cuts the next try short: no token leaves the record before it is sealed."""
    from gym_fork.system.layer_helper import LayerHelper

    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("open_for_writing_past_the_overlay")  # the layer cannot be sealed
        with pytest.raises(Exception, match="not read-only"):
            envs.fork("b0")
        real = LayerHelper.seal

        def interrupted(self, token):
            monkeypatch.setattr(LayerHelper, "seal", real)
            raise KeyboardInterrupt

        monkeypatch.setattr(LayerHelper, "seal", interrupted)
        with pytest.raises(KeyboardInterrupt):
            envs.fork("b1")
        monkeypatch.undo()
        with pytest.raises(RuntimeError, match="not read-only"):
            envs.fork("b2")
        envs.call("close_raw")
        envs.fork("b3").close()  # sealed now
    finally:
        envs.close()


def test_a_source_whose_freeze_the_helper_did_not_answer_is_not_forked_again(monkeypatch):
    """The helper ended during a source's freeze (killed past its deadline, or died):
    it may have covered the source's /tmp with a new layer that never reached the source,
    whose clones would then copy a stale layer and miss its writes. That fork fails, the
    source is not forked again (saying why), and the host's other sources fork on,
    copying their writes (frozen layers are off for it)."""
    from gym_fork.system.layer_helper import LayerHelper

    envs = ForkVectorEnv([Workspace] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "x\n")
        envs.fork("first", indices=[0]).close()  # the helper runs
        envs.call("write", "/tmp/ws/g.txt", "y\n")
        send = LayerHelper._send

        def then_killed(self, request, fds):
            if request.get("op") != "freeze":
                return send(self, request, fds)
            monkeypatch.setattr(LayerHelper, "_send", send)
            # The check asked ahead is answered first (a fork does not wait for it): the
            # helper is on this freeze, not on the check, when it is killed.
            assert wait_until(lambda: not self._unanswered, timeout=10)
            pid = self.watch.pid if self.watch is not None else self.process.pid
            os.kill(pid, signal.SIGSTOP)  # it takes the request, and does nothing more
            number = send(self, request, fds)
            os.kill(pid, signal.SIGKILL)
            return number

        monkeypatch.setattr(LayerHelper, "_send", then_killed)
        with pytest.raises(RuntimeError, match="layer helper ended during its freeze"):
            envs.fork("cut", indices=[0])
        monkeypatch.undo()
        with pytest.raises(RuntimeError, match="not forked again"):
            envs.fork("again", indices=[0])
        other = envs.fork("other", indices=[1])
        try:
            assert other.call("read", "/tmp/ws/g.txt")[0] == "y\n"
            assert other.call("layers")[0] == 0  # copied
        finally:
            other.close()
    finally:
        envs.close()


def test_a_helper_that_ends_on_the_check_never_began_the_freeze_queued_behind_it(
    monkeypatch,
):
    """A fork asks its freeze without waiting for the check asked ahead: a helper that
    ends while still on the check never began the freeze (requests are taken in
    order), so the source's /tmp is as it was: that fork goes on with clones that copy
    its writes, and the source is forked again later (not taken for lost)."""
    from gym_fork.system.layer_helper import LayerHelper

    envs = ForkVectorEnv([Workspace], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "x\n")
        envs.fork("first").close()  # the helper runs
        envs.call("write", "/tmp/ws/g.txt", "y\n")
        send = LayerHelper._send

        def killed_on_the_check(self, request, fds):
            pid = self.watch.pid if self.watch is not None else self.process.pid
            if request.get("op") == "check":
                os.kill(pid, signal.SIGSTOP)  # it takes the check, and does nothing more
                return send(self, request, fds)
            monkeypatch.setattr(LayerHelper, "_send", send)
            number = send(self, request, fds)  # the freeze, queued behind the check
            os.kill(pid, signal.SIGKILL)
            return number

        monkeypatch.setattr(LayerHelper, "_send", killed_on_the_check)
        began = time.monotonic()
        branch = envs.fork("cut")  # not after the check's deadline (10 s): not waited for
        assert time.monotonic() - began < 5
        try:
            assert branch.call("read", "/tmp/ws/g.txt")[0] == "y\n"
            assert branch.call("read", "/tmp/ws/f.txt")[0] == "x\n"
        finally:
            branch.close()
        monkeypatch.undo()
        envs.call("write", "/tmp/ws/h.txt", "z\n")
        again = envs.fork("again")  # copies: the helper is gone, the source is not lost
        try:
            assert again.call("read", "/tmp/ws/h.txt")[0] == "z\n"
        finally:
            again.close()
    finally:
        envs.close()


def test_a_ctrl_c_as_the_seal_is_answered_leaves_the_source_forkable(monkeypatch):
    """The helper sealed the layer, and the controller's wait for its answer was cut
    short: asked again at the next fork, the helper answers that it is sealed (it keeps
    the tokens it sealed lately), so the source is not refused for the rest of its life."""
    from gym_fork.system.layer_helper import LayerHelper

    envs = ForkVectorEnv([KeepsItsLayer], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/file.txt", "original\n")
        envs.call("hold_log")  # a file open for writing: sealed after LayerAdopted
        envs.call("stash_layer")
        answer = LayerHelper._answer

        def interrupted(self, number):
            assert wait_until(lambda: number in self._answers or self.broken, timeout=10)
            if "sealed" in self._answers.get(number, ({}, []))[0]:  # the seal's: not taken
                monkeypatch.setattr(LayerHelper, "_answer", answer)
                self.forget(number)  # what an interrupted wait does
                raise KeyboardInterrupt
            return answer(self, number)

        monkeypatch.setattr(LayerHelper, "_answer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            envs.fork("b0")
        monkeypatch.undo()
        assert envs.call("write_through_stash", "ws/file.txt", "later\n")[0] == "EROFS"
        envs.fork("b1").close()
    finally:
        envs.close()


def test_a_helper_that_died_between_forks_loses_no_source(monkeypatch):
    """The helper ended while idle (killed, crashed): no freeze was under way, so no
    source's layer is in doubt: frozen layers are off for the host, and its sources'
    clones copy their writes from then on."""
    envs = ForkVectorEnv([Workspace] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "x\n")
        envs.fork("first", indices=[0]).close()
        layers = envs.sandboxes.host.tmp_layers
        helper = layers.helper
        helper.watch.kill() if helper.watch is not None else helper.process.kill()
        assert wait_until(lambda: not helper.alive(), timeout=10)
        envs.call("write", "/tmp/ws/g.txt", "y\n")
        for name in ("after", "again"):
            branch = envs.fork(name, indices=[0])
            try:
                assert branch.call("read", "/tmp/ws/g.txt")[0] == "y\n"
            finally:
                branch.close()
        assert not layers.lost and layers.off
    finally:
        envs.close()


def _started_at(pid: int) -> float:
    """When process ``pid`` started, seconds on CLOCK_BOOTTIME (to a clock tick)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _layers_sent_late(monkeypatch) -> list[float]:
    """Each FrozenLayer goes to its source 0.3 s late; the CLOCK_BOOTTIME of each send."""
    from gym_fork.hosts.process import forking

    send_layer = forking._send_layer
    sent_at: list[float] = []

    def late(*args, **kwargs):
        time.sleep(0.3)
        sent_at.append(time.clock_gettime(time.CLOCK_BOOTTIME))
        return send_layer(*args, **kwargs)

    monkeypatch.setattr(forking, "_send_layer", late)
    return sent_at


def test_a_source_forks_its_clones_while_its_writes_are_frozen_and_they_wait(monkeypatch):
    """The source does not wait for its new layer before it forks (the freeze, ~1.5 ms,
    off a fork's critical path): its clones are made at once and wait for its word
    before their namespaces, so each stands on the frozen layer, with what the source
    wrote before the fork and nothing it wrote after."""
    envs = ForkVectorEnv([Workspace], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "before\n")
        sent_at = _layers_sent_late(monkeypatch)
        branch = envs.fork("b", copies=2)
        monkeypatch.undo()
        try:
            assert len(sent_at) == 1
            assert all(_started_at(pid) < sent_at[0] - 0.1 for pid in branch.worker_pids)
            envs.call("write", "/tmp/ws/f.txt", "after\n")
            assert branch.call("read", "/tmp/ws/f.txt") == ("before\n", "before\n")
            assert branch.call("layers") == (1, 1) and envs.call("layers") == (1,)
            branch.call("write", "/tmp/ws/f.txt", "branch\n")
            assert envs.call("read", "/tmp/ws/f.txt")[0] == "before\nafter\n"
        finally:
            branch.close()
    finally:
        envs.close()


class WithAThread(Workspace):
    """A Workspace whose process runs a thread of its own (asleep)."""

    def start_thread(self):
        import threading

        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


@pytest.mark.parametrize("holds", ["a file open for writing", "a thread"])
def test_a_source_takes_its_layer_before_forking_where_forking_first_is_unsafe(monkeypatch, holds):
    """A source holding a /tmp file open for writing (its clones would inherit it, and
    hold the frozen layer's seal back), or running a thread (one could write /tmp
    between the new /tmp's mount and the fork: its clones, forked holding the old layer,
    would miss it), takes its layer first, as before; the fork goes through."""
    envs = ForkVectorEnv([WithAThread], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "x\n")
        if holds == "a thread":
            envs.call("start_thread")
        else:
            envs.call("hold_log")
            envs.call("log", "one\n")
        sent_at = _layers_sent_late(monkeypatch)
        branch = envs.fork("b")
        monkeypatch.undo()
        try:
            assert _started_at(branch.worker_pids[0]) >= sent_at[0] - 0.02
            assert branch.call("layers") == (1,)
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_sources_word_on_its_swap_is_kept_only_where_a_swap_could_take_it():
    """ClonesForked's ``layer_ms`` is the source's own figure (benchmarks read it): a
    hostile or broken source's NaN, infinity, negative or absurd figure is not kept."""
    from gym_fork.hosts.process.layers import TmpLayers
    from gym_fork.system.isolation import IsolationConfig

    layers = TmpLayers(IsolationConfig())
    for said in (float("nan"), float("inf"), -1.0, 0.0, 1e12, 3):
        layers.source_swapped(said)
    assert layers.swap_ms == []
    layers.source_swapped(0.75)
    assert layers.swap_ms == [0.75]


def _fork_signalled_midway(envs, *arm):
    """A branch "b" of ``envs`` (reset, /tmp/ws/f.txt written, its handler armed with
    ``arm``) whose source gets SIGUSR1 0.15 s into the fork."""
    import signal
    import threading

    envs.reset(seed=0)
    envs.call("write", "/tmp/ws/f.txt", "x\n")
    envs.call("arm", *arm)
    timer = threading.Timer(0.15, os.kill, (envs.worker_pids[0], signal.SIGUSR1))
    timer.start()
    try:
        return envs.fork("b")
    finally:
        timer.join()


class Signalled(Workspace):
    """A Workspace whose env code runs from a signal handler too (SIGUSR1)."""

    def arm(self):
        import signal

        self.ran_at = []
        signal.signal(
            signal.SIGUSR1, lambda *_: self.ran_at.append(time.clock_gettime(time.CLOCK_BOOTTIME))
        )

    def ran(self):
        return self.ran_at


def test_a_sources_signal_handlers_wait_until_its_tmp_is_final(monkeypatch):
    """From its FORK until it has taken its new layer, a source's env code is held off
    (its signal handlers wait, the collector is off), and the freeze begins only once it
    says so (ForkQuiet): a handler writing /tmp meanwhile could land in no layer its
    clones hold (a reviewer's timer handler lost writes in 14 of 30 forks), or in the
    frozen one once read-only (EROFS). The signal is not lost: it comes after."""
    envs = ForkVectorEnv([Signalled], lineage_log=False)
    try:
        sent_at = _layers_sent_late(monkeypatch)
        branch = _fork_signalled_midway(envs)
        monkeypatch.undo()
        try:
            (ran,) = envs.call("ran")
            assert len(ran) == 1 and ran[0] > sent_at[0]
            assert branch.call("ran") == ([],)  # its clone was forked before it came
        finally:
            branch.close()
    finally:
        envs.close()


class ClonesDieAtFork(Workspace):
    """A Workspace whose clones exit in their at-fork hook while armed (env code that
    runs in a clone before its set-up)."""

    armed = False

    def arm(self, armed):
        from gym_fork.hosts.process import sandbox

        if not hasattr(ClonesDieAtFork, "_hooked"):
            ClonesDieAtFork._hooked = True
            os.register_at_fork(after_in_child=lambda: ClonesDieAtFork.armed and os._exit(0))
            real = sandbox._take_frozen_layer

            def take(worker, fork_id, tell=None):
                if ClonesDieAtFork.armed:  # its clones are gone before its word: EPIPE
                    time.sleep(0.3)
                return real(worker, fork_id, tell)

            sandbox._take_frozen_layer = take
        ClonesDieAtFork.armed = armed

    def die_on_sigpipe(self):
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as a command-line tool may


def test_a_source_whose_clones_died_before_its_word_still_takes_its_layer():
    """A source tells its clones of its new layer before it adopts it (their mount
    namespaces copy the helper's mounts, not its fds). Clones gone by then (the pipe
    refuses the word) fail the fork only once the source has its layer: it works on in
    /tmp (its working directory re-entered, not left on the sealed frozen layer), and
    forks again. The pipe's SIGPIPE is not the source's end, even where its env made
    SIGPIPE deadly."""
    envs = ForkVectorEnv([ClonesDieAtFork], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("write", "/tmp/ws/f.txt", "before\n")
        envs.call("enter", "/tmp/ws")
        envs.call("die_on_sigpipe")
        envs.call("arm", True)
        with pytest.raises(Exception, match="clones were gone before its word"):
            envs.fork("b0")
        envs.call("arm", False)
        envs.call("write_here", "f.txt", "after\n")  # EROFS on the frozen layer
        assert envs.call("read", "/tmp/ws/f.txt")[0] == "before\nafter\n"
        branch = envs.fork("b1")
        try:
            assert branch.call("read", "/tmp/ws/f.txt")[0] == "before\nafter\n"
            branch.call("write_here", "f.txt", "branch\n")
            assert envs.call("read", "/tmp/ws/f.txt")[0] == "before\nafter\n"
        finally:
            branch.close()
    finally:
        envs.close()


class SignalledSlowCopies(Workspace):
    """A Workspace whose signal handler (SIGUSR1) writes /tmp, and whose clones take
    0.3 s to copy its /tmp writes (no frozen layers: each clone copies them)."""

    def arm(self, raises=False):
        import signal

        from gym_fork.system import sandbox_isolation

        copy = sandbox_isolation.copy_tree

        def slow_copy(*args, **kwargs):
            time.sleep(0.3)  # in a clone: its source's signal comes meanwhile
            return copy(*args, **kwargs)

        sandbox_isolation.copy_tree = slow_copy

        def handler(*_):
            if raises:  # as an env's SIGALRM timeout does
                raise TimeoutError("the env's own timeout")
            self.write("/tmp/ws/signalled.txt", "late\n")

        signal.signal(signal.SIGUSR1, handler)


def test_a_sources_signal_handler_waits_until_its_clones_have_copied_its_tmp(monkeypatch):
    """Where no layer is frozen (its clones copy its /tmp writes), a source's env code
    waits from its FORK until every clone has its copy: a handler writing /tmp meanwhile
    would be in the copies, a branch starting after its fork point. The signal is not
    lost: the source writes once its clones have copied."""
    monkeypatch.setenv("GYM_FORK_TMP_LAYERS", "0")
    envs = ForkVectorEnv([SignalledSlowCopies], lineage_log=False)
    try:
        branch = _fork_signalled_midway(envs)
        try:
            assert branch.call("read", "/tmp/ws/f.txt") == ("x\n",)
            assert branch.call("read", "/tmp/ws/signalled.txt") == (None,)
            assert wait_until(lambda: envs.call("read", "/tmp/ws/signalled.txt") == ("late\n",))
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_source_whose_held_signal_handler_raises_fails_its_fork_and_leaves_no_clone(
    monkeypatch,
):
    """A handler that raises (an env's own timeout) when the source's env code runs
    again fails the FORK before its clones are announced: they are killed, none is left
    to the tree, and the source forks again."""
    monkeypatch.setenv("GYM_FORK_TMP_LAYERS", "0")
    envs = ForkVectorEnv([SignalledSlowCopies], lineage_log=False)
    try:
        with pytest.raises(Exception, match="the env's own timeout"):
            _fork_signalled_midway(envs, True)
        envs.call("arm", False)
        branch = envs.fork("c")
        try:
            assert branch.call("read", "/tmp/ws/f.txt") == ("x\n",)
        finally:
            branch.close()
    finally:
        envs.close()

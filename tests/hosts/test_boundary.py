"""The boundary (issue 18), tried from inside default process sandboxes the way a careless
or hostile env would: a branch never touches its source or its siblings, and a sandbox
writes nothing of the host's."""

from __future__ import annotations

import ctypes
import os
import site
import socket
import sys
import tempfile
import uuid

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.system import cgroups, namespaces

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root here")

STATE_FILE = "/tmp/gym_fork_boundary_state"  # a fixed path, as simulators keep them


class FixedPathEnv(gym.Env):
    """Keeps its whole state in a file at a fixed /tmp path, and probes the boundary."""

    observation_space = gym.spaces.Box(-1e18, 1e18, (1,), np.float64)
    action_space = gym.spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        with open(STATE_FILE, "w") as f:
            f.write(repr(float(self.np_random.integers(100))))
        return self._obs(), {}

    def _obs(self):
        with open(STATE_FILE) as f:
            return np.array([float(f.read())])

    def step(self, action):
        value = self._obs()[0] * 3 + int(action) + 1
        with open(STATE_FILE, "w") as f:
            f.write(repr(float(value % 1e15)))
        return self._obs(), 0.0, False, False, {}

    # -- probes called through envs.call ----------------------------------------------
    def leave_traces(self, tag=None):
        """A /dev/shm file, a SysV segment and an abstract socket named by ``tag`` (a
        new random one if None); returns the tag."""
        tag = tag or uuid.uuid4().hex[:8]
        with open(f"/dev/shm/gf_{tag}", "w") as f:
            f.write(tag)
        key = _sysv_key(tag)
        libc = ctypes.CDLL(None, use_errno=True)
        shmid = libc.shmget(key, 4096, 0o1000 | 0o600)  # IPC_CREAT
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(f"\0gf_{tag}")
        sock.listen()
        self._kept = sock  # listening while the env lives
        assert shmid >= 0
        return tag

    def find_traces(self, tag):
        found = []
        if os.path.exists(f"/dev/shm/gf_{tag}"):
            found.append("shm file")
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.shmget(_sysv_key(tag), 0, 0) >= 0:
            found.append("sysv")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(f"\0gf_{tag}")
            found.append("abstract socket")
        except OSError:
            pass
        finally:
            probe.close()
        return found

    def try_writes(self, paths):
        results = {}
        for path in paths:
            try:
                with open(path, "a") as f:
                    f.write("x")
                results[path] = "written"
            except OSError as exc:
                results[path] = exc.strerror
        return results

    def devices(self):
        return sorted(os.listdir("/dev"))


def _sysv_key(tag: str) -> int:
    return int.from_bytes(tag.encode()[:4].ljust(4, b"_"), "little") & 0x7FFFFFFF


def envs_of(n: int = 1, **kwargs) -> ForkVectorEnv:
    kwargs.setdefault("envs_per_worker", 1)
    kwargs.setdefault("lineage_log", False)
    return ForkVectorEnv([FixedPathEnv] * n, **kwargs)


def trajectory(envs, actions_per_step):
    return np.array([envs.step(np.array(a))[0][:, 0] for a in actions_per_step])


@pytest.mark.slow  # 1.2 s here
def test_a_branch_and_its_source_diverge_as_separately_built_envs_do():
    """The env keeps its state at a fixed /tmp path: each branch and the source evolve
    exactly as a separately built env fed the same actions would."""
    prefix = [[1]] * 3
    source = envs_of(1)
    try:
        source.reset(seed=7)
        trajectory(source, prefix)
        branch = source.fork("b", indices=[0], copies=2)
        try:
            branch_steps = [[0, 2], [2, 0], [1, 1], [0, 0]]
            source_steps = [[2], [2], [0], [1]]
            # Interleaved: every write of one is followed by reads of the others.
            got_branch, got_source = [], []
            for b_act, s_act in zip(branch_steps, source_steps, strict=True):
                got_branch.append(branch.step(np.array(b_act))[0][:, 0])
                got_source.append(source.step(np.array(s_act))[0][:, 0])
        finally:
            branch.close()
    finally:
        source.close()
    for copy, column in ((0, 0), (1, 1)):
        reference = envs_of(1)
        try:
            reference.reset(seed=7)
            trajectory(reference, prefix)
            expected = trajectory(reference, [[a[column]] for a in branch_steps])[:, 0]
        finally:
            reference.close()
        assert np.array_equal(np.array(got_branch)[:, copy], expected), copy
    reference = envs_of(1)
    try:
        reference.reset(seed=7)
        trajectory(reference, prefix)
        assert np.array_equal(np.array(got_source)[:, 0], trajectory(reference, source_steps)[:, 0])
    finally:
        reference.close()


def test_shm_files_sysv_segments_and_abstract_sockets_stay_with_their_sandbox():
    source = envs_of(1)
    try:
        source.reset(seed=0)
        branch = source.fork("b", indices=[0], copies=2)
        try:
            assert branch.isolation["namespaces"]["ipc"] and branch.isolation["private_tmp"]
            (made_by_source,) = source.call("leave_traces")
            first, second = branch.call("leave_traces")
            everything = ["abstract socket", "shm file", "sysv"]
            # No sibling sees another's, the source sees none of the branch's, and the
            # branch none that its source made after the fork.
            assert branch.call("find_traces", made_by_source) == ([], [])
            assert source.call("find_traces", first) == ([],)
            assert [sorted(t) for t in branch.call("find_traces", first)] == [everything, []]
            assert [sorted(t) for t in branch.call("find_traces", second)] == [[], everything]
        finally:
            branch.close()
    finally:
        source.close()


def test_a_clone_starts_from_its_source_shm_and_tmp_files_at_the_fork():
    """What the source wrote before the fork is the clone's starting point (a copy)."""
    source = envs_of(1)
    try:
        source.reset(seed=0)
        (tag,) = source.call("leave_traces")
        branch = source.fork("b", indices=[0])
        try:
            assert "shm file" in branch.call("find_traces", tag)[0]
            before = branch.step(np.array([1]))[0][0, 0]
            after = source.step(np.array([1]))[0][0, 0]
            assert before == after  # same state file content at the fork, same action
        finally:
            branch.close()
    finally:
        source.close()


def _host_targets(tmp_name: str) -> list[str]:
    gymnasium_dir = os.path.dirname(gym.__file__)
    site_dir = site.getsitepackages()[0]
    return [
        os.path.join(gymnasium_dir, f"{tmp_name}.py"),  # a module the controller imports
        os.path.join(site_dir, f"{tmp_name}.pth"),  # run by every later interpreter
        os.path.join(os.path.dirname(os.__file__), f"{tmp_name}.py"),  # the stdlib
        f"/etc/{tmp_name}",
        f"/var/tmp/{tmp_name}",
        os.path.expanduser(f"~/.{tmp_name}rc"),
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/vm/overcommit_memory",
        "/proc/sysrq-trigger",
        "/sys/kernel/mm/transparent_hugepage/enabled",
    ]


@pytest.mark.parametrize("kind", ["sandbox", "clone"])
def test_host_files_and_kernel_settings_cannot_be_written(kind):
    name = f"gym_fork_boundary_{uuid.uuid4().hex[:8]}"
    targets = [t for t in _host_targets(name) if os.path.exists(os.path.dirname(t))]
    before = {t: _read(t) for t in targets}
    envs = envs_of(1)
    try:
        envs.reset(seed=0)
        probe = envs if kind == "sandbox" else envs.fork("b", indices=[0])
        results = probe.call("try_writes", targets)[0]
        if probe is not envs:
            probe.close()
    finally:
        envs.close()
    # Refused, or (a venv under /tmp, as CI's /tmp/ci) written into the sandbox's
    # private /tmp layer: either way the host's file is as it was.
    written = {t: r for t, r in results.items() if r == "written" and not t.startswith("/tmp/")}
    assert not written, written
    for target in targets:
        assert _read(target) == before[target], target


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(4096)
    except OSError:
        return None


def test_the_report_says_read_only_as_measured_and_dev_is_minimal():
    envs = envs_of(1)
    try:
        envs.reset(seed=0)
        report = envs.isolation
        assert report["read_only_host"] is True, report
        devices = envs.call("devices")[0]
        assert {"null", "zero", "urandom", "shm", "pts"} <= set(devices)
        host_disks = [d for d in os.listdir("/dev") if d.startswith(("vd", "sd", "nvme", "loop"))]
        assert not set(host_disks) & set(devices), devices
        assert "kmsg" not in devices and "mem" not in devices
    finally:
        envs.close()


def test_writable_paths_are_bound_writable_and_reported(tmp_path):
    target = tmp_path / "shared"
    target.mkdir()
    envs = envs_of(1, writable_paths=[str(target)], private_tmp=True)
    try:
        envs.reset(seed=0)
        results = envs.call("try_writes", [str(target / "out"), "/etc/gf_nope"])[0]
        assert results[str(target / "out")] == "written"
        assert results["/etc/gf_nope"] == "Read-only file system"
        assert str(target) in envs.isolation["writable"]
    finally:
        envs.close()
    assert (target / "out").read_text() == "x"


def test_a_refused_write_names_the_option_that_lifts_it():
    class WritesEtc(FixedPathEnv):
        def reset(self, *, seed=None, options=None):
            with open("/var/tmp/gym_fork_boundary_refused", "w") as f:
                f.write("x")
            return super().reset(seed=seed, options=options)

    envs = ForkVectorEnv([WritesEtc], lineage_log=False)
    try:
        with pytest.raises(OSError) as info:
            envs.reset(seed=0)
        assert "writable_paths=" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
    finally:
        envs.close()


@pytest.mark.slow  # 1.2 s here
def test_user_namespace_nesting_has_a_fallback_that_says_so():
    """Deep chains of forks (tree search) keep working past the kernel's 32 nested user
    namespaces: the deepest clones share their source's mounts and say so."""
    envs = envs_of(1)
    chain = [envs]
    try:
        envs.reset(seed=0)
        for _ in range(34):
            chain.append(chain[-1].fork(f"d{len(chain)}", indices=[0]))
        deepest = chain[-1]
        assert "sandbox_mount" in deepest.isolation["missing"]
        assert "32" in deepest.isolation["missing"]["sandbox_mount"]
        obs = deepest.step(np.array([1]))[0]
        assert obs.shape == (1, 1)
    finally:
        for env in reversed(chain):
            env.close()


def test_namespaces_module_refuses_a_missing_path_clearly():
    with pytest.raises(OSError, match="open_tree /no/such/path"):
        namespaces.clone_mount("/no/such/path")


def lying_env():
    """Rewrites its sandbox's own isolation report before the HELLO, claiming layers."""
    frame = sys._getframe(1)
    while frame is not None:
        worker = frame.f_locals.get("self")
        report = getattr(worker, "isolation", None)
        if isinstance(report, dict) and "sandbox" in report:
            report["sandbox"].update(
                mount=True,
                ipc=True,
                seccomp="on (999 syscalls refused)",
                capabilities="dropped",
                read_only_host=True,
                no_new_privs=True,
            )
            break
        frame = frame.f_back
    return FixedPathEnv()


def test_the_reported_isolation_is_measured_not_what_the_sandbox_claims():
    envs = ForkVectorEnv([lying_env], namespaces=False, lineage_log=False)
    try:
        report = envs.isolation
        assert report["measured_by"].startswith("controller")
        assert report["namespaces"]["mount"] is False and report["namespaces"]["ipc"] is False
        assert report["read_only_host"] is False
        assert "999" not in report["seccomp"] and report["seccomp"].startswith("on (")
    finally:
        envs.close()
    envs = ForkVectorEnv([lying_env], lineage_log=False)
    try:
        report = envs.isolation
        unprivileged = report["uid"] != 0 and not report["user_namespace"]
        assert report["capabilities"] == ("dropped" if unprivileged else "dropped, but CAP_SETFCAP")
        assert report["namespaces"] == {k: True for k in ("mount", "ipc", "uts", "net", "pid")}
    finally:
        envs.close()


class LeavesTmpFiles(FixedPathEnv):
    def reset(self, *, seed=None, options=None):
        with open("/tmp/gym_fork_boundary_video.mp4", "wb") as f:
            f.write(b"x" * 4096)
        return super().reset(seed=seed, options=options)


def test_files_left_in_the_private_tmp_are_noted_once_at_close(monkeypatch):
    from gym_fork.vector import lifecycle

    monkeypatch.setattr(lifecycle, "_TMP_NOTED", False)
    notes = []
    monkeypatch.setattr(lifecycle.notices, "warn", lambda text, *a, **k: notes.append(text))
    for _ in range(2):
        envs = ForkVectorEnv([LeavesTmpFiles] * 2, envs_per_worker=1, lineage_log=False)
        envs.reset(seed=0)
        envs.close()
    tmp_notes = [n for n in notes if "private /tmp" in n]
    assert len(tmp_notes) == 1, notes
    assert "private_tmp=False" in tmp_notes[0] and "file(s)" in tmp_notes[0]
    assert not os.path.exists("/tmp/gym_fork_boundary_video.mp4")  # it never reached the host


class Prober(FixedPathEnv):
    """Attacks found by a review of the boundary, each tried from inside."""

    def terminal(self):
        import fcntl
        import termios

        out = {"dev_tty": os.path.exists("/dev/tty")}
        master = os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY)
        try:
            fcntl.ioctl(master, termios.TIOCSTI, b"x")
            out["tiocsti"] = "allowed"
        except OSError as exc:
            out["tiocsti"] = errno_name(exc)
        finally:
            os.close(master)
        with open("/proc/self/stat") as f:
            out["tty_nr"] = int(f.read().rsplit(")", 1)[1].split()[4])  # its terminal
        return out

    def unshare(self, flags):
        libc = ctypes.CDLL(None, use_errno=True)
        pid = os.fork()
        if pid == 0:  # in a child: the sandbox itself keeps its namespaces
            rc = libc.unshare(flags)
            os._exit(0 if rc == 0 else ctypes.get_errno())
        return errno_name_of(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    def start_helper(self):
        import subprocess

        self._helper = subprocess.Popen(["sleep", "30"])  # exec: dumpable again
        with open("/tmp/gym_fork_boundary_secret", "w") as f:
            f.write("secret")
        return self._helper.pid

    def stop_helper(self):
        self._helper.kill()
        self._helper.wait()

    def peek(self, pid):
        out = {}
        for what in ("root/tmp", "mem", "environ"):
            try:
                if what == "root/tmp":
                    os.listdir(f"/proc/{pid}/{what}")
                else:
                    with open(f"/proc/{pid}/{what}", "rb") as f:
                        f.read(1)
                out[what] = "read"
            except OSError as exc:
                out[what] = errno_name(exc)
        return out


def errno_name(exc: OSError) -> str:
    import errno

    return errno.errorcode.get(exc.errno, str(exc.errno))


def errno_name_of(code: int) -> str:
    import errno

    return "ok" if code == 0 else errno.errorcode.get(code, str(code))


def test_no_terminal_to_type_into():
    """TIOCSTI on the controller's terminal would type commands into the user's shell:
    the tree has no controlling terminal and no /dev/tty, and TIOCSTI is refused."""
    envs = ForkVectorEnv([Prober], lineage_log=False)
    try:
        result = envs.call("terminal")[0]
    finally:
        envs.close()
    assert result == {"dev_tty": False, "tiocsti": "EPERM", "tty_nr": 0}, result


def test_a_user_namespace_but_no_cgroup_pid_or_uts_namespace_of_its_own():
    """A cgroup namespace would let a sandbox mount cgroupfs writable (and lift its own
    limits); a clone needs only user, mount, IPC and network namespaces."""
    newuser, newns, newcgroup, newpid = 0x10000000, 0x00020000, 0x02000000, 0x20000000
    envs = ForkVectorEnv([Prober], lineage_log=False)
    try:
        assert envs.call("unshare", newuser | newns)[0] == "ok"
        assert envs.call("unshare", newuser | newns | newcgroup)[0] == "EPERM"
        assert envs.call("unshare", newuser | newpid)[0] == "EPERM"
        assert envs.call("unshare", newns)[0] == "EPERM"
    finally:
        envs.close()


def test_a_sibling_cannot_reach_a_sandbox_through_a_program_it_executed():
    from gym_fork.system import landlock

    if landlock.landlock_abi() < landlock.LANDLOCK_MIN_ABI:
        pytest.skip(f"Landlock ABI {landlock.landlock_abi()} < 6 here: not scoped")
    envs = ForkVectorEnv([Prober] * 2, envs_per_worker=1, lineage_log=False)
    try:
        helper = envs.call("start_helper")[0]
        seen = envs.call("peek", helper)[1]
        assert set(seen.values()) <= {"EACCES", "EPERM"}, seen
        # A sub-env with a child process of its own is not forked on the process host
        # (tests/hosts/test_child_processes.py): the helpers end first.
        envs.call("stop_helper")
        branch = envs.fork("b", indices=[0])  # nested in its source's domain
        try:
            helper_of_branch = branch.call("start_helper")[0]
            from_source = envs.call("peek", helper_of_branch)[1]  # a sibling of the source
            assert set(from_source.values()) <= {"EACCES", "EPERM"}, from_source
            branch.call("stop_helper")
        finally:
            branch.close()
    finally:
        envs.close()


class OddTmpFiles(FixedPathEnv):
    """Leaves in /tmp what an env's own copy must survive: a sparse file bigger than
    the clone's layer, hard links, a fifo, a 300-deep directory chain."""

    def leave_odd_files(self):
        with open("/tmp/gf_sparse", "wb") as f:
            f.truncate(1 << 30)
            f.seek(5 << 20)
            f.write(b"data in the middle")
        with open("/tmp/gf_linked", "w") as f:
            f.write("one file")
        os.link("/tmp/gf_linked", "/tmp/gf_linked_too")
        os.mkfifo("/tmp/gf_fifo")
        path = "/tmp/gf_deep"
        for _ in range(300):
            path = os.path.join(path, "d")
        os.makedirs(path)
        with open(os.path.join(path, "leaf"), "w") as f:
            f.write("leaf")

    def layers(self):
        """How many frozen /tmp layers this sandbox's /tmp stands on."""
        from gym_fork.system import layer_slots

        return len(layer_slots.layer_paths())

    def look(self):
        sparse = os.stat("/tmp/gf_sparse")
        with open("/tmp/gf_sparse", "rb") as f:
            f.seek(5 << 20)
            middle = f.read(18)
        linked = os.stat("/tmp/gf_linked")
        deep = "/tmp/gf_deep" + "/d" * 300 + "/leaf"
        return {
            "sparse": (sparse.st_size, sparse.st_blocks * 512 < 1 << 20, middle),
            "links": (linked.st_nlink, linked.st_ino == os.stat("/tmp/gf_linked_too").st_ino),
            "fifo": os.path.exists("/tmp/gf_fifo"),
            "deep": open(deep).read() if os.path.exists(deep) else None,
            # a sandbox that fell back to a scratch dir has it as TMPDIR (listing /tmp
            # would show other processes' scratch dirs too: the overlay's lower is the host's)
            "tmpdir": (os.environ.get("TMPDIR"), tempfile.gettempdir()),
        }


@pytest.mark.parametrize("layers", ["frozen", "copied"])
def test_a_clone_copies_sparse_files_hard_links_and_deep_trees_within_its_layer(
    layers, monkeypatch
):
    """Copied (GYM_FORK_TMP_LAYERS=0): within the clone's own layer, the fifo left out.
    Frozen (the default where it can be): the same files, the fifo too (each overlay has
    a pipe of its own for it: test_frozen_layers.py)."""
    if layers == "copied":
        monkeypatch.setenv("GYM_FORK_TMP_LAYERS", "0")
    envs = ForkVectorEnv([OddTmpFiles], tmpfs_bytes=64 << 20, lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("leave_odd_files")
        branch = envs.fork("b")
        try:
            seen = branch.call("look")[0]
            frozen = branch.call("layers")[0]
        finally:
            branch.close()
        assert frozen == (1 if layers == "frozen" else 0)
        assert seen["sparse"] == (1 << 30, True, b"data in the middle"), seen
        assert seen["links"] == (2, True) and seen["fifo"] is (layers == "frozen"), seen
        assert seen["deep"] == "leaf" and seen["tmpdir"] == ("/tmp", "/tmp"), seen
        assert envs.call("look")[0]["tmpdir"] == ("/tmp", "/tmp")  # nothing fell back
    finally:
        envs.close()


class KeepsFilesOpen(FixedPathEnv):
    """A log file kept open in /tmp (a sqlite db, a logger), and a /dev/shm mapping."""

    def open_things(self):
        import mmap

        self._log = open("/tmp/gf_env_log.txt", "a+")  # noqa: SIM115
        self._log.write("before the fork\n")
        self._log.flush()
        with open("/dev/shm/gf_mapped", "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open("/dev/shm/gf_mapped", os.O_RDWR)
        self._map = mmap.mmap(fd, 4096)
        os.close(fd)

    def log(self, text):
        self._log.write(text)
        self._log.flush()
        with open("/tmp/gf_env_log.txt") as f:
            return f.read()


def test_a_clone_writes_its_own_copy_of_a_file_its_source_held_open():
    envs = ForkVectorEnv([KeepsFilesOpen], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("open_things")
        branch = envs.fork("b")
        try:
            assert branch.call("log", "from the branch\n")[0] == (
                "before the fork\nfrom the branch\n"
            )
            assert envs.call("log", "from the source\n")[0] == (
                "before the fork\nfrom the source\n"
            )
            shared = branch.isolation["missing"]["shared_with_source"]
            assert "/dev/shm/gf_mapped" in shared, shared
        finally:
            branch.close()
    finally:
        envs.close()


class KeepsADirectoryOpen(FixedPathEnv):
    """Creates files through a directory fd it keeps (``dir_fd=``, as ``os.fwalk`` does)."""

    def open_directory(self):
        os.makedirs("/tmp/gf_dir", exist_ok=True)
        self._dir = os.open("/tmp/gf_dir", os.O_RDONLY | os.O_DIRECTORY)

    def make(self, name):
        os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=self._dir))
        return sorted(os.listdir("/tmp/gf_dir"))


def test_a_clone_creates_files_in_its_own_copy_of_a_directory_its_source_held_open():
    envs = ForkVectorEnv([KeepsADirectoryOpen], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("open_directory")
        branch = envs.fork("b")
        try:
            assert branch.call("make", "from_branch")[0] == ["from_branch"]
            assert envs.call("make", "from_source")[0] == ["from_source"]
        finally:
            branch.close()
    finally:
        envs.close()


class ForgesItsClones(FixedPathEnv):
    def forge(self):
        """Before a fork: keep the clone in this sandbox's namespaces, but let it claim
        (as an honest clone would) every layer."""
        from gym_fork.system import sandbox_isolation

        def fake(config, tree, achieved):
            achieved.sandbox.update(user=True, mount=True, ipc=True, net=True, private_tmp=True)

        sandbox_isolation.enter_clone_namespaces = fake


def test_a_source_cannot_make_its_branch_report_namespaces_it_does_not_have():
    envs = ForkVectorEnv([ForgesItsClones], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.call("forge")
        branch = envs.fork("b")
        try:
            report = branch.isolation
            assert "shared_namespaces" in report["missing"], report
            assert report["namespaces"]["mount"] is False and report["private_tmp"] is False
        finally:
            branch.close()
    finally:
        envs.close()


def test_a_branch_reports_its_limits_and_its_own_cgroups():
    from gym_fork import SandboxLimits

    envs = ForkVectorEnv(
        [FixedPathEnv], limits=SandboxLimits(memory_bytes=1 << 30), lineage_log=False
    )
    try:
        envs.reset(seed=0)
        branch = envs.fork("b")
        try:
            report = branch.isolation
            assert report["limits"]["memory_bytes"] == 1 << 30, report
            if cgroups.controller_root("memory") is not None:  # test_branch_memory.py
                assert report["limits"]["cgroups"]["own_group"], report
                assert "cgroups" not in report["missing"], report
        finally:
            branch.close()
    finally:
        envs.close()

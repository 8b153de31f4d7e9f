"""What a sandbox can and cannot reach, measured from inside it."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv, SubEnvCrashed, SubEnvError
from gym_fork.system.isolation import SandboxLimits
from tests.helpers import SpaceEnv

ROOT_ONLY = pytest.mark.skipif(
    os.geteuid() != 0, reason="namespaces need root here (no unprivileged user namespaces)"
)


def make():
    return SpaceEnv(spaces.Discrete(4))


def sandboxes(n=2, **kwargs):
    kwargs.setdefault("envs_per_worker", 1)
    kwargs.setdefault("lineage_log", False)
    return ForkVectorEnv([make] * n, **kwargs)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                conn.close()
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


@ROOT_ONLY
def test_no_network_by_default_and_the_host_network_when_asked(listener):
    assert socket.create_connection(("127.0.0.1", listener), timeout=2)  # the host can
    envs = sandboxes()
    try:
        results = envs.call("tcp_connect", listener)
        assert all(r.startswith("failed") for r in results), results
        assert envs.isolation["network"] == "off" and envs.isolation["namespaces"]["net"]
    finally:
        envs.close()
    envs = sandboxes(network=True)
    try:
        assert envs.call("tcp_connect", listener) == ("connected", "connected")
        assert envs.isolation["network"] == "host"
    finally:
        envs.close()


@ROOT_ONLY
def test_tmp_and_dev_shm_are_private_to_each_sandbox():
    name = f"gym-fork-isolation-{os.getpid()}"
    envs = sandboxes(private_tmp=True)
    try:
        envs.set_attr("marker", ["write", "read only"])
        for directory in ("/tmp", "/dev/shm"):
            path = f"{directory}/{name}"
            envs.call("write_tmp_if_marked", path, "secret")
            assert envs.call("read_file", path) == ("secret", None)  # the sibling sees nothing
            assert not os.path.exists(path)  # nor does the host
        report = envs.isolation
        assert report["private_tmp"] and report["namespaces"]["mount"]
        assert report["namespaces"]["ipc"] and report["no_new_privs"]
        assert envs.call("hostname") == ("gym-fork", "gym-fork")
        assert report["namespaces"]["pid"] and "pid" not in report["missing"]
    finally:
        envs.close()
    envs = sandboxes(private_tmp=False)  # the caller's choice: the host's /tmp, as Async
    try:
        assert not envs.isolation["private_tmp"] and "private_tmp" in envs.isolation["missing"]
    finally:
        envs.close()


def test_tmp_is_private_by_default_and_the_hosts_files_stay_readable(tmp_path):
    host_file = tmp_path / "dataset.txt"  # under /tmp: pytest's tmp_path
    host_file.write_text("from the host")
    host_file.chmod(0o666)  # sandboxes run as an unprivileged uid: let them try to write
    envs = sandboxes()
    try:
        assert envs.isolation["private_tmp"]
        assert envs.call("read_file", str(host_file)) == ("from the host",) * 2
        written = f"/tmp/gym_fork-written-by-sub-env-0-{os.getpid()}"
        envs.set_attr("marker", ["write", "initial"])
        envs.call("write_tmp_if_marked", written, "private")
        assert envs.call("read_file", written) == ("private", None)  # not the sibling's
        assert not os.path.exists(written)  # nor the host's
        try:
            envs.call("write_tmp_if_marked", str(host_file), "changed in the sandbox")
        except SubEnvError as exc:
            # In the tree's user namespace, a file of the host's root cannot be copied up
            # into a private layer (its owner is unmapped there): said, with the options.
            text = "\n".join([str(exc), *getattr(exc, "__notes__", [])])
            assert "EOVERFLOW" in text and "sandbox_user='root'" in text, text
            envs.reset(seed=0)
        assert host_file.read_text() == "from the host"  # never the host's file
    finally:
        envs.close()


def test_the_memory_limit_fails_the_allocation_with_a_clear_error():
    envs = sandboxes(1, limits=SandboxLimits(memory_bytes=1 << 30))
    try:
        assert envs.isolation["limits"]["memory_bytes"] == 1 << 30
        with pytest.raises(MemoryError) as info:
            envs.call("allocate", 2 << 30)
        assert "sub-env 0" in "\n".join(info.value.__notes__)
        assert envs.call("allocate", 1 << 20) == (1 << 17,)  # and it keeps working
    finally:
        envs.close()


@pytest.mark.slow  # 1.5 s here
def test_the_cpu_limit_kills_the_sandbox_and_says_so():
    envs = sandboxes(1, limits=SandboxLimits(cpu_seconds=1))
    try:
        with pytest.raises(SubEnvCrashed, match=r"SIGXCPU|SIGKILL") as info:
            envs.call("burn_cpu", 5)
        assert info.value.exitcode in (-signal.SIGXCPU, -signal.SIGKILL)
        envs.reset(seed=0)  # replaced by a fresh sandbox
        assert envs.call("add", 1) == (2,)
    finally:
        envs.close()


def test_missing_layers_are_reported_and_only_the_unavailable_ones_warned_once(monkeypatch):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs = sandboxes(1, namespaces=False)  # the caller's choice: reported, not warned
    try:
        report = envs.isolation
        assert not report["namespaces"]["mount"] and not report["namespaces"]["net"]
        assert "namespaces" in report["missing"] and report["network"] == "host"
        assert not [w for w in caught if "run without" in str(w.message)]
    finally:
        envs.close()

    # A host that cannot give a layer the caller wants: warned once, naming it.
    envs = sandboxes(1, private_tmp=False)
    try:
        from gym_fork.vector.provenance import warn_missing_isolation

        fake = {"missing": {"private_tmp": "the caller's choice", "mount": "unshare failed"}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_missing_isolation(envs.config, fake)
            warn_missing_isolation(envs.config, fake)
        texts = [str(w.message) for w in caught if "run without" in str(w.message)]
        assert len(texts) == 1 and "mount (unshare failed)" in texts[0]
        assert "private_tmp" not in texts[0]  # the caller's choice: not warned
    finally:
        monkeypatch.undo()
        envs.close()


@pytest.mark.skipif(
    __import__("gym_fork.system.cgroups", fromlist=["x"]).controller_root("pids") is None,
    reason="no writable pids cgroup controller on this host",
)
def test_the_process_limit_binds_even_root_through_the_pids_cgroup():
    envs = sandboxes(1, limits=SandboxLimits(processes=3))
    try:
        report = envs.isolation
        assert report["limits"]["cgroups"]["processes"] == 3
        assert "limit_processes" not in report["missing"]
        assert envs.call("spawn_children", 10) == ("refused",)
    finally:
        envs.close()

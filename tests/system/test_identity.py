"""Env code runs as an unprivileged uid with a scrubbed environment (issue 30, items 2-3).

Measured from the trusted side (/proc/<pid>/status) and tried from inside a sandbox, the
way a curious env would: owner-only files, the controller's environment, per-user
kernel quotas."""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from gym_fork import ForkVectorEnv, IsolationMissing
from gym_fork.system import identity
from tests.system.identity_envs import CuriousEnv, cgroup_planting_parent_env, planting_parent_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sandboxes drop from it)")


def _host_uids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("Uid:"))
    return [int(field) for field in line.split()[1:]]


@pytest.fixture
def secrets(tmp_path):
    """An owner-only file and an owner-only directory, as ~/.ssh holds them."""
    tmp_path.chmod(0o755)
    key = tmp_path / "id_ed25519"
    key.write_text("PRIVATE KEY")
    key.chmod(0o600)
    ssh = tmp_path / "ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "config").write_text("Host *")
    (ssh / "config").chmod(0o644)
    shared = tmp_path / "dataset.txt"
    shared.write_text("for everyone")
    shared.chmod(0o644)
    return key, ssh / "config", shared


def test_env_code_runs_as_an_unprivileged_uid_and_owner_only_files_stay_closed(secrets):
    key, inside_closed_dir, shared = secrets
    envs = ForkVectorEnv([CuriousEnv] * 2, lineage_log=False)
    try:
        envs.reset(seed=0)
        uids = {tuple(_host_uids(pid)) for pid in envs.worker_pids}
        assert len(uids) == 1
        (uid,) = {u for u in next(iter(uids))}
        assert uid != 0 and uid == envs.isolation["uid"], (uids, envs.isolation)
        assert "identity" not in envs.isolation["missing"]
        assert envs.call("read", str(key)) == ("EACCES",) * 2
        assert envs.call("read", str(inside_closed_dir)) == ("EACCES",) * 2
        assert envs.call("read", str(shared)) == ("read: for everyone",) * 2  # the drop-in
        branch = envs.fork("b", indices=[0], copies=2)
        try:
            # A clone maps its uid 0 to the same unprivileged host uid.
            assert {tuple(_host_uids(pid)) for pid in branch.worker_pids} == uids
            assert branch.call("read", str(key)) == ("EACCES",) * 2
            assert branch.call("read", str(shared)) == ("read: for everyone",) * 2
        finally:
            branch.close()
    finally:
        envs.close()


def test_per_user_quotas_are_charged_to_the_sandbox_uid_not_to_root():
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/fs/inotify/max_user_instances") as f:
        most = int(f.read())
    envs = ForkVectorEnv([CuriousEnv], lineage_log=False)
    try:
        envs.reset(seed=0)
        taken = envs.call("take_inotify_instances", most + 8)[0]
        assert taken >= most - 8, taken  # it got (nearly) the whole per-user quota ...
        fd = libc.inotify_init1(os.O_CLOEXEC)  # ... and root still has all of its own
        assert fd >= 0, os.strerror(ctypes.get_errno())
        os.close(fd)
    finally:
        envs.close()


def test_a_directory_only_root_may_write_keeps_root_and_says_why(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o755)
    envs = ForkVectorEnv([CuriousEnv], writable_paths=[runs], lineage_log=False)
    try:
        why = envs.isolation["missing"]["identity"]
        assert "writable_paths" in why and "sandbox_user='unprivileged'" in why, why
        assert _host_uids(envs.worker_pids[0])[0] == 0
        assert envs.call("write", str(runs / "log.txt")) == ("written",)
    finally:
        envs.close()
    with pytest.raises(IsolationMissing, match="identity") as info:
        ForkVectorEnv([CuriousEnv], writable_paths=[runs], isolation="strict", lineage_log=False)
    assert "identity" in info.value.missing
    envs = ForkVectorEnv(
        [CuriousEnv], writable_paths=[runs], sandbox_user="unprivileged", lineage_log=False
    )
    try:  # insisting: the uid is unprivileged, and the directory refuses it
        uid = _host_uids(envs.worker_pids[0])[0]
        assert uid == envs.isolation["uid"] and uid >= identity.SANDBOX_UID_BASE
        assert envs.call("write", str(runs / "log.txt")) == ("EACCES",)
    finally:
        envs.close()


def test_bad_identity_options_are_refused_by_name():
    with pytest.raises(ValueError, match="sandbox_user"):
        ForkVectorEnv([CuriousEnv], sandbox_user="nobody")
    with pytest.raises(ValueError, match="isolation"):
        ForkVectorEnv([CuriousEnv], isolation="paranoid")
    with pytest.raises(TypeError, match="pass_env"):
        ForkVectorEnv([CuriousEnv], pass_env="HOME")


_SCRUBBED = textwrap.dedent(
    """
    import sys
    from gym_fork import ForkVectorEnv
    from tests.system.identity_envs import CuriousEnv

    kwargs = eval(sys.argv[1])
    envs = ForkVectorEnv([CuriousEnv], lineage_log=False, **kwargs)
    try:
        env = envs.call("environment")[0]
        raw = envs.call("exec_environment")[0]
        for name in ("AWS_SECRET_ACCESS_KEY", "DATABASE_URL", "MY_SETTING", "PATH"):
            print(name, name in env, name.encode() + b"=" in raw)
    finally:
        envs.close()
    """
)


@pytest.mark.parametrize(
    "kwargs, passed",
    [
        ({}, {"PATH"}),
        ({"sandbox_user": "root"}, {"PATH"}),  # root reads its /proc/self/environ
        ({"pass_env": ["MY_*"]}, {"PATH", "MY_SETTING"}),
        ({"pass_env": True}, {"PATH", "MY_SETTING", "AWS_SECRET_ACCESS_KEY", "DATABASE_URL"}),
    ],
)
@pytest.mark.slow  # 1.1 s here
def test_the_controllers_environment_is_scrubbed_as_a_fresh_process_starts_it(kwargs, passed):
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="k3y", DATABASE_URL="pg://u:pw@h/db")
    env["MY_SETTING"] = "1"
    env["PYTHONPATH"] = os.getcwd()
    out = subprocess.run(
        [sys.executable, "-c", _SCRUBBED, repr(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    seen = {}
    for line in out.stdout.split("\n"):
        if line.count(" ") == 2:
            name, in_environ, in_exec = line.split()
            seen[name] = (in_environ == "True", in_exec == "True")
    for name in ("AWS_SECRET_ACCESS_KEY", "DATABASE_URL", "MY_SETTING", "PATH"):
        # os.environ as env code reads it; /proc/self/environ (what it was started with)
        # never holds what os.environ does not.
        assert seen[name][0] == (name in passed), (name, seen)
        assert not seen[name][1] or seen[name][0], (name, seen)


def test_from_parents_env_fn_runs_as_the_trees_uid_on_a_host_it_cannot_write(secrets):
    """The prototype env is built in the warm parent: as the tree's uid (root of the
    tree's own user namespace only), not as the host's root with every capability, in a
    view of the host that is read-only but for what the caller made writable (before,
    it wrote world-writable host directories such as /var/tmp)."""
    import sysconfig

    key, _, _ = secrets
    site_packages = sysconfig.get_paths()["purelib"]
    # Outside /tmp (the warm parent's /tmp is the tree's own layer): world-writable
    # directories of the host, which an unprivileged uid may write; one of them passed
    # as writable_paths for the report.
    outside = tempfile.mkdtemp(prefix="gym_fork-report-", dir="/var/tmp")
    open_to_all = tempfile.mkdtemp(prefix="gym_fork-open-", dir="/var/tmp")
    for folder in (outside, open_to_all):
        os.chmod(folder, 0o1777)
    report = pathlib.Path(outside) / "report"
    make = planting_parent_env(site_packages, str(key), str(report), open_to_all)
    envs = ForkVectorEnv.from_parent(make, 2, seed=0, lineage_log=False, writable_paths=[outside])
    try:
        pth, etc, var_tmp, secret, euid = report.read_text().split(" ", 4)
        assert pth in ("EACCES", "EROFS") and etc in ("EACCES", "EROFS"), report.read_text()
        assert var_tmp == "EROFS" and not os.listdir(open_to_all), report.read_text()
        assert not os.path.exists(os.path.join(site_packages, "gym_fork_planted.pth"))
        assert secret == "EACCES" and euid == "0"  # root of its namespace, nothing more
        assert "warm_parent_read_only_host" not in envs.isolation["missing"]
        warm_parent = envs.sandboxes.host.pid
        assert _host_uids(warm_parent)[0] == envs.isolation["uid"] != 0
        assert "warm_parent_user_namespace" not in envs.isolation["missing"]
        envs.reset(seed=1)
        assert {_host_uids(pid)[0] for pid in envs.worker_pids} == {envs.isolation["uid"]}
    finally:
        envs.close()
        shutil.rmtree(outside, ignore_errors=True)
        shutil.rmtree(open_to_all, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):  # planted where the boundary failed
            os.unlink(os.path.join(site_packages, "gym_fork_planted.pth"))


def test_groups_env_code_makes_in_its_trees_cgroups_are_removed_with_the_tree():
    """The tree's cgroups are delegated to its uid, so from_parent's env_fn (in the warm
    parent) can make groups in them: a chain 300 deep and a sibling, which the tree's
    teardown removes with the rest (they outlived close() before)."""
    # Outside /tmp: the warm parent's /tmp is the tree's own layer.
    outside = tempfile.mkdtemp(prefix="gym_fork-report-", dir="/var/tmp")
    os.chmod(outside, 0o1777)
    report = pathlib.Path(outside) / "made"
    envs = ForkVectorEnv.from_parent(
        cgroup_planting_parent_env(300, str(report)),
        1,
        writable_paths=[outside],
        sandbox_user="unprivileged",
        lineage_log=False,
    )
    try:
        made = [p for p in report.read_text().splitlines() if p]
        assert made, "the tree's cgroups were not found from the warm parent"
        # the warm parent's view: the host path of its tree's groups is the same
        assert all(os.path.isdir(p) for p in made), made
        trees = {os.sep.join(p.split(os.sep)[:6]) for p in made}
    finally:
        envs.close()
        shutil.rmtree(outside, ignore_errors=True)
    deadline = time.monotonic() + 10
    while any(os.path.exists(t) for t in trees) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in trees if os.path.exists(t)], trees

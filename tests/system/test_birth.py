"""Every process sandbox is born by one sequence (gym_fork/system/birth.py), its role
passed in: for each role, the steps that ran are the ones written there, in that order,
and /proc shows their result (measured from the controller for living sandboxes, from
inside for the warm parent's throw-away build, which lives only while it builds)."""

from __future__ import annotations

import functools
import json
import os
import signal

import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SubEnvCrashed
from gym_fork.system import birth
from gym_fork.system.birth import Role, steps_of
from tests.helpers import wait_until
from tests.system.birth_envs import CAP_SETFCAP, RecordsItsBirth, measured

pytestmark = [
    pytest.mark.process_only,
    pytest.mark.skipif(os.geteuid() != 0, reason="the tree's namespaces need root here"),
]


def _report(worker) -> dict:
    return worker.info["isolation"]


def _assert_confined(seen: dict) -> None:
    """What every sandbox is, whatever its role, once its birth is done."""
    assert seen["no_new_privs"] and seen["seccomp"] == 2, seen
    allowed = 1 << CAP_SETFCAP  # kept for clones' own user namespaces (confine.py)
    assert seen["cap_eff"] & ~allowed == 0, hex(seen["cap_eff"])
    assert seen["root_ro"] and seen["var_tmp_ro"], seen
    assert seen["uid"] != 0, seen  # the tree's unprivileged uid on the host


def _born_as(worker, role: Role) -> dict:
    sandbox = _report(worker)["sandbox"]
    assert sandbox["role"] == role.value, sandbox
    assert sandbox["birth"] == steps_of(role), sandbox["birth"]
    return sandbox


def test_the_written_order_puts_the_privileged_steps_before_confinement():
    """The table's invariants, for every role: namespaces before any mount, cgroups
    before the read-only view, the uid change after every mount, confinement last."""
    for role in Role:
        steps = steps_of(role)
        assert steps[-1] == "confine" and steps.index("no_new_privs") < steps.index("confine")
        if role is Role.CLONE:
            assert steps.index("clone_namespaces") < steps.index("tmpdir")
            assert "identity" not in steps  # a clone is its source's uid already
            continue
        order = [
            "namespaces",
            "cgroups",
            "read_only_view",
            "private_tmp",
            "writable_paths",
            "identity",
        ]
        assert [s for s in steps if s in order] == order, steps


def test_spawned_idle_and_clone_sandboxes_are_born_by_their_roles_sequence():
    envs = ForkVectorEnv([RecordsItsBirth] * 2, lineage_log=False)
    branch = None
    try:
        envs.reset(seed=0)
        warm_parent = measured(envs.sandboxes.host.pid)
        for worker in envs.sandboxes.pool.workers:
            _born_as(worker, Role.SPAWNED)
            seen = measured(worker.pid)
            _assert_confined(seen)
            assert seen["ns"]["mnt"] != warm_parent["ns"]["mnt"]
            assert seen["ns"]["ipc"] != warm_parent["ns"]["ipc"]
        # Replacements come from the warm parent's idle pool (from its second spawn
        # request on, once refilled): born before their spec.
        roles = []
        for attempt in range(6):
            os.kill(envs.worker_pids[0], signal.SIGKILL)
            with pytest.raises(SubEnvCrashed):
                envs.step([0, 0])
            envs.reset(seed=attempt)
            replaced = envs.sandboxes.pool.workers[0]
            roles.append(_report(replaced)["sandbox"]["role"])
            _born_as(replaced, Role(roles[-1]))
            _assert_confined(measured(replaced.pid))
            if roles[-1] == Role.IDLE.value:
                break
        assert roles[-1] == Role.IDLE.value, roles
        source = measured(envs.worker_pids[1])
        branch = envs.fork("b")
        for worker in branch.sandboxes.pool.workers:
            _born_as(worker, Role.CLONE)
            seen = measured(worker.pid)
            _assert_confined(seen)
            for name in ("mnt", "ipc", "net", "user"):  # its own, from its own user ns
                assert seen["ns"][name] != source["ns"][name], name
    finally:
        if branch is not None:
            branch.close()
        envs.close()


def test_the_warm_parents_throw_away_build_is_born_as_a_preimport_sandbox(tmp_path):
    records = tmp_path / "births"
    records.mkdir(mode=0o1777)
    records.chmod(0o1777)
    make = functools.partial(RecordsItsBirth, str(records))
    # (unprivileged whatever the directories above tmp_path allow: the uid is measured)
    envs = ForkVectorEnv(
        [make], writable_paths=[records], sandbox_user="unprivileged", lineage_log=False
    )
    try:
        assert wait_until(lambda: len(os.listdir(records)) >= 2, timeout=10)
        # (named by their pids in the tree's pid namespace)
        seen = [json.loads(path.read_text()) for path in records.iterdir()]
        roles = sorted(record["born"]["role"] for record in seen)
        assert roles == ["preimport", "spawned"], seen
        for record in seen:
            assert record["born"]["steps"] == steps_of(Role(record["born"]["role"]))
            _assert_confined(record)
    finally:
        envs.close()


def test_the_warm_parent_runs_from_parents_env_fn_after_its_own_birth():
    """The prototype env is built in the warm parent: it is born by WARM_PARENT_STEPS,
    and /proc shows it read-only, no_new_privs, as the tree's uid, in a user namespace
    of its own, when from_parent's env_fn runs."""
    envs = ForkVectorEnv.from_parent(RecordsItsBirth, 2, seed=0, lineage_log=False)
    try:
        tree = _report(envs.sandboxes.pool.workers[0])["tree"]
        assert tree["birth"] == list(birth.WARM_PARENT_STEPS), tree
        seen = measured(envs.sandboxes.host.pid)
        assert seen["no_new_privs"] and seen["root_ro"] and seen["var_tmp_ro"], seen
        assert seen["uid"] != 0 and seen["ns"]["user"] != measured(os.getpid())["ns"]["user"]
    finally:
        envs.close()

"""host='microvm': own kernel, clones of a frozen VM, exact replay, faults, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.errors import SubEnvCrashed, SubEnvTimeout
from tests.helpers import wait_until
from tests.microvm.envs import GuestProbeEnv, HangEnv, warm_up

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def probe_envs(n: int = 2, **kwargs) -> ForkVectorEnv:
    return ForkVectorEnv([GuestProbeEnv] * n, host="microvm", envs_per_worker=1, **kwargs)


def test_each_sandbox_runs_its_own_kernel_without_network():
    envs = probe_envs()
    try:
        facts = envs.call("sandbox_facts")
        with open("/proc/sys/kernel/random/boot_id") as f:
            host_boot_id = f.read().strip()
        for fact in facts:
            assert fact["boot_id"] != host_boot_id
            assert fact["interfaces"] == ["lo"] or fact["interfaces"] == []
        report = envs.isolation
        assert report["host"] == "microvm"
        assert report["kernel"] == "own"
        assert report["network"] == "off"
        assert report["accelerator"] in ("kvm", "tcg")
        assert report["guest_kernel"] == facts[0]["kernel"]
        inputs = envs.lineage.tree.inputs
        assert inputs["isolation"]["image"] == report["image"]
    finally:
        envs.close()


def test_writes_are_invisible_to_siblings_and_to_the_host():
    envs = probe_envs()
    try:
        envs.reset(seed=0)
        _, _, _, _, infos = envs.step(np.array([1, 0]))
        files_0, files_1 = infos["files"]
        assert len(files_0) == 1 and files_1 == []
        assert not os.path.exists(os.path.join("/tmp", files_0[0]))
        _, _, _, _, infos = envs.step(np.array([0, 1]))
        assert len(infos["files"][0]) == 1 and len(infos["files"][1]) == 1
        assert infos["files"][0] != infos["files"][1] or envs.worker_pids[0] != 0
    finally:
        envs.close()


def test_from_parent_clones_carry_the_warm_state_and_reset_from_a_fresh_clone():
    envs = ForkVectorEnv.from_parent(GuestProbeEnv, 3, warmup=warm_up, seed=5, host="microvm")
    try:
        _, infos = envs.reset()
        assert list(infos["counter"]) == [100, 100, 100]
        first_pids = envs.worker_pids
        for _ in range(3):
            _, _, _, _, infos = envs.step(np.zeros(3, dtype=np.int64))
        assert list(infos["counter"]) == [103, 103, 103]
        _, infos = envs.reset()  # reset_mode="clone": fresh clones of the parent VM
        assert list(infos["counter"]) == [100, 100, 100]
        assert set(envs.worker_pids).isdisjoint(first_pids)
    finally:
        envs.close()


def test_a_live_fork_replays_exactly_and_reseeding_makes_clones_differ():
    envs = probe_envs(1)
    try:
        envs.reset(seed=3)
        for _ in range(4):
            envs.step(np.array([0]))
        branch = envs.fork("replay", copies=2)
        reseeded = envs.fork("reseeded", copies=2, reseed=11)
        try:
            assert np.array_equal(branch.observations[0], envs.observations[0])
            source_obs = [envs.step(np.array([0]))[0][0] for _ in range(3)]
            branch_obs = [branch.step(np.array([0, 0]))[0] for _ in range(3)]
            for mine, theirs in zip(source_obs, branch_obs, strict=True):
                assert np.array_equal(theirs[0], mine) and np.array_equal(theirs[1], mine)
            _, _, _, _, infos = branch.step(np.array([0, 0]))
            assert list(infos["counter"]) == [4 + 3 + 1, 4 + 3 + 1]
            obs = reseeded.step(np.array([0, 0]))[0]
            assert not np.array_equal(obs[0], obs[1])
            _, _, _, _, infos = reseeded.step(np.array([0, 0]))
            assert infos["random"][0] != infos["random"][1]  # the kernel RNG was reseeded
            grandchild = branch.fork("replay-of-replay", indices=[1])
            assert np.array_equal(grandchild.observations[0], branch.observations[1])
            grandchild.close()
        finally:
            branch.close()
            reseeded.close()
    finally:
        envs.close()


def test_a_branch_outlives_its_source():
    envs = probe_envs(1)
    envs.reset(seed=1)
    branch = envs.fork("orphan")
    envs.close()
    try:
        _, _, _, _, infos = branch.step(np.array([0]))
        assert infos["counter"][0] == 1
    finally:
        branch.close()


def test_a_dead_guest_is_reported_with_its_exit_code_and_replaced_on_reset():
    envs = probe_envs()
    try:
        envs.reset(seed=0)
        with pytest.raises(SubEnvCrashed) as caught:
            envs.step(np.array([2, 0]))
        assert caught.value.indices == [0]
        assert caught.value.exitcode == 7
        envs.reset(seed=0)
        _, _, _, _, infos = envs.step(np.array([0, 0]))
        assert list(infos["counter"]) == [1, 2]
    finally:
        envs.close()


def test_a_hung_guest_is_killed_at_the_timeout():
    envs = ForkVectorEnv([HangEnv] * 2, host="microvm", envs_per_worker=1, timeout=3.0)
    try:
        envs.reset(seed=0)
        started = time.monotonic()
        with pytest.raises(SubEnvTimeout) as caught:
            envs.step(np.array([1, 0]))
        assert time.monotonic() - started < 3.0 + 5.0
        assert caught.value.indices == [0]
        envs.reset(seed=0)
        envs.step(np.array([0, 0]))
    finally:
        envs.close()


def test_per_clone_memory_is_a_small_part_of_guest_ram():
    envs = ForkVectorEnv.from_parent(GuestProbeEnv, 4, host="microvm")
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        guest_ram = envs.vm_memory_mb << 20
        for row in envs.stats():
            assert row["pss"] < guest_ram / 2, row
    finally:
        envs.close()


CONTROLLER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from gym_fork import ForkVectorEnv
    from tests.microvm.envs import GuestProbeEnv
    envs = ForkVectorEnv([GuestProbeEnv] * 2, host="microvm", envs_per_worker=1,
                         lineage_log=False)
    envs.reset(seed=0)
    print(" ".join(map(str, envs.worker_pids)), flush=True)
    time.sleep(600)
    """
)


def test_killing_the_controller_takes_its_vms_with_it():
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER.format(root=ROOT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = controller.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, line
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
        controller.send_signal(signal.SIGKILL)
        controller.wait()

        def gone() -> bool:
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            return False
                except FileNotFoundError:
                    pass
            return True

        assert wait_until(gone, timeout=5.0), f"QEMU processes {pids} outlived the controller"
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
        controller.stdout.close()


def test_an_idle_guest_sleeps_on_its_doorbell_and_wakes_for_the_next_step():
    envs = probe_envs(1)
    try:
        envs.reset(seed=0)
        requests = envs.sandboxes.pool.workers[0].channel.outbox
        assert wait_until(requests.reader_sleeps, timeout=5.0), "the guest kept polling"
        _, _, _, _, infos = envs.step(np.array([0]))
        assert infos["counter"][0] == 1
        assert wait_until(requests.reader_sleeps, timeout=5.0)
        branch = envs.fork("from-a-sleeping-source")
        _, _, _, _, infos = branch.step(np.array([0]))
        assert infos["counter"][0] == 2
        branch.close()
    finally:
        envs.close()


def test_warm_parents_from_one_boot_do_not_share_randomness_or_an_old_clock():
    """Both vector envs restore the same frozen boot; each warm parent takes fresh
    entropy and the controller's clock, so their unseeded sub-envs differ."""
    first = ForkVectorEnv.from_parent(GuestProbeEnv, 1, host="microvm")
    second = ForkVectorEnv.from_parent(GuestProbeEnv, 1, host="microvm")
    try:
        first.reset()
        second.reset()
        randoms = []
        for envs in (first, second):
            _, _, _, _, infos = envs.step(np.array([0]))
            randoms.append(infos["random"][0])
        assert randoms[0] != randoms[1]
        assert abs(first.call("guest_time")[0] - time.time()) < 30
    finally:
        first.close()
        second.close()


def test_a_fork_clones_the_process_the_env_talks_to_and_each_copy_replays_it():
    from tests.microvm.envs import InterpreterEnv

    envs = ForkVectorEnv([InterpreterEnv], host="microvm", envs_per_worker=1)
    try:
        envs.reset(seed=0)
        for a in (1, 2, 3):
            envs.step(np.array([a]))
        branch = envs.fork("with-its-interpreter", copies=2)
        try:
            # The same actions: the source's interpreter and each copy's give one answer.
            for a in (4, 0):
                source_x = envs.step(np.array([a]))[4]["x"][0]
                branch_x = branch.step(np.array([a, a]))[4]["x"]
                assert list(branch_x) == [source_x, source_x]
            # Each copy's interpreter is its own: different inputs, different states,
            # and the source's goes on from where it was.
            _o, _r, _t, _u, infos = branch.step(np.array([1, 2]))
            assert list(infos["x"]) == [source_x * 3 + 1, source_x * 3 + 2]
            assert envs.step(np.array([0]))[4]["x"][0] == source_x * 3
            pids = branch.observations[:, 1]
            assert pids[0] == pids[1] == envs.observations[0, 1]  # the whole guest cloned
        finally:
            branch.close()
    finally:
        envs.close()

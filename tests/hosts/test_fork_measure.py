"""A fork measures its branch's first clone from outside once the clone's source has
replied (every clone set up), while the clone maps its slab and says HELLO: what the
branch records is the clone as it runs, and a measure kept for a pid is never taken for
another process."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest
from gymnasium import spaces

from gym_fork import ForkVectorEnv
from gym_fork.system.linux import ProcessWatch
from gym_fork.system.measure import measure
from tests.helpers import SpaceEnv


def make_env():
    return SpaceEnv(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=1000, trunc_prob=0)


@pytest.fixture
def envs():
    env = ForkVectorEnv.from_parent(make_env, 1, lineage_log=False)
    env.reset(seed=0)
    try:
        yield env
    finally:
        env.close()


def test_the_isolation_a_fork_records_is_its_clone_as_it_runs(envs, monkeypatch):
    """Measured before the HELLO is awaited, it is what the kernel says of the clone
    afterwards."""
    from gym_fork.hosts.process import isolation_report
    from gym_fork.vector.lifecycle import Sandboxes

    order: list[tuple[str, int]] = []
    real_measure, receive_hellos = isolation_report.measure, Sandboxes.receive_hellos

    def measure_seen(pid, *args):
        order.append(("measure", pid))
        return real_measure(pid, *args)

    def receive_hellos_seen(self, workers, *args, **kwargs):
        order.append(("hellos", workers[0].pid))
        return receive_hellos(self, workers, *args, **kwargs)

    monkeypatch.setattr(isolation_report, "measure", measure_seen)
    monkeypatch.setattr(Sandboxes, "receive_hellos", receive_hellos_seen)
    for copies in (1, 3):
        order.clear()
        branch = envs.fork(f"b{copies}", indices=[0], copies=copies)
        try:
            first = branch.worker_pids[0]
            assert order.index(("measure", first)) < order.index(("hellos", first))
            assert order.count(("measure", first)) == 1  # not again for its record
            recorded = branch.lineage.record.isolation
            assert recorded["namespaces"]["mount"] and recorded["private_tmp"]
            assert recorded == branch.isolation  # measured again, from /proc, now
            assert branch.worker_pids[0] not in envs.sandboxes.host._born_measures  # once
        finally:
            branch.close()


def test_a_measure_kept_for_a_pid_is_taken_only_while_its_process_lives(envs):
    host = envs.sandboxes.host
    worker = envs.sandboxes.pool.workers[0]
    truth = envs.isolation
    assert truth["no_new_privs"]
    measured = measure(worker.pid)
    assert measured is not None
    says_less = dataclasses.replace(measured, no_new_privs=False)  # no sandbox here is so
    gone = subprocess.Popen(["true"])
    gone_watch = ProcessWatch(gone.pid)
    gone.wait()
    try:
        host._born_measures[worker.pid] = (gone_watch, says_less)
        assert envs.isolation == truth  # its process is gone: the pid may be another's
        host._born_measures[worker.pid] = (worker.watch, says_less)
        assert envs.isolation["no_new_privs"] is False  # taken while it lives: this test's
        assert envs.isolation == truth  # once
    finally:
        gone_watch.close()
        host._born_measures.pop(worker.pid, None)

"""close() of a branch: its sandboxes are killed before it returns; the controller lets
go of them once their exit is seen, at the latest when the tree's last user closes."""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv
from gym_fork.vector import burial, lifecycle
from tests.helpers import alive, wait_until


def cartpole():
    return gym.make("CartPole-v1")


def _dying(host) -> set[int]:
    return {id(w) for w in burial._DYING.get(host, [])}


def test_a_closed_branch_is_killed_at_close_and_let_go_of_once_gone():
    envs = ForkVectorEnv([cartpole], lineage_log=False)
    try:
        envs.reset(seed=0)
        host = envs.sandboxes.host
        branch = envs.fork("b", copies=2)
        handles = list(branch.sandboxes.pool.workers)
        pids = branch.worker_pids
        branch.close()
        assert all(h.dead for h in handles)  # SIGKILLed before close() returned
        assert wait_until(lambda: not alive(pids), 2.0)
        later = envs.fork("later")  # a fork of the tree lets go of those gone
        assert not _dying(host) & {id(h) for h in handles}
        later.close()
        envs.step(np.array([0]))  # the root is untouched
    finally:
        envs.close()
    assert host not in burial._DYING


def test_the_last_user_of_a_tree_waits_for_every_sandbox_it_killed():
    envs = ForkVectorEnv([cartpole], lineage_log=False)
    envs.reset(seed=0)
    host = envs.sandboxes.host
    first, second = envs.fork("first"), envs.fork("second")
    pids = first.worker_pids + second.worker_pids + envs.worker_pids
    first.close()  # the root and the second branch still use the warm parent
    envs.close()
    second.close()  # the last user: nothing is left once it returns
    assert not alive(pids)
    assert host not in burial._DYING


def test_a_close_cut_short_still_kills_every_sandbox_and_closes_the_warm_parent(monkeypatch):
    """Ctrl-C (or a warning turned error) while the sandboxes answer CLOSE: close()
    raises it, and nothing of the tree is left running."""
    envs = ForkVectorEnv([cartpole, cartpole], lineage_log=False)
    envs.reset(seed=0)
    host = envs.sandboxes.host
    pids = [*envs.worker_pids, host.pid]

    def interrupted(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "note_tmp_leftovers", interrupted)
    try:
        envs.close()
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the KeyboardInterrupt was swallowed")
    assert wait_until(lambda: not alive(pids), 5.0), [p for p in pids if alive([p])]
    assert host not in burial._DYING
    assert envs.sandboxes not in lifecycle._OPEN


def test_a_fork_of_the_controller_leaves_the_parents_sandboxes_alone():
    """A child forked from the controller (a data loader, a user's os.fork()) that
    closes the env it inherited, or just exits, does not close the parent's."""
    envs = ForkVectorEnv([cartpole], lineage_log=False)
    try:
        envs.reset(seed=0)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                envs.close()
                # What an exit would run of ours (not every library's handler: the suite's
                # process has torch's threads by now, and their handlers are not ours).
                lifecycle._close_all_at_exit()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _, rewards, _, _, _ = envs.step(np.array([0]))
        assert list(rewards) == [1.0]
    finally:
        envs.close()

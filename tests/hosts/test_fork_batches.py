"""Batches of clones (gym_fork/hosts/batching.py): fork_overlapped asks every source before
it awaits any answer, one request per source at a time, and on a failure still takes
every answer asked for and releases every clone made; spawn_in_batches releases the
earlier batches when one fails."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest

from gym_fork.hosts.base import ForkJob
from gym_fork.hosts.batching import Finishing, fork_overlapped, spawn_in_batches


class Clone:
    """A stand-in for a WorkerHandle: release_all kills and releases it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.released = False

    def kill(self) -> None:
        pass

    def release(self) -> None:
        self.released = True


def job(source: str, clones: int) -> ForkJob:
    return ForkJob(source, list(range(clones)), list(range(clones)), None)


def test_every_source_is_asked_before_any_answer_is_awaited():
    events = []

    def start(job, orders, slab_fds, keep):
        events.append(f"ask {job.source} {orders}")

        def wait():
            events.append(f"answer {job.source} {orders}")
            return orders

        keep(Finishing(wait, lambda answer: [Clone(f"{job.source}{o}") for o in answer], list))

    made = fork_overlapped([job("a", 3), job("b", 1)], 2, start)
    assert [[c.name for c in clones] for clones in made] == [["a0", "a1", "a2"], ["b0"]]
    assert events == [
        "ask a [0, 1]",
        "ask b [0]",
        "answer a [0, 1]",
        "ask a [2]",  # its next batch once the last one is answered
        "answer b [0]",
        "answer a [2]",
    ]


def test_a_failure_takes_every_answer_asked_for_and_releases_every_clone():
    made = []

    def start(job, orders, slab_fds, keep):
        def wait():
            if job.source == "a":
                raise OSError("a failed")
            return orders

        def adopt(answer):
            clones = [Clone(f"{job.source}{o}") for o in answer]
            made.extend(clones)
            return clones

        keep(Finishing(wait, adopt, list))

    with pytest.raises(OSError, match="a failed"):
        fork_overlapped([job("a", 1), job("b", 2)], 1, start)
    assert [c.name for c in made] == ["b0"]  # b's answer was asked for: taken
    assert all(c.released for c in made)


def test_a_ctrl_c_while_clones_are_adopted_comes_once_they_are_kept_then_released(ctrl_c):
    """The source answered: its clones exist. A Ctrl-C while their handles are made
    waits until they are kept, and they are released (else no handle would hold them)."""
    made = []

    def start(job, orders, slab_fds, keep):
        def adopt(answer):
            ctrl_c()
            sum(range(1000))  # the KeyboardInterrupt would have come by now, unheld
            clones = [Clone(f"{job.source}{o}") for o in answer]
            made.extend(clones)
            return clones

        keep(Finishing(lambda: orders, adopt, list))

    with pytest.raises(KeyboardInterrupt):
        fork_overlapped([job("a", 2)], 1, start)
    assert [(c.name, c.released) for c in made] == [("a0", True)]


def test_a_ctrl_c_right_after_an_answer_still_has_its_clones_adopted_and_released(ctrl_c):
    """The Ctrl-C lands as the answer is taken, before the adoption holds signals: the
    request is still pending, so the clones its answer names are adopted, then
    released (not left to no one)."""
    made, fired = [], []

    def wait_for(orders):
        return orders

    def ctrl_c_as_wait_returns(frame, event, arg):
        if event == "return" and frame.f_code is wait_for.__code__ and not fired:
            fired.append(True)
            ctrl_c()  # handled in the caller, past the return

    def start(job, orders, slab_fds, keep):
        def adopt(answer):
            clones = [Clone(f"{job.source}{o}") for o in answer]
            made.extend(clones)
            return clones

        keep(Finishing(lambda: wait_for(orders), adopt, list))

    sys.setprofile(ctrl_c_as_wait_returns)
    try:
        with pytest.raises(KeyboardInterrupt):
            fork_overlapped([job("a", 1)], 1, start)
    finally:
        sys.setprofile(None)
    assert fired
    assert [(c.name, c.released) for c in made] == [("a0", True)]


def test_spawn_in_batches_releases_the_earlier_batches_when_one_fails():
    made = []

    def make(specs, slab_fds):
        if specs == [4]:
            raise OSError("full")
        clones = [Clone(str(s)) for s in specs]
        made.extend(clones)
        return clones

    assert [c.name for c in spawn_in_batches([0, 1, 2], [0, 1, 2], 2, make)] == ["0", "1", "2"]
    with pytest.raises(OSError, match="full"):
        spawn_in_batches([3, 4], [3, 4], 1, make)
    assert [(c.name, c.released) for c in made[3:]] == [("3", True)]


def _fork_cut_short_while_answered(envs, monkeypatch) -> None:
    """A fork of ``envs`` whose first wait for its source's answer is cut short by a
    KeyboardInterrupt (the source forks on, its answer read afterwards)."""
    pool_class = type(envs.sandboxes.pool)
    ask_later = pool_class.ask_later

    def interrupted_ask(self, worker, op, arg, timeout):
        result = ask_later(self, worker, op, arg, timeout)
        cut = []

        def cut_short():
            if not cut:  # the first wait: cut short before the answer is read
                cut.append(1)
                raise KeyboardInterrupt
            return result()

        return cut_short

    monkeypatch.setattr(pool_class, "ask_later", interrupted_ask)
    with pytest.raises(KeyboardInterrupt):
        envs.fork("interrupted")
    monkeypatch.undo()


def test_a_ctrl_c_while_a_fork_is_answered_kills_the_clones_the_source_made(monkeypatch):
    """The Ctrl-C comes while the controller waits for the source's answer: the source
    forks on (nothing told it in time), so its clones are killed once it says which,
    and no process is left that no handle holds."""
    import gymnasium as gym
    import numpy as np

    from gym_fork import ForkVectorEnv
    from tests.helpers import descendants, wait_until

    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.fork("warm").close()
        before = descendants()
        _fork_cut_short_while_answered(envs, monkeypatch)
        envs.step(np.zeros(1, np.int64))  # answered once the source is done with its FORK
        assert wait_until(lambda: descendants() <= before, timeout=10), descendants() - before
        envs.fork("after").close()
    finally:
        envs.close()


def test_a_ctrl_c_as_a_fork_is_kept_leaves_it_to_the_caller_to_finish(ctrl_c, monkeypatch):
    """The Ctrl-C lands as the source's FORK is handed to fork_overlapped (held until it
    is kept there): the caller takes the answer and releases the clones; nothing gives
    the fork up twice (a second wait for the answer would hang), no clone outlives it,
    and the source forks again (no stale answer waits for its next request). Before,
    a Ctrl-C between the start's return and its record lost the fork: its clones lived
    on, and the source's answer stayed unread."""
    import numpy as np

    from gym_fork import ForkVectorEnv
    from gym_fork.hosts.process import forking
    from tests.helpers import descendants, wait_until

    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.fork("warm").close()
        before = descendants()
        made = []

        def finishing_then_ctrl_c(*args):
            made.append(Finishing(*args))
            ctrl_c()
            return made[-1]

        monkeypatch.setattr(forking, "Finishing", finishing_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            envs.fork("interrupted")
        monkeypatch.undo()
        assert made
        envs.step(np.zeros(1, np.int64))  # answered once the source is done with its FORK
        assert wait_until(lambda: descendants() <= before, timeout=10), descendants() - before
        envs.fork("after").close()
    finally:
        envs.close()


class NamesItsWarmParent(gym.Wrapper):
    """A CartPole whose sandbox, once told, answers a FORK's ClonesForked naming its
    parent (the warm parent, by pidfd) instead of its clones: env code rules its
    process, and the controller kills what a given-up fork's answer names."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def name_the_parent(self) -> int:
        import os

        from gym_fork.hosts.process import messages

        real = messages.send_with_pidfds
        parent = os.getppid()

        def lying(sock, message, pids, fds):
            if isinstance(message, messages.ClonesForked):
                fd = os.pidfd_open(parent)
                try:
                    lie = messages.ClonesForked([parent], fork_id=message.fork_id)
                    return real(sock, lie, [parent], [fd])
                finally:
                    os.close(fd)
            return real(sock, message, pids, fds)

        messages.send_with_pidfds = lying
        return parent


def test_a_given_up_forks_clones_named_by_a_hostile_source_spare_its_warm_parent(monkeypatch):
    """The Ctrl-C comes while the controller waits for the FORK's answer; the source's
    ClonesForked then names the warm parent: nothing but new sandboxes of the tree is
    killed (a SIGKILL to the warm parent would take every sandbox down with it). Its
    next fork, not given up, is refused by adoption; the source steps on."""
    import numpy as np

    from gym_fork import ForkVectorEnv
    from gym_fork.errors import SandboxStartError
    from tests.helpers import wait_until

    envs = ForkVectorEnv([NamesItsWarmParent], lineage_log=False)
    try:
        envs.reset(seed=0)
        envs.fork("warm").close()
        envs.call("name_the_parent")
        _fork_cut_short_while_answered(envs, monkeypatch)
        host = envs.sandboxes.host
        # A killed pid 1 of the tree's pid namespace takes a moment to be seen gone.
        assert not wait_until(lambda: not host.alive(), timeout=1.0)
        obs, *_ = envs.step(np.zeros(1, np.int64))  # the source serves on
        assert obs.shape == (1, 4)
        with pytest.raises(SandboxStartError, match="pidfds do not match"):
            envs.fork("after")  # it lies on: refused, and its warm parent lives on
        assert not wait_until(lambda: not host.alive(), timeout=1.0)
        envs.step(np.zeros(1, np.int64))
    finally:
        envs.close()

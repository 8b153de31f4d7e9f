"""The process host's worker: the worker loop in a sandbox process (isolated at birth,
with a side socket to the controller, able to FORK its sub-envs), and how a sandbox the
warm parent made starts it (:func:`serve`) or rehearses that start (:func:`rehearse`).
A sandbox's life as a process and the FORK itself are in ``sandbox.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process.sandbox import fork_clones
from gym_fork.system.birth import Role, be_born
from gym_fork.system.isolation import IsolationConfig
from gym_fork.system.sandbox_isolation import private_tmp_leftovers
from gym_fork.system.scratch import remove_scratch
from gym_fork.transport.channel import DEFAULT_RING_BYTES, Channel
from gym_fork.transport.slab import Slab
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import Worker

# Seconds a sandbox that answered CLOSE waits for its SIGKILL before it exits itself.
CLOSED_WAIT_S = 5.0


class ProcessWorker(Worker):
    """The worker loop in a forked process: isolated at birth, able to fork its sub-envs
    into new sandboxes (adopted by the warm parent ``warm_parent``)."""

    def __init__(
        self,
        channel: Channel,
        indices: Sequence[int],
        origins: Sequence[int],
        make_env: Callable[[int], gym.Env],
        slab_fd: int,
        sock: socket.socket,
        warm_parent: int,
        isolation: tuple[IsolationConfig, Any],
    ) -> None:
        super().__init__(channel, indices, origins, make_env, slab_fd)
        channel.region.keep_from_forks()  # its clones' are their own (sandbox.py)
        self.sock = sock
        self.warm_parent = warm_parent
        self.isolation_config, self.tree_isolation = isolation
        self.scratch: str | None = None

    def open_slab(self, obs_space, act_space, num_envs: int, use_observations: bool) -> Slab:
        """Its slab, not mapped in the clones it forks (they map their own)."""
        slab = super().open_slab(obs_space, act_space, num_envs, use_observations)
        slab.region.keep_from_forks()
        return slab

    def enter_sandbox(self, role: Role, copy_from: str | None = None) -> None:
        """Isolate this freshly forked process as a sandbox of ``role``
        (gym_fork/system/birth.py)."""
        self.scratch, achieved = be_born(
            role, self.isolation_config, self.tree_isolation, self.warm_parent, copy_from
        )
        self.isolation = achieved.report()

    def identity(self) -> dict[str, Any]:
        # A scratch dir inside the tree's private /tmp is nothing the controller can reach.
        on_host = not self.tree_isolation.tree.get("private_tmp")
        return {**super().identity(), "scratch": self.scratch if on_host else None}

    def run(self, first_wait_asleep: bool = False) -> None:
        """Serve until CLOSE, then wait (CLOSED_WAIT_S at most) for the controller's
        SIGKILL, which comes once every sandbox of the close() has answered: exiting at
        once would take a core from the siblings still answering (a Pong sandbox's exit
        is ~2.4 ms of one), and the controller no longer waits for the exits."""
        super().run(first_wait_asleep)
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(CLOSED_WAIT_S)

    def extra_handlers(self):
        return {P.FORK: self._guarded(self.fork)}

    def fork(self, arg: dict[str, Any]) -> list[int] | dict[str, list[str]]:
        """Clone sub-envs of this worker into new sandboxes (:func:`fork_clones`); the
        fds arrive on the side socket. Returns the clones' pids (or why it refused)."""
        return fork_clones(self, arg)

    def on_close(self) -> dict[str, int] | None:
        """Remove the scratch dir; report what the env left in its private /tmp (gone
        with the sandbox), for the controller's one note about it."""
        remove_scratch(self.scratch)
        return private_tmp_leftovers()


def serve(
    channel_fd: int,
    ring_capacity: int,
    slab_fd: int,
    sock_fd: int,
    spec: M.SandboxSpec,
    make_env: Callable[[int], gym.Env],
    *,
    warm_parent: int,
    isolation: tuple[IsolationConfig, Any],
    attach: dict[str, Any] | None = None,
    entered: tuple[str | None, dict[str, Any]] | None = None,
) -> None:
    """Entry point of a spawned sandbox: isolate, attach the channel, build, serve.

    ``entered``: (scratch dir, isolation report) of a sandbox that isolated itself
    before it got its fds (an idle sandbox of the warm parent's pool)."""
    worker = ProcessWorker(
        Channel.attach(channel_fd, ring_capacity, spec.name),
        spec.indices,
        spec.origins,
        make_env,
        slab_fd,
        socket.socket(fileno=sock_fd),
        warm_parent,
        isolation,
    )
    if entered is None:
        worker.enter_sandbox(Role.SPAWNED)
    else:
        worker.scratch, worker.isolation = entered
    if worker.hello(attach):
        worker.run()


def rehearse(
    make_env: Callable[[int], gym.Env],
    attach: dict[str, Any],
    *,
    warm_parent: int,
    isolation: tuple[IsolationConfig, Any],
    entered: tuple[str | None, dict[str, Any]],
) -> None:
    """In an idle sandbox of a warm parent with a prepared env, before its assignment:
    do what :func:`serve` will do until its HELLO, on a channel and slab of its own, and
    drop it. The pages of the warm parent's that this writes (the reference counts of
    every object the code touches, ~300 pages) are copied now, not after the assignment,
    where they cost ~1.7 ms of a clone's 6.5 (docs/benchmarks.md, "Branching"). Only where
    ``make_env`` hands out the prepared env as it is: nothing is built, and the env code
    that runs (its spaces' comparisons in the attach) is what :func:`serve` runs too."""
    with contextlib.ExitStack() as opened:
        owner = Slab(
            attach["observation_space"],
            attach["action_space"],
            1,
            use_observations=attach["shared_memory"],
        )
        opened.callback(owner.close)
        ring = Channel.create("rehearsal", DEFAULT_RING_BYTES)
        opened.callback(ring.close)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        opened.callback(ours.close)
        opened.callback(theirs.close)
        channel = Channel.attach(os.dup(ring.region.fd), DEFAULT_RING_BYTES, "rehearsal")
        opened.callback(channel.close)
        slab_fd = os.dup(owner.region.fd)  # the worker's own, closed with its slab
        worker: ProcessWorker | None = None

        def close_slab() -> None:
            if worker is not None and worker.slab is not None:
                worker.slab.close()
            else:
                os.close(slab_fd)

        opened.callback(close_slab)
        worker = ProcessWorker(channel, [0], [0], make_env, slab_fd, theirs, warm_parent, isolation)
        worker.scratch, worker.isolation = entered
        worker.hello(attach)

"""Inside a process sandbox: its life as a process (isolation, output, exit) and the
worker loop with the process host's extras (a side socket, FORK of running sub-envs)."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import gymnasium as gym

from gym_fork.system.isolation import IsolationConfig, enter_sandbox, private_tmp_leftovers
from gym_fork.system.scratch import remove_scratch
from gym_fork.transport.channel import Channel
from gym_fork.transport.control import send_message
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import Worker

# Fds handed to a new sandbox: its slab, channel, side socket, stdout, stderr.
FDS_PER_SANDBOX = 5


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
        self.sock = sock
        self.warm_parent = warm_parent
        self.isolation_config, self.tree_isolation = isolation
        self.scratch: str | None = None

    def enter_sandbox(self, copy_from: str | None = None) -> None:
        """Isolate this freshly forked process (gym_fork/system/isolation.py)."""
        self.scratch, achieved = enter_sandbox(
            self.isolation_config, self.tree_isolation, self.warm_parent, copy_from
        )
        self.isolation = achieved.report()

    def identity(self) -> dict[str, Any]:
        # A scratch dir inside the tree's private /tmp is nothing the controller can reach.
        on_host = not self.tree_isolation.tree.get("private_tmp")
        return {**super().identity(), "scratch": self.scratch if on_host else None}

    def extra_handlers(self):
        return {P.FORK: self._guarded(self.fork)}

    def fork(self, arg: dict[str, Any]) -> list[int]:
        """Clone sub-envs of this worker into new sandboxes (gym_fork/hosts/process/
        clones.py); the fds arrive on the side socket. Returns the clones' pids."""
        from gym_fork.hosts.process.clones import fork_clones

        return fork_clones(self, arg)

    def on_close(self) -> dict[str, int] | None:
        """Remove the scratch dir; report what the env left in its private /tmp (gone
        with the sandbox), for the controller's one note about it."""
        remove_scratch(self.scratch)
        return private_tmp_leftovers()


def run_as_sandbox(body: Callable[[], None]) -> NoReturn:
    """Run a sandbox process's whole life; it never returns into the code that forked it."""
    code = 0
    try:
        body()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def send_with_pidfds(sock: socket.socket, message: dict, pids: list[int]) -> None:
    """Send ``message`` with a pidfd of each of ``pids`` (the controller learns their
    pids in its own namespace from them); ``message["pidfds"]`` says which came (a
    process already reaped has none)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            fds.append(-1)
    try:
        sent = [fd for fd in fds if fd >= 0]
        send_message(sock, {**message, "pidfds": [fd >= 0 for fd in fds]}, fds=tuple(sent))
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def redirect_output(out_fd: int, err_fd: int) -> None:
    """Point fds 1 and 2 (and so print, logging, C stdio) at this sandbox's own pipes."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)


def serve(
    channel_fd: int,
    ring_capacity: int,
    slab_fd: int,
    sock_fd: int,
    spec: dict[str, Any],
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
        Channel.attach(channel_fd, ring_capacity, spec["name"]),
        spec["indices"],
        spec["origins"],
        make_env,
        slab_fd,
        socket.socket(fileno=sock_fd),
        warm_parent,
        isolation,
    )
    if entered is None:
        worker.enter_sandbox()
    else:
        worker.scratch, worker.isolation = entered
    if worker.hello(attach):
        worker.run()

"""What the controller makes for a new sandbox before the sandbox exists (its channel,
side socket and output pipes), how it hands them over, and what it keeps of them."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gym_fork.hosts.base import WorkerHandle, WorkerSpec
from gym_fork.hosts.output import OutputCollector
from gym_fork.system.linux import ProcessWatch
from gym_fork.transport.channel import Channel

SIDE_SEND_TIMEOUT_S = 10.0  # a side-socket message is sent in microseconds


@dataclass
class SandboxLink:
    """What the controller keeps per sandbox besides the handle's fields: its side
    socket (fds for FORK travel on it) and its pid inside the tree's pid namespace
    (the warm parent knows its sandboxes by that one)."""

    sock: socket.socket
    local_pid: int

    def close(self) -> None:
        self.sock.close()


_output_keys = itertools.count()


class SandboxEnds:
    """What the controller makes for a new sandbox before it exists: its channel, side
    socket and output pipes. ``fds()`` are handed over (spawn or fork); then
    ``handed_over()`` closes the controller's copies of the sandbox's ends."""

    def __init__(self, spec: WorkerSpec, ring_capacity: int, output: OutputCollector) -> None:
        self.spec = spec
        self.output = output
        self.channel = Channel.create(spec.name, ring_capacity)
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # A send to a sandbox that never reads its socket (full) fails instead of hanging
        # the controller; every read on it has its own deadline as well.
        self.ours.settimeout(SIDE_SEND_TIMEOUT_S)
        (self.out_r, self.out_w), (self.err_r, self.err_w) = output.new_pipes()

    def fds(self) -> list[int]:
        return [self.channel.region.fd, self.theirs.fileno(), self.out_w, self.err_w]

    def handed_over(self) -> None:
        self.theirs.close()
        os.close(self.out_w)
        os.close(self.err_w)
        self.channel.region.forget_fd()  # mapped already; the sandbox holds its own fd

    def abort(self) -> None:
        """The sandbox was never made: close everything."""
        self.channel.close()
        self.ours.close()
        for fd in (self.out_r, self.err_r):
            os.close(fd)

    def handle(self, local_pid: int, watch: ProcessWatch) -> WorkerHandle:
        """The handle of the sandbox, known to the controller by its host pid."""
        # Keyed by its own name: a sandbox dead before it was adopted has no pid of ours.
        key = f"{self.spec.name}#{next(_output_keys)}"
        self.output.watch(key, self.out_r, self.err_r)
        return WorkerHandle(
            self.spec.name,
            list(self.spec.indices),
            self.channel,
            watch.pid,
            watch,
            list(self.spec.origins),
            output=self.output,
            host_data=SandboxLink(self.ours, local_pid),
            output_key=key,
        )


def hand_over(ends: list[SandboxEnds], exchange: Callable[[], Any]) -> Any:
    """Run ``exchange`` (send the ends' fds, wait for the answer), then close the
    controller's copies of the sandboxes' ends; if it fails, close everything."""
    try:
        result = exchange()
    except BaseException:
        for end in ends:
            end.handed_over()
            end.abort()
        raise
    for end in ends:
        end.handed_over()
    return result

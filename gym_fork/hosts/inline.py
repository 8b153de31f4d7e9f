"""The in-process host (``host="inline"``): the worker loop in a thread of the controller.

For debugging (a breakpoint inside ``env.step`` stops in your own process) and for unit
tests of the pool, faults and worker loop without forking. The same worker loop serves
the same channel and slab as in a sandbox, so every record still crosses the codec; but
there is no isolation at all: sub-envs share the controller's memory, files, network and
fate. It cannot fork running sub-envs (there is no process to clone), a hung sub-env's
thread cannot be killed (it is abandoned), and a sub-env that crashes the interpreter
crashes the controller. ``from_parent`` and ``reset_mode="clone"`` rebuild the prepared
env from scratch for every sandbox (a cold start).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any

import cloudpickle

from gym_fork.hosts.base import (
    AskWorker,
    CloneOrder,
    HostConfig,
    IsolationReport,
    SharedByBranches,
    WorkerHandle,
    WorkerSpec,
)
from gym_fork.hosts.output import OutputCollector
from gym_fork.transport.channel import Channel
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import Worker


class ThreadWatch:
    """The liveness of an inline worker: its thread. ``kill`` can only abandon it."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread
        self.abandoned = False

    def alive(self) -> bool:
        """True while the thread serves and has not been abandoned."""
        return self.thread.is_alive() and not self.abandoned

    def kill(self, sig: int = 0) -> None:
        """A thread cannot be killed: stop waiting for it (it is a daemon thread)."""
        self.abandoned = True

    def wait_dead(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end; True if it did."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self) -> None:
        """Nothing to release."""


class InlineHost(SharedByBranches):
    """Serves every sub-env in a thread of the controller's own process."""

    kind = "inline"
    slab_min_bytes = 0

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.gpu_pid: int | None = None  # nothing is forked
        # None: the sub-envs write to the controller's own stdout and stderr.
        self.output: OutputCollector | None = None
        self._closed = False
        self._threads: list[threading.Thread] = []

    def make_env(self, origin: int):
        """A fresh build of env_fns[origin], prepared as ``from_parent`` asks."""
        preparation = self.config.prepare
        if preparation is not None:
            return preparation.prepared_env(self.config.env_fns[0])
        return self.config.env_fns[origin]()

    def spawn(
        self,
        specs: Sequence[WorkerSpec],
        slab_fds: Sequence[int],
        ring_capacity: int,
        attach: bytes | None = None,
    ) -> list[WorkerHandle]:
        """One worker thread per spec, over a channel and slab like a sandbox's."""
        attach_arg = None if attach is None else cloudpickle.loads(attach)
        handles = []
        for spec, slab_fd in zip(specs, slab_fds, strict=True):
            channel = Channel.create(spec.name, ring_capacity)
            theirs = Channel.attach(os.dup(channel.region.fd), ring_capacity, spec.name)
            worker = Worker(theirs, spec.indices, spec.origins, self.make_env, os.dup(slab_fd))
            thread = threading.Thread(
                target=_serve, args=(worker, attach_arg), name=f"gym_fork-inline {spec.name}"
            )
            thread.daemon = True
            thread.start()
            self._threads.append(thread)
            handles.append(
                WorkerHandle(
                    spec.name,
                    list(spec.indices),
                    channel,
                    self.pid,
                    ThreadWatch(thread),
                    list(spec.origins),
                    host_data=_InlineSandbox(channel, thread),
                )
            )
        return handles

    def fork(
        self,
        source: WorkerHandle,
        orders: Sequence[CloneOrder],
        num_envs: int,
        slab_fds: Sequence[int],
        ring_capacity: int,
        ask: AskWorker,
    ) -> list[WorkerHandle]:
        """Refused: a running env in the controller's own process cannot be cloned."""
        raise NotImplementedError(
            "host='inline' cannot fork running sub-envs: there is no sandbox process to "
            "clone (and deepcopy does not copy every env's state). Use host='process'."
        )

    def alive(self) -> bool:
        """The controller is the warm parent: alive until closed."""
        return not self._closed

    def tree(self) -> list[WorkerHandle]:
        """None: the sandboxes are threads of the controller, not processes a signal
        could stop one by one."""
        return []

    def exit_code(self, worker: WorkerHandle) -> int | None:
        """A thread has no exit code."""
        return None

    def measure_born(self, worker: WorkerHandle) -> None:
        """Nothing to measure: sub-envs run in the controller."""

    def check_slab(self, nbytes: int) -> None:
        """Any slab fits."""

    def isolation(
        self, sandbox: dict[str, Any] | None = None, pid: int | None = None
    ) -> IsolationReport:
        """None: the sub-envs run in the controller."""
        why = "host='inline' runs sub-envs in the controller's own process"
        return IsolationReport(
            host=self.kind,
            network="host",
            namespaces={"mount": False, "ipc": False, "uts": False, "net": False, "pid": False},
            private_tmp=False,
            no_new_privs=False,
            limits={},
            missing={"process": why},
            details={"process": False, "address_space": "shared with the controller"},
        )

    def close(self) -> None:
        """Worker threads end when their channel is closed; nothing else to stop."""
        self._closed = True
        for thread in self._threads:
            thread.join(0.5)
        self._threads = [t for t in self._threads if t.is_alive()]


class _InlineSandbox:
    """At release, a worker thread still waiting for requests is told to CLOSE, so that
    it ends and lets go of its channel and slab (a hung one ends when its call does)."""

    def __init__(self, channel: Channel, thread: threading.Thread) -> None:
        self.channel = channel
        self.thread = thread

    def close(self) -> None:
        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                self.channel.send([P.CLOSE, 0, None], timeout=0.1)
            self.thread.join(1.0)


def _serve(worker: Worker, attach: dict[str, Any] | None) -> None:
    try:
        if worker.hello(attach):
            worker.run()
    finally:
        if worker.slab is not None:
            worker.slab.close()
        elif worker.slab_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(worker.slab_fd)
        worker.channel.close()

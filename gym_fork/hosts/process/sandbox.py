"""Inside a process sandbox: its life as a process (isolation, output, exit), the worker
loop with the process host's extras (a side socket), and forking its running sub-envs
into new sandboxes (the process host's branch point).

A worker asked to FORK makes its clones with a double fork: short-lived intermediates
fork the clones and exit, so the clones are orphaned and adopted by the warm parent (a
child subreaper, or the init of the tree's pid namespace) and outlive the worker they
were forked from. A large fan-out is split over one intermediate per core: forking
copies this process's page tables, and two cores copy them twice as fast.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import gymnasium as gym

from gym_fork.hosts.process import messages as M
from gym_fork.system.isolation import (
    IsolationConfig,
    before_forking_clones,
    enter_sandbox,
    private_tmp_leftovers,
)
from gym_fork.system.linux import die_with_parent
from gym_fork.system.scratch import remove_scratch
from gym_fork.transport.channel import Channel
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import SubEnvSlot, Worker

# A fan-out gets one more intermediate (up to one per core) per this many clones.
FORKS_PER_INTERMEDIATE = 16


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
        """Clone sub-envs of this worker into new sandboxes (:func:`fork_clones`); the
        fds arrive on the side socket. Returns the clones' pids."""
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
        worker.enter_sandbox()
    else:
        worker.scratch, worker.isolation = entered
    if worker.hello(attach):
        worker.run()


# -- forking clones (FORK) -------------------------------------------------------------


@dataclass
class _Clone:
    slot: SubEnvSlot
    branch_index: int
    seed: int | None
    name: str
    fds: tuple[int, ...]  # slab, channel, side socket, stdout, stderr
    others: tuple[tuple[int, int], ...] = ()  # [lo, hi) runs of the other clones' fds


def _runs_without(fds: list[int], keep: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``fds`` less ``keep`` as [lo, hi) runs of consecutive numbers: fds received in
    one message are mostly consecutive, so a clone closes the others' with a few
    close_range calls (os.closerange) instead of one close per fd."""
    runs: list[tuple[int, int]] = []
    for fd in sorted(set(fds) - set(keep)):
        if runs and runs[-1][1] == fd:
            runs[-1] = (runs[-1][0], fd + 1)
        else:
            runs.append((fd, fd + 1))
    return tuple(runs)


def fork_clones(worker: ProcessWorker, arg: dict[str, Any]) -> list[int]:
    """Serve a FORK: ``arg["clones"]`` lists ``[source_index, branch_index, seed,
    name]``; the fds (``FDS_PER_SANDBOX`` per clone, its own slab first) arrive on the
    worker's side socket. Returns the clones' pids, in order."""
    clones = arg["clones"]
    handed, fds = M.receive(worker.sock, M.CloneFds)
    try:
        per = M.FDS_PER_SANDBOX
        if handed.clones != len(clones):
            raise RuntimeError(f"fork: fds for {handed.clones} clones, {len(clones)} asked")
        plan = []
        for k, (source_index, branch_index, seed, name) in enumerate(clones):
            slot = worker.hosted(source_index)
            if seed is not None and not isinstance(seed, int):
                raise TypeError(f"fork: a seed must be an int or None, got {seed!r}")
            plan.append(_Clone(slot, branch_index, seed, name, tuple(fds[per * k : per * (k + 1)])))
        for clone in plan:  # computed here once: shared by every clone, not redone
            clone.others = _runs_without(fds, clone.fds)
        if worker.attach_arg is None:
            raise RuntimeError("fork: this worker has not attached its slab yet")
        before_forking_clones(worker.scratch, worker.tree_isolation)
        gc.freeze()  # what lives now is shared with the clones: keep the GC off it
        pids = _double_fork(worker, plan, arg["num_envs"], arg["ring_capacity"])
        # The controller learns the clones' pids in its own pid namespace from these.
        M.send_with_pidfds(worker.sock, M.ClonesForked(pids), pids)
        return pids
    finally:
        for fd in fds:
            os.close(fd)


def _double_fork(worker, plan: list[_Clone], num_envs: int, capacity: int) -> list[int]:
    read_end, write_end = os.pipe()
    # The gate: clones block on it until every intermediate (its only other writers)
    # is gone, i.e. until they are orphans about to be adopted, instead of polling.
    gate_read, gate_write = os.pipe()
    cores = len(os.sched_getaffinity(0)) or 1
    parts = max(1, min(cores, len(plan) // FORKS_PER_INTERMEDIATE))
    crowded = len(plan) > cores
    intermediates = []
    for part in range(parts):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                _release_source(worker)  # once here, not once in every clone
                for k in range(part, len(plan), parts):
                    clone = os.fork()
                    if clone == 0:
                        os.close(gate_write)
                        # write_end is kept until the clone has copied its source's
                        # /tmp and /dev/shm: the source waits for its EOF, so it cannot
                        # change them before every clone has its snapshot.
                        _become_clone(
                            worker, plan[k], num_envs, capacity, gate_read, crowded, write_end
                        )
                    # 16 bytes < PIPE_BUF: writes from several intermediates never mix
                    os.write(write_end, k.to_bytes(8, "little") + clone.to_bytes(8, "little"))
            finally:
                os._exit(0)
        intermediates.append(pid)
    os.close(gate_read)
    os.close(gate_write)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    for pid in intermediates:
        os.waitpid(pid, 0)
    if len(data) != 16 * len(plan):
        raise RuntimeError(
            f"fork: {len(data) // 16} of {len(plan)} clones were created before a failure"
        )
    pids = [0] * len(plan)
    for i in range(0, len(data), 16):
        pids[int.from_bytes(data[i : i + 8], "little")] = int.from_bytes(
            data[i + 8 : i + 16], "little"
        )
    return pids


def _release_source(worker: ProcessWorker) -> None:
    """In an intermediate, before it forks clones: let go of the source's channel,
    socket and slab (not the clones'; nothing is written to them, only unmapped and
    closed), so that no clone has them or spends time closing them."""
    worker.channel.close()
    worker.sock.close()
    if worker.slab is not None:
        worker.slab.close()


def _first_wait_asleep(channel: Channel) -> None:
    """Wait for the first request asleep (futex) instead of spinning first: in a fan-out
    larger than the cores, the clones would otherwise spin while their siblings and the
    controller need the cores to finish the branch. Later waits spin as usual."""
    ring = channel.inbox
    spin = ring.spin
    ring.spin = 0
    recv = channel.recv

    def first_recv(*args, **kwargs):
        try:
            return recv(*args, **kwargs)
        finally:
            ring.spin = spin
            del channel.recv  # the class's method again

    channel.recv = first_recv  # type: ignore[method-assign]  # this instance, for one call


def _become_clone(
    worker: ProcessWorker,
    clone: _Clone,
    num_envs: int,
    capacity: int,
    gate: int,
    crowded: bool,
    snapshot: int,
) -> None:
    slab_fd, channel_fd, sock_fd, out_fd, err_fd = clone.fds
    redirect_output(out_fd, err_fd)

    def body() -> None:
        for lo, hi in clone.others:
            os.closerange(lo, hi)
        child = ProcessWorker(
            Channel.attach(channel_fd, capacity, clone.name),
            worker.indices,
            worker.origins,
            worker.make_env,
            slab_fd,
            socket.socket(fileno=sock_fd),
            worker.warm_parent,
            (worker.isolation_config, worker.tree_isolation),
        )
        child.slots, child.attach_arg = worker.slots, worker.attach_arg
        child.enter_sandbox(copy_from=worker.scratch)
        os.close(snapshot)
        child.become_clone(clone.slot.index, clone.branch_index, clone.seed, num_envs)
        _await_adoption(gate, worker.warm_parent)
        if crowded:
            _first_wait_asleep(child.channel)
        child.run()

    run_as_sandbox(body)


def _await_adoption(gate: int, warm_parent: int) -> None:
    """Block until the intermediate is gone (EOF on the gate), then tie our life to the
    warm parent that adopts us. Set-up and HELLO happen before, in parallel."""
    while os.read(gate, 1):
        pass
    os.close(gate)
    deadline = time.monotonic() + 5.0
    while os.getppid() != warm_parent and time.monotonic() < deadline:
        time.sleep(0.0001)  # exit_files() runs just before the reparenting in exit()
    die_with_parent(warm_parent)

"""Forking running sub-envs into new process sandboxes (the process host's branch point).

A worker asked to FORK makes its clones with a double fork: short-lived intermediates
fork the clones and exit, so the clones are orphaned and adopted by the warm parent (a
child subreaper) and outlive the worker they were forked from. A large fan-out is split
over one intermediate per core: forking copies this process's page tables, and two
cores copy them twice as fast.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from gym_fork.system.isolation import before_forking_clones
from gym_fork.system.linux import die_with_parent
from gym_fork.transport.channel import Channel
from gym_fork.transport.control import recv_message
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import SubEnvSlot, reseed_env

from .sandbox import (
    FDS_PER_SANDBOX,
    ProcessWorker,
    redirect_output,
    run_as_sandbox,
    send_with_pidfds,
)

# A fan-out gets one more intermediate (up to one per core) per this many clones.
FORKS_PER_INTERMEDIATE = 16


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
    name]``; the fds (FDS_PER_SANDBOX per clone, its own slab first) arrive on the
    worker's side socket. Returns the clones' pids, in order."""
    clones = arg["clones"]
    _message, fds = recv_message(worker.sock)
    try:
        per = FDS_PER_SANDBOX
        if len(fds) != per * len(clones):
            raise RuntimeError(f"fork: expected {per * len(clones)} fds, got {len(fds)}")
        plan = []
        for k, (source_index, branch_index, seed, name) in enumerate(clones):
            slot = next((s for s in worker.slots if s.index == source_index), None)
            if slot is None:
                raise RuntimeError(f"fork: this worker does not host sub-env {source_index}")
            if seed is not None and not isinstance(seed, int):
                raise TypeError(f"fork: a seed must be an int or None, got {seed!r}")
            plan.append(_Clone(slot, branch_index, seed, name, tuple(fds[per * k : per * (k + 1)])))
        for clone in plan:  # computed here once: shared by every clone, not redone
            clone.others = _runs_without(fds, clone.fds)
        branch_arg = dict(worker.attach_arg, num_envs=arg["num_envs"])
        before_forking_clones(worker.scratch, worker.tree_isolation)
        gc.freeze()  # what lives now is shared with the clones: keep the GC off it
        pids = _double_fork(worker, plan, branch_arg, arg["ring_capacity"])
        # The controller learns the clones' pids in its own pid namespace from these.
        send_with_pidfds(worker.sock, {"op": "forked", "pids": pids}, pids)
        return pids
    finally:
        for fd in fds:
            os.close(fd)


def _double_fork(worker, plan: list[_Clone], branch_arg, capacity) -> list[int]:
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
                            worker, plan[k], branch_arg, capacity, gate_read, crowded, write_end
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

    channel.recv = first_recv


def _become_clone(
    worker: ProcessWorker, clone: _Clone, branch_arg, capacity, gate, crowded: bool, snapshot: int
) -> None:
    slab_fd, channel_fd, sock_fd, out_fd, err_fd = clone.fds
    redirect_output(out_fd, err_fd)

    def body() -> None:
        for lo, hi in clone.others:
            os.closerange(lo, hi)
        slot = clone.slot
        origin = worker.origins[worker.slots.index(slot)]
        slot.index = clone.branch_index
        if clone.seed is not None:
            reseed_env(slot.env, clone.seed)
        child = ProcessWorker(
            Channel.attach(channel_fd, capacity, clone.name),
            [clone.branch_index],
            [origin],
            worker.make_env,
            slab_fd,
            socket.socket(fileno=sock_fd),
            worker.warm_parent,
            (worker.isolation_config, worker.tree_isolation),
        )
        child.slots = [slot]
        child.enter_sandbox(copy_from=worker.scratch)
        os.close(snapshot)
        child.attach(branch_arg)
        child.channel.send([P.HELLO, 0, child.identity(), None])
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

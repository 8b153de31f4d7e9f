"""Inside a process sandbox: its life as a process (output, exit), and forking a worker's
running sub-envs into new sandboxes (the process host's branch point). The worker loop
itself (``ProcessWorker``) and a sandbox's start (``serve``, ``rehearse``) moved to
``worker.py``.

A worker asked to FORK makes each clone a sibling of its own (clone(2) with CLONE_PARENT,
:func:`gym_fork.system.linux.fork_sibling`): the clone is born a child of the warm parent
(a child subreaper, or the init of the tree's pid namespace), dies with it from its first
instruction on and outlives the worker it was forked from, with no intermediate process
to fork it, exit and leave it to be adopted (a worker with threads still does that: a
double fork). A large fan-out is split over one helper per core: forking copies this
process's page tables, and two cores copy them twice as fast. Whoever forks a clone
holds its pidfd: a FORK that fails midway (a clone the kernel refuses, snapshots not
taken by their deadline) kills the clones made so far, and the controller gets the
pidfds of those of a FORK that succeeds.

(Over ~450 lines as one job: a FORK's two sides, the source's and each clone's first
steps up to its birth, share the fan-out's pipes and state (``_FanOut``) and hand over
to each other in an order that is read side by side: the layer word, the snapshot, the
commit.)
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from gym_fork.hosts.process import messages as M
from gym_fork.system import cgroups, env_code_hold, layer_slots
from gym_fork.system.birth import Role
from gym_fork.system.children import read_until_closed
from gym_fork.system.fan_out import Forked, fork_all
from gym_fork.system.linux import (
    block_signals,
    can_fork_sibling,
    die_with_parent,
    has_threads,
    live_children,
    restore_signals,
    wait_readable,
)
from gym_fork.system.sandbox_isolation import (
    adopt_frozen_layer,
    before_forking_clones,
    writes_tmp_files,
)
from gym_fork.transport.channel import Channel
from gym_fork.transport.region import Region
from gym_fork.worker.loop import SubEnvSlot

if TYPE_CHECKING:
    from gym_fork.hosts.process.worker import ProcessWorker

_COMMIT = b"c"  # one per clone on the commit pipe (_FanOut.commit)
# Seconds after the FORK's own deadline (SNAPSHOT_TIMEOUT) that a clone waits for its
# commit: the worker writes it right after the reports, the snapshots and one send.
COMMIT_GRACE = 10.0
# A fan-out gets one more helper (up to one per core) per this many clones.
FORKS_PER_HELPER = 16
# Seconds a FORK waits for its clones' snapshots of the source's /tmp and /dev/shm (and
# its helpers' reports): env code runs in a clone from its first instruction (at-fork
# hooks) and may hold the pipe open forever. Then those made are killed.
SNAPSHOT_TIMEOUT = 60.0


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


# -- forking clones (FORK) -------------------------------------------------------------


def refuse_child_processes() -> None:
    """A fork on the process host clones the env's own process only: a shell or an
    interpreter the env started and talks to would be shared by the source and every
    clone (each writing to its stdin, reading its answers). Refused, naming them and
    the host that clones them too."""
    children = live_children()
    if children:
        named = ", ".join(f"{name} (pid {pid})" for pid, name in children[:8])
        raise RuntimeError(
            f"fork: this sub-env's process has {len(children)} child process(es) of its own "
            f"({named}); a fork on the process host clones only the env's process, so its "
            "branches would share them with the source. host='microvm' clones the whole "
            "machine, child processes included; or end them before forking"
        )


@dataclass
class _Clone:
    slot: SubEnvSlot
    branch_index: int
    seed: int | None
    name: str
    fds: tuple[int, ...]  # slab, channel, side socket, stdout, stderr, its cgroups' procs
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


# Seconds a worker waits for the controller's next word on its side socket in a FORK
# (its clones' fds, its new /tmp layer, the frozen one sealed: milliseconds). Longer
# than the controller's own waits in between (the layer helper: 10 s at most), so that
# the controller, not the worker, is the one that gives up.
SIDE_TIMEOUT_S = 60.0


def fork_clones(worker: ProcessWorker, arg: dict[str, Any]) -> list[int] | dict[str, list[str]]:
    """Serve a FORK: ``arg["clones"]`` lists ``[source_index, branch_index, seed,
    name]``; the fds (``FDS_PER_SANDBOX`` per clone, its own slab first, then its
    cgroups') arrive on the worker's side socket. Returns the clones' pids, in order;
    with ``arg["shared_memory"] == "refuse"``, {"shared_with_source": names, "envs":
    class names} instead, before any clone is made, if they would share memory or files
    with this worker."""
    clones = arg["clones"]
    fork_id = arg.get("fork_id")
    if type(fork_id) is not int:
        raise TypeError(f"fork: a FORK's id must be an int, got {fork_id!r}")
    # From now until its /tmp is final for its clones (the freeze begins once it says so:
    # ForkQuiet): its new layer taken, or where none comes (they copy its writes), their
    # snapshots taken (a signal handler writing /tmp meanwhile would be in their copies).
    env_code_hold.hold()
    try:
        handed, fds = M.receive_for(
            worker.sock, fork_id, M.CloneFds, SIDE_TIMEOUT_S, "clone fds", _late
        )
    except BaseException:
        env_code_hold.release()
        raise
    # The layer helper is freezing its /tmp writes now (``layer_follows``): the clones
    # are forked meanwhile and wait, before their namespaces, until this worker has
    # taken its new layer (the freeze, ~1.5 ms, off a fork's critical path). Taken
    # whatever fails first: its /tmp stands on that layer.
    layer_taken = [not handed.layer_follows]
    layer_ms = [0.0]  # its time on the layer: the swap as it lives it (benchmarks)

    def take_layer(tell: Callable[[bool], None] | None = None) -> bool:
        layer_taken[0] = True
        started = time.perf_counter()
        frozen = _take_frozen_layer(worker, fork_id, tell)
        if frozen:
            layer_ms[0] = (time.perf_counter() - started) * 1e3
            env_code_hold.release()  # its clones stand on the frozen layer: its /tmp is its own
        return frozen

    try:
        if not layer_taken[0]:  # the controller asks the freeze once it hears this
            M.send(worker.sock, M.ForkQuiet(fork_id))
        if not layer_taken[0] and has_threads():
            # A thread of its may write /tmp while the helper swaps it: between the new
            # /tmp's mount and the fork, a write would land in the new layer, which its
            # clones, forked holding the old one, would not copy. Taken first, as before.
            take_layer()
        refuse_child_processes()
        per = handed.fds_per_clone()
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
        handed_fds = frozenset(fds)
        # What its clones close (looked for once), and no memfd of the env's.
        own = {fd for region in _own_regions(worker) for fd in region.held_fds(skip=handed_fds)}
        skip = handed_fds | own
        swapping = not layer_taken[0]  # the helper may be moving its /tmp writes now
        shared = before_forking_clones(worker.scratch, worker.tree_isolation, skip, swapping)
        if swapping and writes_tmp_files():
            # Its clones would inherit a file of the frozen layer open for writing, and
            # hold its seal back until they reopened it: the layer is taken first, and
            # what they inherit listed again (on its new layer).
            take_layer()
            shared = before_forking_clones(worker.scratch, worker.tree_isolation, skip)
        if shared and arg.get("shared_memory") == "refuse":
            envs = sorted({type(clone.slot.env.unwrapped).__name__ for clone in plan})
            return {"shared_with_source": shared, "envs": envs}
        gc.freeze()  # what lives now is shared with the clones: keep the GC off it
        commit = os.pipe()
        try:
            made = _fork_siblings(
                worker,
                plan,
                arg["num_envs"],
                arg["ring_capacity"],
                commit,
                handed,
                None if layer_taken[0] else take_layer,
            )
            try:
                watches = [made.watches[k] for k in range(len(plan))]
                pids = [watch.pid for watch in watches]
                # The controller learns the clones' pids in its own pid namespace from these.
                M.send_with_pidfds(
                    worker.sock,
                    M.ClonesForked(pids, fork_id=fork_id, layer_ms=layer_ms[0]),
                    pids,
                    [watch.fd for watch in watches],
                )
                os.write(commit[1], _COMMIT * len(plan))  # each clone may serve now
            except BaseException:
                made.kill()  # the controller will never know them
                raise
            finally:
                made.close()
        finally:
            for fd in commit:
                os.close(fd)
        return pids
    finally:
        try:
            if not layer_taken[0]:  # failed before: its /tmp stands on the new layer
                with contextlib.suppress(Exception):
                    take_layer()
        finally:
            env_code_hold.release()
            for fd in fds:
                os.close(fd)


def _take_frozen_layer(
    worker: ProcessWorker, fork_id: int, tell: Callable[[bool], None] | None = None
) -> bool:
    """The controller's word on this worker's /tmp, frozen while it woke: where its
    writes are a shared read-only layer now, keep the new upper layer that comes with
    it (reopening its /tmp files there) and, if the frozen layer could not be sealed at
    once (a file of it was open for writing), say so and wait until it is. A fork the
    controller gave up on (``cancelled``) fails here, its layer kept all the same.
    Returns whether a layer came (its writes are frozen: a clone's /tmp stands on it).

    ``tell``: the clones forked before this learn it as soon as it is certain, before
    this worker adopts its layer (the helper's mounts are what their mount namespaces
    copy; this worker's fds are not theirs); where a seal is still awaited, the caller
    tells them afterwards."""
    layer, fds = M.receive_for(
        worker.sock, fork_id, M.FrozenLayer, SIDE_TIMEOUT_S, "frozen layer", _late
    )
    why, cancelled = "", layer.cancelled
    if tell is not None and not cancelled and (layer.sealed or not layer.frozen):
        tell(layer.frozen)
    if layer.frozen:
        failed: Exception | None = None
        try:
            adopt_frozen_layer(fds[0])
        except Exception as exc:  # whatever it was: the controller waits for a word
            failed = exc
        if not layer.sealed:  # a file of it was open for writing: sealed now
            M.send(worker.sock, M.LayerAdopted(fork_id))
            sealed, _ = M.receive_for(
                worker.sock, fork_id, M.LayerSealed, SIDE_TIMEOUT_S, "seal", _late
            )
            why = "" if sealed.sealed else sealed.why
            cancelled = cancelled or sealed.cancelled
        if failed is not None:
            raise failed
    else:
        M.close_fds(fds)
    if cancelled:
        raise RuntimeError("fork: the controller gave it up")
    if why:
        raise RuntimeError(f"fork: its /tmp's frozen layer is not read-only: {why}")
    return layer.frozen


def _late(message: M.Message, fds: list[int]) -> None:
    """A side-socket message of an earlier FORK, read at a later one: a new /tmp layer
    that came too late (this worker had given up waiting) is its /tmp all the same, and
    is kept; anything else is dropped."""
    if isinstance(message, M.FrozenLayer) and message.frozen and len(fds) == 1:
        with contextlib.suppress(Exception):
            adopt_frozen_layer(fds[0])
        return
    M.close_fds(fds)


@dataclass
class _FanOut:
    """What every clone of one FORK is forked with, and how."""

    worker: ProcessWorker
    plan: list[_Clone]
    num_envs: int
    capacity: int
    crowded: bool  # more clones than cores
    snapshot: int  # the write end each clone keeps until it has copied the source's files
    handed: M.CloneFds  # what came with the clones' fds (what their cgroup fds are)
    # -1: clones are siblings (fork_sibling). Else the read end of the gate of the
    # double fork (a threaded source): clones block on it until every helper (its only
    # writers) is gone, i.e. until they are orphans about to be adopted.
    gate: int = -1
    # The read end of the commit pipe: a clone serves only once it reads a byte from it,
    # written after the controller has learnt every clone. EOF (the FORK failed, its
    # worker died) makes it exit: a clone a killed helper made but never reported is
    # known to no one else.
    commit: int = -1
    # The read end of the layer pipe, where the source takes its /tmp's new layer after
    # forking: a clone reads one byte before its namespaces (b"F": its source's writes
    # are a frozen layer now, b"N": no layer, copy them); EOF: the FORK failed. -1: none.
    layer: int = -1
    deadline: float = 0.0  # time.monotonic() past which the FORK has failed for certain
    # The source's ``random`` module state: CPython reseeds it in every forked child
    # (an at-fork hook), which would make a branch's draws differ from its source's.
    random_state: Any = None


def _fork_siblings(
    worker,
    plan: list[_Clone],
    num_envs: int,
    capacity: int,
    commit: tuple[int, int],
    handed: M.CloneFds,
    take_layer: Callable[[Callable[[bool], None] | None], bool] | None = None,
) -> Forked:
    """Fork every clone of ``plan`` into a child of the warm parent; returns them once
    every clone has its snapshot of this worker's /tmp and /dev/shm. If any cannot be
    made, or the snapshots take more than SNAPSHOT_TIMEOUT, those made are killed and
    RuntimeError says why (gym_fork/system/fan_out.py).

    Each clone is forked as a sibling of this worker, by the worker itself or, for a
    large fan-out, by helpers (siblings too). fork_sibling runs none of the C library's
    fork handlers, which keep a threaded process's locks sane across fork: a worker with
    threads (an env's) double-forks instead.

    ``take_layer``: the source's new /tmp layer is taken once the clones are forked
    (they wait for it, :func:`_await_layer`); it says whether a layer came, and tells
    them as soon as that is certain where they fit on the cores (else once it has
    adopted its layer)."""
    # Each clone keeps the write end until it has copied its source's /tmp and /dev/shm:
    # EOF says the source may change them again.
    read_end, write_end = os.pipe()
    layer_read, layer_write = os.pipe() if take_layer is not None else (-1, -1)
    deadline = time.monotonic() + SNAPSHOT_TIMEOUT
    cores = len(os.sched_getaffinity(0)) or 1
    fan = _FanOut(worker, plan, num_envs, capacity, len(plan) > cores, write_end, handed)
    fan.commit, fan.deadline = commit[0], deadline + COMMIT_GRACE
    fan.layer = layer_read
    fan.random_state = random.getstate()
    gate_write = -1
    if has_threads() or not can_fork_sibling():
        fan.gate, gate_write = os.pipe()
    made = None
    try:
        try:
            made = fork_all(
                len(plan),
                lambda k, close: _become_clone(fan, plan[k], close),
                sibling=fan.gate < 0,
                helpers=max(1, min(cores, len(plan) // FORKS_PER_HELPER)),
                close=(read_end, gate_write, commit[1], layer_write),
                deadline=deadline,
                seconds=SNAPSHOT_TIMEOUT,
            )
        finally:
            for fd in (write_end, fan.gate, gate_write, layer_read):
                if fd >= 0:
                    os.close(fd)
        if take_layer is not None:  # its clones wait for it (a failure: EOF, they exit)
            told: list[bool] = []
            unsaid: list[OSError] = []

            def tell(frozen: bool) -> None:
                told.append(frozen)
                words = (b"F" if frozen else b"N") * len(plan)
                mask = None
                try:  # raises nothing: what failed is raised once the layer is taken
                    mask = block_signals()  # an env's SIGPIPE handler (SIG_DFL: death) waits
                    while words:  # a pipe takes up to 4 KiB at once
                        words = words[os.write(layer_write, words) :]
                except OSError as exc:
                    unsaid.append(exc)
                    if exc.errno == errno.EPIPE:  # every clone gone: not this worker's end
                        signal.sigtimedwait([signal.SIGPIPE], 0)
                finally:
                    if mask is not None:
                        restore_signals(mask)

            # More clones than cores: their births would take the cores from its own
            # adoption (its layer time 1.2 -> 6.6 ms at 8 clones, 2.5 -> 10-52 at 64,
            # on 2 cores): told once it has its layer.
            frozen = take_layer(None if fan.crowded else tell)
            if not told:
                tell(frozen)
            if unsaid:
                raise RuntimeError(
                    f"fork: its clones were gone before its word on its /tmp layer "
                    f"({unsaid[0]}): env code of theirs ended them as they were forked "
                    "(an at-fork hook), or they were killed"
                ) from unsaid[0]
        _await_snapshots(read_end, deadline)
        # Its /tmp is final for its clones: its env code runs again, here, where a signal
        # handler that raises fails the FORK with its clones killed (not once announced).
        env_code_hold.release()
    except BaseException:
        if made is not None:
            made.kill()
        raise
    finally:
        os.close(read_end)
        if layer_write >= 0:
            os.close(layer_write)
    return made


def _await_snapshots(read_end: int, deadline: float) -> None:
    """Until every clone has its snapshot (EOF: none holds the write end any more);
    RuntimeError past ``deadline`` or if one wrote on it."""
    written = read_until_closed(read_end, 0, deadline)
    if written:
        raise RuntimeError("fork: a clone wrote on its snapshot pipe")
    if not wait_readable(read_end, 0):
        raise RuntimeError(
            f"fork: the clones did not take their snapshot of /tmp and /dev/shm within "
            f"{SNAPSHOT_TIMEOUT} s (env code in a clone may hold the pipe open)"
        )


# In a clone: its source's channel and slab objects, whose memory the fork did not map
# here (MADV_DONTFORK). Never touched nor freed: freeing one would unmap its range,
# where the kernel may have mapped something of the clone's since.
_NOT_MAPPED_HERE: list[object] = []


def _own_regions(worker: ProcessWorker) -> list[Region]:
    """A worker's channel's and slab's shared memory."""
    return [worker.channel.region] + ([worker.slab.region] if worker.slab else [])


def _release_source(worker: ProcessWorker) -> None:
    """In a clone: let go of the source's channel, socket and slab (nothing is written
    to them). A mapping the source kept from its forks was never inherited (~0.3 ms and
    ~90 copy-on-write faults of Python teardown spared): only its fds are closed; one
    inherited is unmapped and closed."""
    kept = [part for part in (worker.channel, worker.slab) if part and not part.region.inherited]
    _NOT_MAPPED_HERE.append(kept)  # never freed: that would unmap what may be ours now
    for part in kept:
        part.region.close_inherited_fds()
    if worker.channel not in kept:
        worker.channel.close()
    if worker.slab is not None and worker.slab not in kept:
        worker.slab.close()
    worker.sock.close()


def _become_clone(fan: _FanOut, clone: _Clone, close: list[tuple[int, int]]) -> NoReturn:
    worker, snapshot = fan.worker, fan.snapshot
    slab_fd, channel_fd, sock_fd, out_fd, err_fd = clone.fds[: M.FDS_PER_SANDBOX]

    def body() -> None:
        random.setstate(fan.random_state)  # replays its source's draws (reseed: its own)
        handed = fan.handed
        if handed.cgroups or handed.cgroup_errors:  # first: its pages are its own from here
            limits = worker.isolation_config.limits
            cgroups.join_at_fork(
                list(clone.fds[M.FDS_PER_SANDBOX :]),
                handed.cgroups,
                handed.cgroup_errors,
                {"memory_bytes": limits.memory_bytes, "processes": limits.processes},
            )
        if fan.gate < 0:  # born a child of the warm parent: its death is ours from now on
            die_with_parent(worker.warm_parent)
        redirect_output(out_fd, err_fd)
        _release_source(worker)
        for lo, hi in (*clone.others, *close):
            os.closerange(lo, hi)
        # The source's own class (worker.py imports this module, so not by name).
        child = type(worker)(
            Channel.attach(channel_fd, fan.capacity, clone.name),
            worker.indices,
            worker.origins,
            worker.make_env,
            slab_fd,
            socket.socket(fileno=sock_fd),
            worker.warm_parent,
            (worker.isolation_config, worker.tree_isolation),
        )
        child.slots, child.attach_arg = worker.slots, worker.attach_arg
        if fan.layer >= 0:
            _await_layer(fan.layer, fan.deadline)
        child.enter_sandbox(Role.CLONE, copy_from=worker.scratch)
        env_code_hold.release()  # held off in its source as it was forked: its own now
        os.close(snapshot)
        child.become_clone(clone.slot.index, clone.branch_index, clone.seed, fan.num_envs)
        if fan.gate >= 0:
            _await_adoption(fan.gate, worker.warm_parent, fan.deadline)
        left = fan.deadline - time.monotonic()
        if not wait_readable(fan.commit, max(0.0, left)) or os.read(fan.commit, 1) != _COMMIT:
            os._exit(0)  # the FORK failed (or a hung helper holds the pipe): no one's clone
        os.close(fan.commit)
        # In a fan-out larger than the cores, a clone spinning on its first wait would
        # take a core its siblings and the controller need to finish the branch.
        child.run(first_wait_asleep=fan.crowded)

    run_as_sandbox(body)


def _await_layer(layer: int, deadline: float) -> None:
    """A clone forked before its source took its /tmp's new layer: wait for its word
    before the namespaces (its mount namespace is a copy of its source's as it makes
    it: the frozen layer's slot must be there); exit where the source failed (EOF) or
    past ``deadline``."""
    if not wait_readable(layer, max(0.0, deadline - time.monotonic())):
        os._exit(0)
    word = os.read(layer, 1)
    if word not in (b"F", b"N"):
        os._exit(0)  # EOF: the FORK failed
    os.close(layer)
    if word == b"F":
        layer_slots.adopted_layer()  # as its source counted it, after this fork


def _await_adoption(gate: int, warm_parent: int, deadline: float) -> None:
    """A clone of the double fork: block until every helper is gone (EOF on the gate),
    then tie our life to the warm parent that adopts us; exit if that has not happened
    by ``deadline`` (a helper hung in env code). Set-up and HELLO happen before, in
    parallel."""
    while True:
        if not wait_readable(gate, max(0.0, deadline - time.monotonic())):
            os._exit(0)
        if not os.read(gate, 1):
            break
    os.close(gate)
    deadline = time.monotonic() + 5.0
    while os.getppid() != warm_parent and time.monotonic() < deadline:
        time.sleep(0.0001)  # exit_files() runs just before the reparenting in exit()
    die_with_parent(warm_parent)

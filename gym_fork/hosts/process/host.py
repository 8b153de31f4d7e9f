"""Controller side of the process host: one warm parent, many forked worker sandboxes.

The fork path (a FORK asked of running sandboxes, their clones' fds and cgroups) is
``forking.py``, the isolation report of a sandbox or the tree ``isolation_report.py``:
``ProcessHost.fork_many`` and ``ProcessHost.isolation`` hand over to them.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from gym_fork import notices
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.base import (
    ForkJob,
    HostConfig,
    IsolationReport,
    SharedByBranches,
    Watch,
    WorkerHandle,
    WorkerSpec,
)
from gym_fork.hosts.batching import spawn_in_batches
from gym_fork.hosts.output import OutputCollector
from gym_fork.hosts.preparing import init_message, raise_prepare_failure
from gym_fork.hosts.process import forking, isolation_report, preimport, zygote
from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process.ends import SandboxEnds, hand_over
from gym_fork.hosts.process.forking import SPAWN_BATCH
from gym_fork.hosts.process.layers import TmpLayers
from gym_fork.hosts.process.leases import MAX_LEASES, OWED_WAIT_S, IdleLeases, Lease
from gym_fork.system import cgroups, children
from gym_fork.system.linux import ProcessWatch, raise_fd_limit
from gym_fork.system.measure import Measured
from gym_fork.system.scratch import sweep
from gym_fork.text_safety import escape_controls
from gym_fork.transport.control import peer_closed
from gym_fork.transport.typed_messages import adopt_pidfds

# The id of every tree this process started (the host pid of the process that isolates
# it, the warm parent's parent): its cgroups and scratch dirs carry that id, so a leak
# check beside other processes' trees can tell its own apart.
TREES_STARTED: set[int] = set()


class ProcessHost(SharedByBranches):
    """Starts a warm parent from a clean interpreter and asks it to fork workers.

    ``env_fns`` travel once, with cloudpickle, in the init message
    (:func:`gym_fork.hosts.preparing.init_message`).
    """

    kind = "process"
    slab_min_bytes = 0

    def __init__(self, config: HostConfig, *, echo_output: bool = True) -> None:
        self.config = config
        self.output: OutputCollector | None = OutputCollector(echo=echo_output)
        raise_fd_limit()
        self._lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.watch: ProcessWatch | None = None  # of the warm parent process we started
        self.process: subprocess.Popen | None = None  # that process, if our child
        # Every sandbox made from this warm parent that the controller still holds (of
        # the vector env and of its branches), weakly: see tree().
        self._handles: weakref.WeakValueDictionary[int, WorkerHandle] = (
            weakref.WeakValueDictionary()
        )
        self._handle_ids = itertools.count()
        self.fork_ids = itertools.count(1)  # each FORK's, in its side-socket messages
        self._measure_cache: dict[int, Measured | None] = {}  # see _measured_once
        # pid -> (a watch of that process, what was measured): see measure_born
        self._born_measures: dict[int, tuple[Watch, Measured | None]] = {}
        self._leases = IdleLeases()  # idle sandboxes the warm parent leased to us
        self.tmp_layers = TmpLayers(config.isolation)  # frozen /tmp writes at a fork
        self._unreachable = False  # a send to it failed: the next health check replaces it
        try:
            setup = init_message(config)
            while True:
                reply, warm_parent = self._start(config, setup)
                if not preimport.env_modules.made_unsafe(setup["env_fns"], reply.preimported):
                    break
                # Its pre-import left threads or a GPU context in the warm parent: never
                # fork from that; again without pre-import (remembered for these env_fns).
                warm_parent.close()
                self._stop_warm_parent(2.0)
        except BaseException:
            self.close()
            raise
        # In its own pid namespace the warm parent is pid 1; this is its host pid.
        self.pid = warm_parent.pid
        warm_parent.close()
        self.gpu_pid: int | None = self.pid
        self.tree_isolation = reply.isolation

    def _start(self, config: HostConfig, setup: dict[str, Any]) -> tuple[M.Ready, ProcessWatch]:
        """Start a warm parent and have it prepare; its ready reply and a watch of it."""
        self.sock, self.watch, self.process = zygote.start_warm_parent(
            config.start_timeout, config.isolation.pass_env
        )
        TREES_STARTED.add(self.watch.pid)  # the tree's id: it isolates the tree
        # The pre-import is on whether or not sandboxes are trusted: the names a
        # throw-away sandbox reports select installed packages only, files no sandbox
        # can write (their read-only view of the host) and older than the build.
        known = preimport.env_modules.known(setup["env_fns"])
        init = M.Init(
            setup=setup,
            preimport={"enabled": True, **(known or {})},
            controller_pid=os.getpid(),
            die_with_controller=threading.current_thread() is threading.main_thread(),
            isolation=cloudpickle.dumps(config.isolation),
        )
        # Its output (the env code it runs: the first build, from_parent's preparation)
        # goes through the collector, as a sandbox's does: never raw to a terminal.
        (out_r, out_w), (err_r, err_w) = self._collector().new_pipes()
        self._collector().watch("warm-parent", out_r, err_r)
        try:
            M.send(self.sock, init, (out_w, err_w))
        finally:
            os.close(out_w)
            os.close(err_w)
        reply, fds = M.receive_reply(
            self.sock, config.start_timeout, "the warm parent's start", M.Ready, M.PrepareFailed
        )
        if isinstance(reply, M.PrepareFailed):
            raise_prepare_failure(vars(reply), "the warm parent", trusted=config.trusted)
        (warm_parent,) = adopt_pidfds([reply.pid], reply.pidfds, fds)
        if known is None:
            preimport.env_modules.learn(setup["env_fns"], reply.preimported)
        return reply, warm_parent

    def spawn(
        self,
        specs: Sequence[WorkerSpec],
        slab_fds: Sequence[int],
        ring_capacity: int,
        attach: bytes | None = None,
    ) -> list[WorkerHandle]:
        """Fork one worker per spec from the warm parent (SPAWN_BATCH per message).

        ``attach`` (the pickled attach argument) makes the workers attach to the slab
        at once, for replacements whose spaces the controller already knows.
        """
        # Each batch's handles are registered as they are made: the next batch's check
        # (and a lease's) must see them held.
        return spawn_in_batches(
            specs,
            slab_fds,
            SPAWN_BATCH,
            lambda batch, fds: self._spawn_batch(batch, fds, ring_capacity, attach),
        )

    def _collector(self) -> OutputCollector:
        """The sandboxes' output collector (closed hosts make no sandboxes)."""
        if self.output is None:
            raise SandboxStartError("the warm parent is closed: it makes no sandboxes")
        return self.output

    def _socket(self) -> socket.socket:
        """The control socket to the warm parent (closed hosts have none)."""
        if self.sock is None:
            raise SandboxStartError("the warm parent is closed: it makes no sandboxes")
        return self.sock

    def _register(self, handles: list[WorkerHandle]) -> list[WorkerHandle]:
        for handle in handles:
            self._handles[next(self._handle_ids)] = handle
        return handles

    def _new_members(self, watches: list[ProcessWatch], what: str) -> list[ProcessWatch]:
        """``watches`` of the new sandboxes a warm parent or a source named, if each is a
        new child of the warm parent: never the warm parent itself, a sandbox already
        held, or a process outside the tree, which the controller would otherwise signal
        and measure as its own (env code answers a FORK). Refused: SandboxStartError."""
        held = {handle.pid for handle in self.tree()} | {self.pid} | self._leases.pids()
        try:
            for watch in watches:
                if watch.fd < 0:
                    continue  # reaped already: nothing to signal
                parent = children.parent_of(watch.pid)
                if not watch.alive():
                    continue  # dead (its pid may name another process by now)
                if watch.pid in held or parent != self.pid:  # alive: the pid was its own
                    raise SandboxStartError(f"{what}: process {watch.pid} is not a new sandbox")
                held.add(watch.pid)
        except BaseException:
            for watch in watches:
                watch.close()
            raise
        return watches

    def tree(self) -> list[WorkerHandle]:
        """The live sandboxes of this warm parent's tree that the controller holds (those
        of every vector env sharing it: a root and its branches). They share one pid
        namespace and run as one uid, so any of them can signal any other: when one is
        found stopped, these are the suspects (the kernel does not say who sent it)."""
        return [handle for handle in list(self._handles.values()) if handle.alive()]

    def _spawn_batch(
        self,
        specs: list[WorkerSpec],
        slab_fds: list[int],
        ring_capacity: int,
        attach: bytes | None,
    ) -> list[WorkerHandle]:
        """The sandboxes of ``specs``, in order: from leased idle sandboxes while there
        are (no round trip), from the warm parent for the rest."""
        made: list[WorkerHandle | None] = [None] * len(specs)
        refused = 0  # leases that could not take an assignment (dead)
        try:
            for k, (spec, slab_fd) in enumerate(zip(specs, slab_fds, strict=True)):
                while made[k] is None and refused < MAX_LEASES:
                    with self._lock:
                        # The last one waits a little for a lease owed (leases.py).
                        wait_s = OWED_WAIT_S if k == len(specs) - 1 else 0.0
                        lease = self._leases.take(self._new_members, wait_s)
                        self._note_discarded_idle(self._leases.take_discarded())
                    if lease is None:
                        break
                    try:
                        handle = self._assign_leased(lease, spec, slab_fd, ring_capacity, attach)
                        if handle is not None:
                            made[k] = self._register([handle])[0]
                    finally:
                        self._leases.settle(lease)
                    refused += made[k] is None
                if refused >= MAX_LEASES:  # a warm parent leasing what cannot be assigned
                    with self._lock:
                        self._leases.close_channel()
                if made[k] is None:
                    break
            rest = [k for k, handle in enumerate(made) if handle is None]
            if rest:
                asked = self._spawn_requested(
                    [specs[k] for k in rest], [slab_fds[k] for k in rest], ring_capacity, attach
                )
                for k, new in zip(rest, asked, strict=True):
                    made[k] = new
                self._register(asked)
        except BaseException:
            for sandbox in made:
                if sandbox is not None:
                    sandbox.kill()
                    sandbox.release()
            raise
        return [sandbox for sandbox in made if sandbox is not None]

    def _spawn_requested(
        self,
        specs: list[WorkerSpec],
        slab_fds: list[int],
        ring_capacity: int,
        attach: bytes | None,
    ) -> list[WorkerHandle]:
        """The sandboxes of ``specs``, forked (or taken from its pool) by the warm parent."""
        ends = [SandboxEnds(spec, ring_capacity, self._collector()) for spec in specs]
        fds = []
        for end, slab_fd in zip(ends, slab_fds, strict=True):
            fds += [slab_fd, *end.fds()]
        request = M.Spawn(
            [M.SandboxSpec(s.name, list(s.indices), list(s.origins), ring_capacity) for s in specs],
            attach,
        )

        def exchange() -> tuple[M.Message, list[ProcessWatch]]:
            what = f"spawn {specs[0].name}"
            sock = self._socket()
            with self._lock:
                try:
                    M.send(sock, request, fds)
                except OSError as exc:  # EPIPE: it closed its end (it is dying)
                    self._unreachable = True
                    raise SandboxStartError(
                        f"{what}: the warm parent (pid {self.pid}) is gone ({exc})"
                    ) from exc
                reply, pidfds = M.receive_reply(sock, 60.0, what, M.Spawned, M.Refused)
                if isinstance(reply, M.Spawned) and reply.lease_channel:
                    self._leases.open(pidfds.pop())
            if isinstance(reply, M.Refused):
                return reply, []
            if len(reply.pids) != len(specs):
                M.close_fds(pidfds)
                raise SandboxStartError(f"{what}: {len(reply.pids)} pids for {len(specs)}")
            return reply, self._new_members(adopt_pidfds(reply.pids, reply.pidfds, pidfds), what)

        reply, watches = hand_over(ends, exchange)
        if isinstance(reply, M.Refused):
            for end in ends:
                end.abort()
            raise SandboxStartError(f"spawn {specs[0].name}: {escape_controls(reply.error)}")
        self._note_discarded_idle(reply.idle_discarded)
        return [
            end.handle(pid, watch)
            for end, pid, watch in zip(ends, reply.pids, watches, strict=True)
        ]

    def fork_soon(self, sources: Sequence[WorkerHandle]) -> None:
        """Ask the layer helper now whether each source wrote anything to freeze
        (layers.py ``check_soon``): its answer is in when the FORK is sent."""
        self.tmp_layers.checks_soon(sources, self.tree_isolation)

    def fork_many(
        self,
        jobs: Sequence[ForkJob],
        num_envs: int,
        ring_capacity: int,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[list[WorkerHandle]]:
        """Fork each job's clones from its running source (:func:`forking.fork_many`)."""
        return forking.fork_many(self, jobs, num_envs, ring_capacity, meanwhile)

    def _assign_leased(
        self, lease: Lease, spec: WorkerSpec, slab_fd: int, ring_capacity: int, attach: bytes | None
    ) -> WorkerHandle | None:
        """The sandbox of ``spec``, made by sending its assignment to a leased idle
        sandbox; None (the lease discarded) if it cannot take it."""
        try:
            end = SandboxEnds(spec, ring_capacity, self._collector())
        except BaseException:
            lease.discard()
            raise
        sandbox = M.SandboxSpec(spec.name, list(spec.indices), list(spec.origins), ring_capacity)
        taken = False
        try:
            taken = lease.assign(M.Assign(sandbox, attach), [slab_fd, *end.fds()])
        except TimeoutError:  # someone filled its socket: no more leases from this tree
            with self._lock:
                self._leases.close_channel()
        finally:
            end.handed_over()
            if not taken:
                end.abort()
        return end.handle(lease.local_pid, lease.watch) if taken else None

    def _note_discarded_idle(self, discarded: list[list[Any]]) -> None:
        """The warm parent found idle sandboxes stopped when it was to hand them a spec:
        it killed them and forked fresh ones (gym_fork/hosts/process/idle.py). Only a
        process of the tree can have stopped them: say so, naming its sandboxes."""
        if not discarded:
            return
        suspects = ", ".join(f"{h.name} (pid {h.pid})" for h in self.tree()) or "none"
        notices.warn(
            f"the warm parent (pid {self.pid}) found {len(discarded)} of its idle "
            "sandbox(es) stopped when it was to hand them a spec: it killed them and "
            "forked fresh sandboxes instead. They were stopped by a signal from inside "
            "their tree (one pid namespace, one uid) and the kernel does not say who sent "
            "it: the suspects are the tree's sandboxes, those just replaced (if any) and "
            f"those running now: {suspects}."
        )

    def alive(self) -> bool:
        """Health check of the warm parent (its sandboxes die with it). A warm parent
        whose control socket closed is dying: pid 1 of a pid namespace only exits once
        every process of it is reaped, which may take long (or, held by a zombie whose
        parent is outside the tree, forever), while its pidfd still says alive; one
        whose socket took no request (it shut down its reading end) is of no use."""
        sock, watch = self.sock, self.watch  # close() may clear them meanwhile
        if sock is None or watch is None or self._unreachable or not watch.alive():
            return False
        try:
            return not peer_closed(sock)
        except ValueError:  # closed here meanwhile
            return False

    def exit_code(self, worker: WorkerHandle) -> int | None:
        """Exit code of a worker (negative: signal), None if unknown or running."""
        if self.sock is None:
            return None
        with self._lock:
            local_pid = getattr(worker.host_data, "local_pid", worker.pid)
            try:
                M.send(self.sock, M.WorkerStatus(local_pid))
                reply, _ = M.receive_reply(self.sock, 2.0, "status", M.WorkerExit)
            except (OSError, SandboxStartError):
                return None
        return reply.code

    def check_slab(self, nbytes: int) -> None:
        """Any slab fits: it is a memfd of the size the vector env asks for."""

    def measure_born(self, worker: WorkerHandle) -> None:
        """Measure a clone whose set-up is done while it finishes (isolation_report.py)."""
        isolation_report.measure_born(self, worker)

    def isolation(
        self, sandbox: dict[str, Any] | None = None, pid: int | None = None
    ) -> IsolationReport:
        """What separates sandboxes on this host, as achieved (isolation_report.py)."""
        return isolation_report.isolation(self, sandbox, pid)

    def close(self, timeout: float = 2.0) -> None:
        """Tell the warm parent to exit (it kills its workers) and reap it."""
        with self._lock:
            self._leases.close()
        self.tmp_layers.close()
        self._stop_warm_parent(timeout)
        if self.output is not None:
            self.output.close()
            self.output = None

    def _stop_warm_parent(self, timeout: float) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                M.send(sock, M.Exit())
            sock.close()
        watch, self.watch = self.watch, None
        if watch is not None:
            if not watch.wait_dead(timeout):
                watch.kill()  # its tree's init dies with it (PDEATHSIG)
                watch.wait_dead(5.0)
            if self.process is not None:  # our child: reap it (a zygote reaps its forks)
                try:
                    self.process.wait(5.0)
                except subprocess.TimeoutExpired:  # its namespace held by a zombie
                    _reap_later(self.process)
            # It removes its tree's groups and scratch dirs itself, unless it was killed
            # (its tree is named by its host pid).
            cgroups.remove_tree(watch.pid)
            sweep(watch.pid)
            watch.close()
        self.process = None


def _reap_later(process: subprocess.Popen) -> None:
    """Reap ``process`` (killed, its pid namespace not torn down yet) once it exits, in a
    daemon thread: no zombie of ours is left behind, and close() does not wait for it."""
    threading.Thread(target=process.wait, name="gym_fork-reap", daemon=True).start()

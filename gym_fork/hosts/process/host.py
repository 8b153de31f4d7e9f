"""Controller side of the process host: one warm parent, many forked worker sandboxes."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import subprocess
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from gym_fork import notices
from gym_fork.errors import SandboxStartError
from gym_fork.gpu.cuda import ForkUnsafeError
from gym_fork.hosts.base import (
    CloneOrder,
    ForkJob,
    HostConfig,
    IsolationReport,
    SharedByBranches,
    WorkerHandle,
    WorkerSpec,
)
from gym_fork.hosts.batching import fork_overlapped, spawn_in_batches
from gym_fork.hosts.output import OutputCollector
from gym_fork.hosts.preparing import init_message, raise_prepare_failure
from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process import preimport, zygote
from gym_fork.hosts.process.ends import SandboxEnds, SandboxLink, hand_over
from gym_fork.hosts.process.leases import MAX_LEASES, OWED_WAIT_S, IdleLeases, Lease
from gym_fork.system import cgroups, children
from gym_fork.system.linux import ProcessWatch, raise_fd_limit
from gym_fork.system.measure import Measured, achieved, measure
from gym_fork.system.scratch import sweep
from gym_fork.text_safety import escape_controls
from gym_fork.transport.control import MAX_FDS, peer_closed
from gym_fork.transport.typed_messages import adopt_pidfds
from gym_fork.worker import protocol as P

# Sandboxes per spawn or fork message: each takes FDS_PER_SANDBOX fds, and the kernel
# passes at most 253 fds in one message (SCM_MAX_FD).
SPAWN_BATCH = 50

# The id of every tree this process started (the host pid of the process that isolates
# it, the warm parent's parent): its cgroups and scratch dirs carry that id, so a leak
# check beside other processes' trees can tell its own apart.
TREES_STARTED: set[int] = set()
assert SPAWN_BATCH * M.FDS_PER_SANDBOX <= MAX_FDS


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
        self._measure_cache: dict[int, Measured | None] = {}  # see _measured_once
        self._leases = IdleLeases()  # idle sandboxes the warm parent leased to us
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

    def fork_many(
        self, jobs: Sequence[ForkJob], num_envs: int, ring_capacity: int
    ) -> list[list[WorkerHandle]]:
        """Every source gets its clones' channels, sockets and output pipes on its side
        socket and its FORK request (SPAWN_BATCH clones per request) before any answer
        is awaited, so that the sources fork at once (gym_fork.hosts.batching.fork_overlapped:
        a source's reply and side-socket answer are matched in order)."""
        limits = self.config.isolation.limits
        # A clone's cgroup fds come with its others: fewer clones per message then.
        per_clone = M.FDS_PER_SANDBOX + cgroups.fds_per_clone(limits.memory_bytes, limits.processes)
        made = fork_overlapped(
            jobs,
            min(SPAWN_BATCH, MAX_FDS // per_clone),
            lambda job, orders, fds: self._start_fork(job, orders, fds, num_envs, ring_capacity),
        )
        for handles in made:
            self._register(handles)
        return made

    def _start_fork(
        self,
        job: ForkJob,
        orders: list[CloneOrder],
        slab_fds: list[int],
        num_envs: int,
        ring_capacity: int,
    ) -> Callable[[], list[WorkerHandle]]:
        """Send one source its clones' fds and FORK request; returns what waits for the
        answer and adopts the clones."""
        source = job.source
        ends = [SandboxEnds(order.spec, ring_capacity, self._collector()) for order in orders]
        groups = self._clone_groups(len(orders))
        fds = []
        for end, slab_fd, own in zip(ends, slab_fds, groups.fds, strict=True):
            fds += [slab_fd, *end.fds(), *own]
        clones = [[o.source_index, o.branch_index, o.seed, o.spec.name] for o in orders]
        link: SandboxLink = source.host_data
        what = f"fork of {source.name}"
        try:
            try:
                M.send(link.sock, M.CloneFds(len(orders), groups.controllers, groups.errors), fds)
            finally:
                groups.close_fds()  # the source has its copies
            arg = {"clones": clones, "num_envs": num_envs, "ring_capacity": ring_capacity}
            waiting = job.ask_later(P.FORK, arg)
        except BaseException:
            for end in ends:
                end.handed_over()
                end.abort()
            cgroups.remove_groups([p for paths in groups.paths for p in paths])
            raise

        def exchange() -> tuple[list[int], list[ProcessWatch]]:
            pids = waiting()
            if isinstance(pids, dict):  # refused: it would share memory with its clones
                raise _shared_memory_refused(source, pids)
            # The worker sent a pidfd of each clone on its side socket before replying.
            reply, pidfds = M.receive_reply(link.sock, 5.0, what, M.ClonesForked)
            if reply.pids != list(pids):
                M.close_fds(pidfds)
                raise SandboxStartError(f"{what}: pidfds do not match")
            return pids, self._new_members(adopt_pidfds(reply.pids, reply.pidfds, pidfds), what)

        def finish() -> list[WorkerHandle]:
            try:
                pids, watches = hand_over(ends, exchange)
            except BaseException:
                # Clones killed and not yet gone keep theirs until the tree's are removed.
                cgroups.remove_groups([p for paths in groups.paths for p in paths])
                raise
            handles = [
                end.handle(pid, watch) for end, pid, watch in zip(ends, pids, watches, strict=True)
            ]
            for handle, paths in zip(handles, groups.paths, strict=True):
                if paths:  # removed when the handle is released, i.e. once it is seen gone
                    link = handle.host_data
                    handle.host_data = _CloneLink(link.sock, link.local_pid, paths)
            return handles

        return finish

    def _clone_groups(self, count: int) -> cgroups.CloneGroups:
        """The clones' own cgroups, made here (the trusted side) when the limits ask for
        any: a clone cannot make them (gym_fork/system/cgroups.py)."""
        limits = self.config.isolation.limits
        if limits.memory_bytes is None and limits.processes is None:
            return cgroups.CloneGroups.none(count)
        if self.watch is None or not self.tree_isolation.get("tree", {}).get("pid"):
            # Without a pid namespace of the tree's, whoever holds a group's fd could move
            # any process of the host into it (the controller's too).
            why = "the tree has no pid namespace of its own, so no clone gets a group's fd"
            asked = [("memory", limits.memory_bytes), ("pids", limits.processes)]
            errors = {name: why for name, value in asked if value is not None}
            return cgroups.CloneGroups.none(count, errors)
        # Named by the process the controller started, as the warm parent names its tree.
        return cgroups.make_clone_groups(
            self.watch.pid, count, limits.memory_bytes, limits.processes
        )

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

    def isolation(
        self, sandbox: dict[str, Any] | None = None, pid: int | None = None
    ) -> IsolationReport:
        """What separates sandboxes on this host, as achieved (not as hoped).

        ``sandbox`` is the report of one sandbox (its HELLO); without it, the tree's.
        With ``pid`` (that sandbox's host pid) the namespaces, no_new_privs, seccomp,
        capabilities and the read-only view are what the kernel says about the process
        (gym_fork/system/measure.py), not what the sandbox said: env code may have run
        in it before it reported.
        """
        report = sandbox or {"tree": {}, "sandbox": {}, "limits": {}, "missing": {}}
        measured = None
        if pid is not None:
            measured = measure(pid, frozenset(self.config.isolation.shared_writable()))
        seen = achieved(
            report.get("tree") or self.tree_isolation.get("tree", {}),
            report.get("sandbox", {}),
            {**self.tree_isolation.get("missing", {}), **report.get("missing", {})},
            measured,
            self._others(pid),
            self.config.isolation,
        )
        return IsolationReport(
            host=self.kind,
            network="off" if seen.namespaces["net"] else "host",
            namespaces=seen.namespaces,
            private_tmp=seen.private_tmp,
            no_new_privs=seen.no_new_privs,
            limits=report.get("limits", {}),
            missing=seen.missing,
            details={"process": True, "address_space": "copy-on-write fork", **seen.details},
        )

    def _measured_once(self, pid: int) -> Measured | None:
        """What the kernel said about ``pid`` when first asked (namespaces and layers are
        a sandbox's from its set-up on): each fork measures its new sandbox only."""
        cache = self._measure_cache
        if pid not in cache:
            live = {h.pid for h in self.tree()} | {self.pid}
            for gone in [p for p in cache if p not in live]:
                del cache[gone]  # a dead sandbox's pid may be reused
            cache[pid] = measure(pid)
        return cache[pid]

    def _others(self, pid: int | None) -> Iterator[tuple[int, Measured | None]]:
        """The warm parent and the other live sandboxes of this tree (host pids), each
        with what the kernel says about it."""
        # The newest 16: a branch's source is among them when the branch is new, and
        # the cost stays bounded in a tree search of thousands of sandboxes.
        others = [h.pid for h in self.tree() if h.pid != pid][-16:]
        for other in ([self.pid] if self.pid else []) + others:
            yield other, self._measured_once(other)

    def close(self, timeout: float = 2.0) -> None:
        """Tell the warm parent to exit (it kills its workers) and reap it."""
        with self._lock:
            self._leases.close()
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


@dataclass
class _CloneLink(SandboxLink):
    """A clone's link, with its own cgroups (made by the controller): removed with it."""

    cgroups: list[str] = field(default_factory=list)

    def close(self) -> None:
        super().close()
        cgroups.remove_groups(self.cgroups)


def _shared_memory_refused(source: WorkerHandle, refused: dict[str, Any]) -> ForkUnsafeError:
    """The error for a FORK that ``shared_memory="refuse"`` refused, naming what the
    source said its clones would share with it (its words: shown escaped)."""
    names, envs = refused.get("shared_with_source"), refused.get("envs")
    shown = [escape_controls(str(n)[:200]) for n in names[:5]] if isinstance(names, list) else []
    kinds = [escape_controls(str(n)[:100]) for n in envs[:5]] if isinstance(envs, list) else []
    env = f" ({', '.join(kinds)})" if kinds else ""
    return ForkUnsafeError(
        f"fork refused: sub-env(s) {source.indices}{env}, pid {source.pid}, map memory or "
        f"files a fork does not copy: {', '.join(shown) or '(unnamed)'}. A branch's writes "
        "through them would reach its source, and the source's the branch (anonymous "
        "shared memory such as mmap.mmap(-1, n), multiprocessing's RawArray and Value). "
        "Keep the env's state in private memory, or pass shared_memory='warn' to fork "
        "anyway",
        pid=source.pid,
        evidence=shown,
    )

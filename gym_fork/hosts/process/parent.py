"""The warm parent: a clean interpreter that prepares once and forks worker sandboxes.

Started by :class:`gym_fork.hosts.process.host.ProcessHost`: forked by the controller's
zygote (``gym_fork.hosts.process.zygote_program``, a clean pre-imported interpreter), or as
``python -m gym_fork.hosts.process.parent FD``; never forked from the user's process,
which may hold threads, locks or a CUDA context. It receives the env_fns, imports
what they need once (unpickling them does), optionally builds and warms one prototype
env (``from_parent``), then forks workers on request.

With namespaces, the process the controller started makes the tree's namespaces, a pid
namespace among them, forks the real warm parent as pid 1 of it, and only waits for it
(then removes the tree's cgroups): that fork, the tree's user namespace and the wait
are in ``tree_init.py``. As the pid namespace's init, the warm parent adopts every
orphan of the tree (the clones that workers fork for branches outlive their source;
daemons an env starts) and when it exits the kernel kills every process of the tree,
however it was started. Without a pid namespace it is a child subreaper instead.
It exits, killing every sandbox, when the controller closes the control socket or dies
(watched through a pidfd: an inherited copy of the socket in a child of the controller
does not keep it alive).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from typing import Any

import cloudpickle

from gym_fork.hosts.preparing import prepare_failure
from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process import preimport
from gym_fork.hosts.process.idle import IdlePool, await_assignment
from gym_fork.hosts.process.idle import pool_size as idle_pool_size
from gym_fork.hosts.process.sandbox import redirect_output, run_as_sandbox
from gym_fork.hosts.process.tree_init import start_tree_init
from gym_fork.hosts.process.worker import rehearse, serve
from gym_fork.system import cgroups, children, confine, linux, vetted_imports
from gym_fork.system.birth import Role, be_born
from gym_fork.system.isolation import Isolation, IsolationConfig, isolate_tree
from gym_fork.system.scratch import remove_sandbox_scratch, sweep
from gym_fork.worker.prepare import EnvSource


class WarmParent:
    """State of the warm parent process: what it prepared, and its sandboxes."""

    def __init__(
        self,
        sock: socket.socket,
        config: IsolationConfig,
        tree: Isolation,
        controller: int = -1,
    ) -> None:
        self.sock = sock
        self.pid = os.getpid()  # 1 when the tree has its own pid namespace
        self.env_source = EnvSource()
        self.exit_codes: dict[int, int] = {}
        self.spawned: set[int] = set()
        self.isolation_config = config
        self.tree_isolation = tree
        self.tree_id = tree.tree_id or self.pid
        self.controller = controller  # a pidfd of the controller, -1 if none
        self.is_init = bool(tree.tree.get("pid"))
        self.idle = IdlePool(idle_pool_size(), self._become_idle)
        # What its sandboxes will receive (an idle one's assignment, a source's clone fds).
        M.prepare_decoding(M.Assign, *M.TO_SOURCE)

    def spawn(self, request: M.Spawn, fds: list[int]) -> list[int]:
        """Fork one worker per spec of ``request``; fds: FDS_PER_SANDBOX per worker (its
        own slab, channel, side socket, stdout, stderr). Returns their pids (in the
        tree's pid namespace)."""
        per = M.FDS_PER_SANDBOX
        attach = self.env_source.attach_arg(request.attach)
        pids = []  # an idle sandbox that died is a zombie until reaped: assign skips it
        for k, spec in enumerate(request.workers):
            own = fds[per * k : per * (k + 1)]
            pid = self.idle.assign(M.Assign(spec, request.attach), own)
            if pid == 0:
                pid = children.fork()
                if pid == 0:
                    self.idle.close()
                    for fd in fds:
                        if fd not in own:
                            os.close(fd)
                    slab_fd, channel_fd, sock_fd, out_fd, err_fd = own
                    redirect_output(out_fd, err_fd)
                    self._become_worker(spec, channel_fd, slab_fd, sock_fd, attach)
            pids.append(pid)
            self.spawned.add(pid)
        for fd in fds:
            os.close(fd)
        return pids

    def _become_worker(
        self, spec: M.SandboxSpec, channel_fd: int, slab_fd: int, sock_fd: int, attach: dict | None
    ) -> None:
        def body() -> None:
            self._leave_parent()
            self._serve(spec, channel_fd, slab_fd, sock_fd, attach)

        run_as_sandbox(body)

    def _leave_parent(self, close: tuple[int, ...] | list[int] = ()) -> None:
        """In a new sandbox: die with the warm parent, default signals, and none of the
        warm parent's ends (its socket to the controller, its pidfd of it, ``close``)."""
        linux.die_with_parent(self.pid)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.sock.close()
        if self.controller >= 0:
            os.close(self.controller)  # a sandbox must not hold the controller
        for fd in close:
            os.close(fd)

    def _serve(
        self,
        spec: M.SandboxSpec,
        channel_fd: int,
        slab_fd: int,
        sock_fd: int,
        attach: dict | None,
        entered: tuple[str | None, dict] | None = None,
    ) -> None:
        """Serve as the worker of ``spec`` (gym_fork/hosts/process/worker.py)."""
        serve(
            channel_fd,
            spec.ring_capacity,
            slab_fd,
            sock_fd,
            spec,
            self.env_source.make_env,
            warm_parent=self.pid,
            isolation=(self.isolation_config, self.tree_isolation),
            attach=attach,
            entered=entered,
        )

    def preimport(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Import what building ``env_fns[0]`` imports, so that sandboxes share those
        modules (gym_fork/hosts/process/preimport.py): the names the controller already
        knows (vetted against the time they were learnt), or those a throw-away sandbox
        reports. Returns {"names", "since"} for the controller to keep, None if off or
        nothing was learnt."""
        if not (request.get("enabled") and preimport.enabled()):
            return None
        if not self.env_source.builds_in_sandbox():
            return None
        known, since = request.get("modules"), request.get("since")
        if isinstance(known, list) and isinstance(since, float):
            vetted_imports.import_all(known, since)
            unsafe = preimport.fork_unsafe()
            return {"unsafe": unsafe} if unsafe else None

        def enter() -> None:
            linux.die_with_parent(self.pid)
            be_born(Role.PREIMPORT, self.isolation_config, self.tree_isolation, self.pid)

        def cleanup(pid: int) -> None:
            self._kill_tree()  # no sandbox exists yet: whatever runs in the tree is the build's
            remove_sandbox_scratch(self.tree_id, pid)
            cgroups.remove(self.tree_id, pid)

        close = [self.sock.fileno()] + ([self.controller] if self.controller >= 0 else [])
        learnt = preimport.preimport(
            self.env_source.env_fns[0], enter, close, preimport.budget(), cleanup
        )
        unsafe = preimport.fork_unsafe()
        if unsafe:
            return {"unsafe": unsafe}
        return None if learnt is None else {"names": learnt[0], "since": learnt[1]}

    def _become_idle(self, sock: socket.socket, close: list[int], taken: int) -> None:
        """An idle sandbox (gym_fork/hosts/process/idle.py): isolate now, then wait for
        a spec and fds, then serve like any sandbox."""

        def body() -> None:
            self._leave_parent(close)
            scratch, achieved = be_born(
                Role.IDLE, self.isolation_config, self.tree_isolation, self.pid
            )
            entered = (scratch, achieved.report())
            if not linux.wait_readable(sock.fileno(), 0):  # no assignment waiting yet
                self._rehearse(entered)
            assigned, fds = await_assignment(sock, taken)
            slab_fd, channel_fd, sock_fd, out_fd, err_fd = fds
            redirect_output(out_fd, err_fd)
            attach = self.env_source.attach_arg(assigned.attach)
            self._serve(assigned.spec, channel_fd, slab_fd, sock_fd, attach, entered)

        run_as_sandbox(body)

    def _rehearse(self, entered: tuple[str | None, dict[str, Any]]) -> None:
        """In an idle sandbox: run a new sandbox's start once, ahead of its assignment
        (worker.py rehearse), where the warm parent hands out its prepared env and knows
        the controller's attach argument (from its first replacement on)."""
        source = self.env_source
        attach = source.last_attach_arg()
        if attach is None or source.prototype is None:
            return
        try:
            rehearse(
                source.make_env,
                attach,
                warm_parent=self.pid,
                isolation=(self.isolation_config, self.tree_isolation),
                entered=entered,
            )
        except Exception:  # what fails here only costs the head start: serve() redoes it
            return

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exit_codes[pid] = os.waitstatus_to_exitcode(status)
            self.spawned.discard(pid)
            self.idle.forget(pid)
            remove_sandbox_scratch(self.tree_id, pid)
            cgroups.remove(self.tree_id, pid)

    def kill_children(self) -> None:
        """Kill and reap every sandbox, then remove the tree's cgroups and scratch."""
        self.idle.close()  # idle sandboxes exit at EOF (and are killed below anyway)
        try:
            self._kill_tree()
        finally:
            sweep(self.tree_id)
            cgroups.remove_tree(self.tree_id)

    def _kill_tree(self) -> None:
        """Kill and reap every other process of the tree (clones, daemons, an env's fork
        bomb): as pid 1 of its namespace kill(-1) reaches them all; as a child subreaper
        every orphan of the tree is a child of ours."""
        if self.is_init:
            children.kill_namespace(self.exit_codes)
        else:
            children.kill_every_child(lambda: set(self.spawned), self.reap)

    def serve(self) -> None:
        """Answer the controller until it says exit, closes the socket or dies."""
        controller = [self.controller] if self.controller >= 0 else []
        refill_at: float | None = None  # when to refill the idle pool
        while True:
            # The idle pool is refilled after a reply unless the next request is waiting
            # already (measured: at once beats waiting 10 ms for a quiet moment, which a
            # loop of resets never leaves). A leased one taken is replaced after
            # LEASE_REFILL_DELAY_S while another is left: a fork and a new sandbox's
            # set-up (~4 ms of CPU) would compete with the clone that took it.
            taken = self.idle.leases.taken_fds()
            wait = 0.2 if refill_at is None else max(0.0, refill_at - time.monotonic())
            readable = linux.readable([self.sock.fileno(), *controller, *taken], wait)
            if controller and controller[0] in readable:
                return  # the controller is dead
            for fd in set(readable) & set(taken):  # a leased idle sandbox was assigned
                self.idle.leases.taken(fd)
                readable.remove(fd)
                delay = LEASE_REFILL_DELAY_S if self.idle.leases.leased else 0.0
                soon = time.monotonic() + delay
                refill_at = soon if refill_at is None else min(refill_at, soon)
            # Reaping (a dead sandbox's scratch and cgroups removed: ~0.5-1 ms) waits
            # until the request in hand is answered: it is not what the controller waits on.
            if not readable:
                self.reap()
                if refill_at is not None and time.monotonic() >= refill_at:
                    self.spawned.update(self.idle.fill())
                    refill_at = None
                continue
            try:  # a bad message too: the controller's bug, nothing to serve on
                message, fds = M.receive(self.sock, M.Spawn, M.WorkerStatus, M.Exit)
            except (EOFError, ConnectionError):
                return
            if isinstance(message, M.Spawn):
                try:
                    pids = self.spawn(message, fds)
                except Exception as exc:
                    M.send(self.sock, M.Refused(repr(exc)))
                else:
                    self.idle.note_request()
                    channel = self.idle.open_lease_channel()
                    # Stopped idle sandboxes it killed: the controller warns.
                    reply = M.Spawned(
                        pids, self.idle.take_discarded(), lease_channel=channel is not None
                    )
                    try:
                        extra = () if channel is None else (channel,)
                        M.send_with_pidfds(self.sock, reply, pids, extra=extra)
                    finally:
                        if channel is not None:
                            os.close(channel)
                    refill_at = time.monotonic()
                self.reap()
            elif isinstance(message, M.WorkerStatus):
                self.reap()
                M.send(self.sock, M.WorkerExit(self.exit_codes.get(message.pid)))
            else:
                return


# How long a warm parent waits before it replaces a leased idle sandbox that was taken
# while another is left (see serve()).
LEASE_REFILL_DELAY_S = 0.02


def main() -> None:
    """A warm parent started as a fresh interpreter by the controller."""
    run(socket.socket(fileno=int(sys.argv[1])))


def run(sock: socket.socket, controller: int | None = None) -> None:
    """The warm parent's whole life, answering the controller on ``sock``.

    ``controller``: a pidfd of the controller when a zygote forked this process (the
    zygote watched it and set our PDEATHSIG); None when the controller started us.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides about Ctrl-C
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        init, (out_fd, err_fd) = M.receive(sock, M.Init)
    except (EOFError, ConnectionError):
        return
    assert isinstance(init, M.Init)  # receive gives only the kinds asked for
    # Before any env code: what it prints goes to the controller's pipes, not to the
    # controller's own stdout/stderr (a terminal would obey its escape sequences).
    redirect_output(out_fd, err_fd)
    if controller is None:
        controller = children.watch_parent(init.controller_pid)
        if init.die_with_controller:
            # SIGTERM (not SIGKILL) so that the cleanup below still runs.
            linux.die_with_parent(init.controller_pid, signal.SIGTERM)
    config = cloudpickle.loads(init.isolation)
    # No sandbox of the tree may have the controller's terminal as its controlling
    # terminal (TIOCSTI on it would type commands into the user's shell). Given up, not
    # left by setsid(): a new session is a new scheduler autogroup, which halved the
    # CPU share of the tree's workers against the controller (100 us env x8: +40%).
    with contextlib.suppress(OSError):  # seccomp refuses TIOCSTI in sandboxes anyway
        linux.drop_controlling_terminal()
    cgroups.sweep_stale()  # here, where /proc is still the host's
    tree = isolate_tree(config, os.getpid())
    tree.tree["birth"] = ["redirect_output", "drop_terminal", "isolate_tree"]
    if tree.tree.get("pid"):
        start_tree_init(sock, controller, config, tree)
    else:
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
        tree.missing["warm_parent_read_only_host"] = (
            "no pid namespace: the warm parent is not the tree's init, whose own mount "
            "namespace would be read-only while it runs env code"
        )
    try:
        linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)  # the last step before env code
        tree.tree["no_new_privs"] = True
    except OSError as exc:
        tree.missing["warm_parent_no_new_privs"] = str(exc)
    tree.tree["birth"].append("no_new_privs")
    if config.confine:
        with contextlib.suppress(OSError):  # a sandbox reports the reason itself
            confine.prepare_seccomp()
    parent = WarmParent(sock, config, tree, controller)
    try:
        try:
            parent.env_source.prepare(init.setup)
        except Exception as exc:
            failure = prepare_failure(exc)
            del failure["op"]
            M.send(sock, M.PrepareFailed(**failure))
            return
        preimported = parent.preimport(init.preimport)
        ready = M.Ready(os.getpid(), tree.report(), preimported)
        M.send_with_pidfds(sock, ready, [os.getpid()])
        parent.serve()
    except (EOFError, ConnectionError):
        pass
    finally:
        parent.kill_children()


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()

"""The warm parent: a clean interpreter that prepares once and forks worker sandboxes.

Started by :class:`gym_fork.hosts.process.host.ProcessHost` as
``python -m gym_fork.hosts.process.parent FD`` (never forked from the user's process,
which may hold threads, locks or a CUDA context). It receives the env_fns, imports
what they need once (unpickling them does), optionally builds and warms one prototype
env (``from_parent``), then forks workers on request. It is a child subreaper, so the
clones that workers fork for branches are adopted by it and outlive their source. It
exits, killing every sandbox, when the controller closes the control socket or dies.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys

import cloudpickle

from gym_fork.hosts.base import prepare_failure
from gym_fork.hosts.process.sandbox import FDS_PER_SANDBOX, redirect_output, run_as_sandbox, serve
from gym_fork.system import cgroups, linux
from gym_fork.system.isolation import IsolationConfig, isolate_tree
from gym_fork.system.scratch import remove_sandbox_scratch, sweep
from gym_fork.transport.control import recv_message, send_message
from gym_fork.worker.prepare import EnvRecipe


class WarmParent:
    """State of the warm parent process: what it prepared, and its sandboxes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.recipe = EnvRecipe()
        self.exit_codes: dict[int, int] = {}
        self.spawned: set[int] = set()
        self.isolation_config = IsolationConfig()
        self.tree_isolation = None

    def spawn(self, message: dict, fds: list[int]) -> list[int]:
        """Fork one worker per entry of ``message['workers']``; fds: the slab, then
        FDS_PER_SANDBOX per worker (channel, side socket, stdout, stderr)."""
        slab_fd, rest = fds[0], fds[1:]
        per = FDS_PER_SANDBOX
        sys.stdout.flush()
        sys.stderr.flush()
        attach = self.recipe.attach_arg(message.get("attach"))
        pids = []
        for k, spec in enumerate(message["workers"]):
            channel_fd, sock_fd, out_fd, err_fd = rest[per * k : per * (k + 1)]
            pid = os.fork()
            if pid == 0:
                for fd in fds:
                    if fd not in (slab_fd, channel_fd, sock_fd, out_fd, err_fd):
                        os.close(fd)
                redirect_output(out_fd, err_fd)
                self._become_worker(spec, channel_fd, slab_fd, sock_fd, attach)
            pids.append(pid)
            self.spawned.add(pid)
        for fd in fds:
            os.close(fd)
        return pids

    def _become_worker(
        self, spec: dict, channel_fd: int, slab_fd: int, sock_fd: int, attach: dict | None
    ) -> None:
        def body() -> None:
            linux.die_with_parent(self.pid)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.sock.close()
            serve(
                channel_fd,
                spec["ring_capacity"],
                slab_fd,
                sock_fd,
                spec,
                self.recipe.make_env,
                warm_parent=self.pid,
                isolation=(self.isolation_config, self.tree_isolation),
                attach=attach,
            )

        run_as_sandbox(body)

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
            remove_sandbox_scratch(self.pid, pid)
            cgroups.remove(self.pid, pid)

    def kill_children(self) -> None:
        try:
            self._kill_children()
        finally:
            sweep(self.pid)
            cgroups.remove_tree(self.pid)

    def _kill_children(self) -> None:
        # Sandboxes adopted from workers die with us through their PDEATHSIG; the ones
        # we forked ourselves are killed and reaped here.
        for pid in list(self.spawned):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for _ in range(50):
            self.reap()
            if not self.spawned:
                return
            select.select([], [], [], 0.01)

    def serve(self) -> None:
        while True:
            readable, _, _ = select.select([self.sock], [], [], 0.2)
            self.reap()
            if not readable:
                continue
            try:
                message, fds = recv_message(self.sock)
            except (EOFError, ConnectionError):
                return
            op = message["op"]
            if op == "spawn":
                try:
                    pids = self.spawn(message, fds)
                    send_message(self.sock, {"op": "spawned", "pids": pids})
                except Exception as exc:
                    send_message(self.sock, {"op": "error", "error": repr(exc)})
            elif op == "status":
                self.reap()
                code = self.exit_codes.get(message["pid"])
                send_message(self.sock, {"op": "status", "code": code})
            elif op == "exit":
                return


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides about Ctrl-C
    signal.signal(signal.SIGTERM, _exit_on_signal)
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    parent = WarmParent(sock)
    try:
        message, _ = recv_message(sock)
        if message.get("die_with_controller"):
            # SIGTERM (not SIGKILL) so that the finally below still cleans up.
            linux.die_with_parent(message["controller_pid"], signal.SIGTERM)
        parent.isolation_config = cloudpickle.loads(message["isolation"])
        parent.tree_isolation = isolate_tree(parent.isolation_config)
        cgroups.sweep_stale()
        try:
            parent.recipe.prepare(message)
        except Exception as exc:
            send_message(sock, prepare_failure(exc))
            return
        send_message(
            sock,
            {"op": "ready", "pid": os.getpid(), "isolation": parent.tree_isolation.report()},
        )
        parent.serve()
    except (EOFError, ConnectionError):
        pass
    finally:
        parent.kill_children()


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()

"""The zygote program: one clean, pre-imported interpreter per controller that forks
warm parents (its client, the controller's side: ``zygote.py``).

Started as ``python -m gym_fork.hosts.process.zygote_program FD``, it imports what a
warm parent imports, builds the seccomp filter, freezes those objects for copy-on-write
and answers each ForkWarmParent with a fork that runs ``parent.run``. It reaps its warm
parents and keeps nothing of them: the controller watches each by its pidfd. It exits
when the controller closes the socket or dies (watched through a pidfd), or, retired,
once its last warm parent has exited.
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

# What every warm parent imports, once: its forks share these pages.
import gymnasium.envs.registration  # noqa: F401

from gym_fork import zygote_launch
from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process import parent
from gym_fork.system import children, confine, linux


def apply_process_state(state: dict[str, Any]) -> None:
    """In a warm parent forked by a zygote: take on the controller's process state
    (gym_fork.hosts.process.zygote.process_state; each part best effort: a limit the
    zygote cannot set is left as it is)."""
    if isinstance(state.get("umask"), int):
        os.umask(state["umask"])
    for name, (soft, hard) in (state.get("rlimits") or {}).items():
        if name.startswith("RLIMIT_") and hasattr(resource, name):
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
    with contextlib.suppress(OSError, ValueError, TypeError):
        os.sched_setaffinity(0, state["affinity"])
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        os.setpriority(os.PRIO_PROCESS, 0, state["nice"])


def reap(children: set[int]) -> None:
    """Reap the exited of ``children`` (the zygote's warm parents), without waiting."""
    while children:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)


class ZygoteProcess:
    """The zygote's own state: the warm parents it forked and not yet reaped
    (``children``: shared by a shared zygote's connections)."""

    def __init__(
        self, sock: socket.socket, controller: int, children: set[int] | None = None
    ) -> None:
        self.sock = sock
        self.controller = controller
        self.children: set[int] = set() if children is None else children
        self.retired = False
        self.others: list[int] = []  # fds a warm parent must not keep (other connections)

    def reap(self) -> None:
        reap(self.children)

    def serve(self) -> None:
        watched: list[socket.socket | int] = [self.sock, self.controller]
        while True:
            readable, _, _ = select.select(watched, [], [], 0.2)
            self.reap()
            if self.controller in readable:
                return  # the controller died
            if self.retired and not self.children:
                return
            if self.sock not in readable:
                continue
            try:
                message, fds = M.receive(self.sock, M.ForkWarmParent, M.Retire)
            except (EOFError, ConnectionError):  # a bad message too: the controller's bug
                if not self.retired:
                    return
                watched = [self.controller]
                continue
            if isinstance(message, M.Retire):
                self.retired = True
            elif self.retired or not isinstance(message, M.ForkWarmParent):
                M.close_fds(fds)
            else:
                self.fork(message, *fds)

    def fork(self, request: M.ForkWarmParent, parent_end: int, out_fd: int, err_fd: int) -> None:
        me = os.getpid()
        try:
            pid = children.fork()
        except OSError as exc:  # EAGAIN, ENOMEM: this request fails, the zygote serves on
            M.close_fds([parent_end, out_fd, err_fd])
            M.send(self.sock, M.Refused(f"zygote fork: {exc}"))
            return
        if pid == 0:
            self._become_warm_parent(me, request, parent_end, out_fd, err_fd)
        M.close_fds([parent_end, out_fd, err_fd])
        self.children.add(pid)
        M.send_with_pidfds(self.sock, M.WarmParentForked(pid), [pid])

    def _become_warm_parent(
        self, zygote: int, request: M.ForkWarmParent, parent_end: int, out_fd: int, err_fd: int
    ) -> None:
        code = 1
        try:
            linux.die_with_parent(zygote, signal.SIGTERM)  # SIGTERM: the cleanup runs
            self.sock.close()
            M.close_fds(self.others)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            M.close_fds([out_fd, err_fd])
            os.environ.clear()
            os.environ.update(request.environ)
            apply_process_state(request.state)
            parent.run(socket.socket(fileno=parent_end), controller=self.controller)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


class SharedZygote:
    """A zygote kept across one user's controllers (``GYM_FORK_ZYGOTE=shared``): it
    accepts their connections on ``listener`` (bound at ``path`` by the controller that
    started it), forks warm parents for each, and exits, removing its socket, once
    ``idle`` seconds pass with no connection and no warm parent."""

    def __init__(self, listener: socket.socket, path: str, idle: float) -> None:
        self.listener = listener
        self.path: str | None = path  # None once removed
        self.inode = os.stat(path).st_ino
        self.idle = idle
        self.clients: dict[socket.socket, ZygoteProcess] = {}
        self.confinement = zygote_launch.confinement("self")
        self.children: set[int] = set()

    def serve(self) -> None:
        quiet_since = time.monotonic()
        while True:
            readable, _, _ = select.select([self.listener, *self.clients], [], [], 0.2)
            reap(self.children)
            for sock in readable:
                if sock is self.listener:
                    self.accept()
                else:
                    self.answer(self.clients[sock])
            if self.clients or self.children:
                quiet_since = time.monotonic()
            elif (self.path is None or time.monotonic() - quiet_since >= self.idle) and (
                self.leave()
            ):
                return

    def accept(self) -> None:
        """A controller of our user connects: it gets our ready message; any other is
        refused. Its pidfd (from the kernel) is what its warm parents watch."""
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        pidfd = -1
        try:
            uid = zygote_launch.peer_uid(sock)
            if uid != os.geteuid():
                raise PermissionError(f"a peer of uid {uid}")
            pidfd = sock.getsockopt(socket.SOL_SOCKET, zygote_launch.SO_PEERPIDFD)
            pid = linux.pidfd_pids(pidfd)[:1]
            # Read by pid, then checked to be still that process (the pidfd pins it).
            if not pid or zygote_launch.confinement(str(pid[0])) != self.confinement:
                raise PermissionError("a peer confined otherwise")
            if linux.pidfd_pids(pidfd)[:1] != pid:
                raise PermissionError("the peer is gone")
        except OSError:
            sock.close()
            if pidfd >= 0:
                os.close(pidfd)
            return
        # A controller that stalls mid-message must not stall the others' forks.
        sock.settimeout(5.0)
        client = ZygoteProcess(sock, pidfd, self.children)
        try:
            M.send(sock, M.ZygoteReady(os.getpid()))
        except OSError:
            self.drop(client)
            return
        self.clients[sock] = client

    def answer(self, client: ZygoteProcess) -> None:
        try:
            message, fds = M.receive(client.sock, M.ForkWarmParent, M.Retire)
        except (EOFError, OSError):  # gone, a bad message, or stalled past the timeout
            self.drop(client)
            return
        if not isinstance(message, M.ForkWarmParent):  # Retire: this controller is done
            M.close_fds(fds)
            self.drop(client)
            return
        client.others = [self.listener.fileno()] + [
            fd for other in self.clients.values() if other is not client
            for fd in (other.sock.fileno(), other.controller)
        ]  # fmt: skip
        try:
            client.fork(message, *fds)
        except OSError:
            self.drop(client)

    def drop(self, client: ZygoteProcess) -> None:
        self.clients.pop(client.sock, None)
        client.sock.close()
        os.close(client.controller)

    def leave(self) -> bool:
        """Remove our socket, so that a controller connecting later starts a new
        zygote; whether to exit (not if one connected before the removal)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                if os.stat(self.path).st_ino == self.inode:  # not a successor's
                    os.unlink(self.path)
            self.path = None
        return not select.select([self.listener], [], [], 0)[0]


def _prepare() -> None:
    with contextlib.suppress(Exception):  # a warm parent reports the reason itself
        confine.prepare_seccomp()  # built once (~8 ms); every fork only loads it
    # Frozen without a full collection first: the imports leave no cyclic garbage (0
    # objects found) and the collection cost 10-30 ms before the first warm parent.
    gc.freeze()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides about Ctrl-C
    if sys.argv[1] == "--shared":  # --shared LISTENER_FD PATH IDLE_SECONDS
        listener = socket.socket(fileno=int(sys.argv[2]))
        _prepare()
        with contextlib.suppress(OSError):
            SharedZygote(listener, sys.argv[3], float(sys.argv[4])).serve()
        return
    sock = socket.socket(fileno=int(sys.argv[1]))
    controller = parent.watch_controller(os.getppid())
    _prepare()
    zygote = ZygoteProcess(sock, controller)
    try:
        M.send(sock, M.ZygoteReady(os.getpid()))
        zygote.serve()
    except (OSError, EOFError):
        pass


if __name__ == "__main__":
    main()

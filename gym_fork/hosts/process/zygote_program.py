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
import signal
import socket
import sys
import traceback

# What every warm parent imports, once: its forks share these pages.
import gymnasium.envs.registration  # noqa: F401

from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process import parent
from gym_fork.system import children, confine, inherited, layer_helper, linux


class ZygoteProcess:
    """The zygote's own state: the warm parents it forked and not yet reaped."""

    def __init__(self, sock: socket.socket, controller: int) -> None:
        self.sock = sock
        self.controller = controller
        self.children: set[int] = set()
        self.retired = False

    def reap(self) -> None:
        while self.children:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)

    def serve(self) -> None:
        # poll, not select: the fds keep the controller's numbers, which may be > 1023
        watched = [self.sock.fileno(), self.controller]
        while True:
            readable = linux.readable(watched, 0.2)
            self.reap()
            if self.controller in readable:
                return  # the controller died
            if self.retired and not self.children:
                return
            if self.sock.fileno() not in readable:
                continue
            try:
                message, fds = M.receive(self.sock, M.ForkWarmParent, M.ForkLayerHelper, M.Retire)
            except (EOFError, ConnectionError):  # a bad message too: the controller's bug
                if not self.retired:
                    return
                watched = [self.controller]
                continue
            if isinstance(message, M.Retire):
                self.retired = True
            elif self.retired:
                M.close_fds(fds)
            elif isinstance(message, M.ForkLayerHelper):
                self.fork_layer_helper(message, *fds)
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

    def fork_layer_helper(self, request: M.ForkLayerHelper, helper_end: int) -> None:
        """A layer helper for one process host: a fork of this clean, single-threaded-
        after-fork interpreter serving ``helper_end`` (milliseconds, where a fresh
        ``python -S`` takes ~30 ms before its first freeze). It ends at EOF on its
        socket: when the host closes, or the controller dies."""
        try:
            pid = children.fork()
        except OSError as exc:
            os.close(helper_end)
            M.send(self.sock, M.Refused(f"zygote fork: {exc}"))
            return
        if pid == 0:
            code = 1
            try:
                os.setsid()  # out of the controller's terminal's signals, as a Popen'd one
                self.sock.close()
                os.closerange(3, helper_end)
                os.closerange(helper_end + 1, os.sysconf("SC_OPEN_MAX"))
                layer_helper.serve(socket.socket(fileno=helper_end), request.size_bytes)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(helper_end)
        self.children.add(pid)
        M.send_with_pidfds(self.sock, M.LayerHelperForked(pid), [pid])

    def _become_warm_parent(
        self, zygote: int, request: M.ForkWarmParent, parent_end: int, out_fd: int, err_fd: int
    ) -> None:
        code = 1
        try:
            linux.die_with_parent(zygote, signal.SIGTERM)  # SIGTERM: the cleanup runs
            self.sock.close()
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            M.close_fds([out_fd, err_fd])
            os.environ.clear()
            os.environ.update(request.environ)
            inherited.take_on(request.state)
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


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides about Ctrl-C
    controller = children.watch_parent(os.getppid())
    with contextlib.suppress(Exception):  # a warm parent reports the reason itself
        confine.prepare_seccomp()  # built once (~8 ms); every fork only loads it
    # Frozen without a full collection first: the imports leave no cyclic garbage (0
    # objects found) and the collection cost 10-30 ms before the first warm parent.
    gc.freeze()
    zygote = ZygoteProcess(sock, controller)
    try:
        M.send(sock, M.ZygoteReady(os.getpid()))
        zygote.serve()
    except (OSError, EOFError):
        pass


if __name__ == "__main__":
    main()

"""The warm parent: a clean interpreter that prepares once and forks worker sandboxes.

Started by :class:`gym_fork.hosts.process.host.ProcessHost` as
``python -m gym_fork.hosts.process.parent FD`` (never forked from the user's process,
which may hold threads, locks or a CUDA context). It receives the env_fns, imports
what they need once (unpickling them does), then forks one worker per request. It
exits, killing its workers, when the controller closes the control socket or dies.
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import socket
import sys
import traceback

import cloudpickle

from gym_fork.hosts import linux
from gym_fork.hosts.control import recv_message, send_message


class WarmParent:
    """State of the warm parent process: its env_fns and its live workers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.env_fns = None
        self.children: dict[int, int | None] = {}  # pid -> exit code (None: running)

    def prepare(self, message: dict) -> None:
        sys.path[:] = message["sys_path"]
        with contextlib.suppress(OSError):
            os.chdir(message["cwd"])
        registry = cloudpickle.loads(message["registry"])
        from gymnasium.envs.registration import registry as local_registry

        for env_id, spec in registry.items():
            local_registry.setdefault(env_id, spec)
        self.env_fns = cloudpickle.loads(message["env_fns"])
        # Objects alive now are shared copy-on-write with every worker: keep the
        # collector from touching (and so copying) their pages after fork.
        gc.collect()
        gc.freeze()

    def spawn(self, message: dict, fds: list[int]) -> int:
        channel_fd, slab_fd = fds
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                linux.die_with_parent(parent_pid)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                self.sock.close()
                from gym_fork.worker.loop import serve

                serve(
                    channel_fd,
                    message["ring_capacity"],
                    slab_fd,
                    message["indices"],
                    self.env_fns,
                    message["name"],
                )
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(channel_fd)
        os.close(slab_fd)
        self.children[pid] = None
        return pid

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children[pid] = os.waitstatus_to_exitcode(status)

    def kill_children(self) -> None:
        for pid, code in self.children.items():
            if code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline_reaps = 50
        while deadline_reaps and any(c is None for c in self.children.values()):
            self.reap()
            select.select([], [], [], 0.01)
            deadline_reaps -= 1

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
                    pid = self.spawn(message, fds)
                    send_message(self.sock, {"op": "spawned", "pid": pid})
                except Exception as exc:
                    send_message(self.sock, {"op": "error", "error": repr(exc)})
            elif op == "status":
                self.reap()
                send_message(self.sock, {"op": "status", "code": self.children.get(message["pid"])})
            elif op == "exit":
                return


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides about Ctrl-C
    parent = WarmParent(sock)
    try:
        message, _ = recv_message(sock)
        if message.get("die_with_controller"):
            linux.die_with_parent(message["controller_pid"])
        try:
            parent.prepare(message)
        except Exception as exc:
            send_message(
                sock,
                {
                    "op": "error",
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(),
                },
            )
            return
        send_message(sock, {"op": "ready", "pid": os.getpid()})
        parent.serve()
    except (EOFError, ConnectionError):
        pass
    finally:
        parent.kill_children()


if __name__ == "__main__":
    main()

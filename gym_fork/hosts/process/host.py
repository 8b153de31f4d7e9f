"""Controller side of the process host: one warm parent, many forked worker sandboxes."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

import gym_fork
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.control import recv_message, send_message
from gym_fork.hosts.linux import ProcessWatch
from gym_fork.transport.channel import Channel

_PACKAGE_ROOT = str(Path(gym_fork.__file__).resolve().parent.parent)


@dataclass
class WorkerHandle:
    """A running worker sandbox as the controller sees it."""

    name: str
    indices: list[int]
    channel: Channel
    pid: int
    watch: ProcessWatch
    awaiting: int = 0  # seq of the reply this worker still owes, 0 if none
    dead: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        if self.dead:
            return False
        if not self.watch.alive():
            self.dead = True
        return not self.dead


class ProcessHost:
    """Starts a warm parent from a clean interpreter and asks it to fork workers.

    ``env_fns`` travel once, with cloudpickle, together with the controller's
    ``sys.path``, working directory and Gymnasium registry (so that envs registered at
    run time resolve in the sandbox as they do in the caller).
    """

    kind = "process"

    def __init__(self, env_fns, *, start_timeout: float = 120.0) -> None:
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gym_fork.hosts.process.parent", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            theirs.close()
        self.sock = ours
        self.watch = ProcessWatch(self.process.pid)
        from gymnasium.envs.registration import registry

        try:
            payload = cloudpickle.dumps(list(env_fns))
        except Exception as exc:
            self.close()
            raise SandboxStartError(f"env_fns cannot be pickled for the sandbox: {exc}") from exc
        send_message(
            self.sock,
            {
                "op": "init",
                "env_fns": payload,
                "sys_path": list(sys.path),
                "cwd": os.getcwd(),
                "registry": cloudpickle.dumps(dict(registry)),
                "controller_pid": os.getpid(),
                "die_with_controller": threading.current_thread() is threading.main_thread(),
            },
        )
        reply = self._request_reply(start_timeout, what="warm parent start")
        if reply["op"] != "ready":
            self.close()
            raise SandboxStartError(
                f"the warm parent could not prepare the env_fns: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}"
            )
        self.pid = reply["pid"]

    def _request_reply(self, timeout: float | None, what: str) -> dict:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            self.close()
            raise SandboxStartError(f"{what}: no answer within {timeout} s")
        try:
            message, _ = recv_message(self.sock)
        except (EOFError, ConnectionError) as exc:
            code = self.process.poll()
            raise SandboxStartError(f"{what}: the warm parent died (exit code {code})") from exc
        return message

    def spawn(
        self, name: str, indices: list[int], slab_fd: int, ring_capacity: int
    ) -> WorkerHandle:
        """Fork a worker for the sub-envs at ``indices`` from the warm parent."""
        channel = Channel.create(name, ring_capacity)
        with self._lock:
            try:
                send_message(
                    self.sock,
                    {
                        "op": "spawn",
                        "name": name,
                        "indices": indices,
                        "ring_capacity": ring_capacity,
                    },
                    fds=(channel.region.fd, slab_fd),
                )
                reply = self._request_reply(30.0, what=f"spawn {name}")
            except (OSError, SandboxStartError):
                channel.close()
                raise
        if reply["op"] != "spawned":
            channel.close()
            raise SandboxStartError(f"spawn {name}: {reply.get('error')}")
        pid = reply["pid"]
        return WorkerHandle(name, list(indices), channel, pid, ProcessWatch(pid))

    def exit_code(self, pid: int) -> int | None:
        """Exit code of a worker (negative: signal), None if unknown or running."""
        with self._lock:
            try:
                send_message(self.sock, {"op": "status", "pid": pid})
                return self._request_reply(2.0, what="status").get("code")
            except (OSError, SandboxStartError, EOFError):
                return None

    @property
    def isolation(self) -> dict[str, Any]:
        """What separates sandboxes on this host, as achieved (not as hoped)."""
        return {"host": self.kind, "process": True, "address_space": "copy-on-write fork"}

    def close(self, timeout: float = 2.0) -> None:
        """Tell the warm parent to exit (it kills its workers) and reap it."""
        sock, self.sock = getattr(self, "sock", None), None
        if sock is not None:
            with contextlib.suppress(OSError):
                send_message(sock, {"op": "exit"})
            sock.close()
        process = getattr(self, "process", None)
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        watch = getattr(self, "watch", None)
        if watch is not None:
            watch.close()

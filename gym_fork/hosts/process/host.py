"""Controller side of the process host: one warm parent, many forked worker sandboxes."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

import gym_fork
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.process.output import OutputCollector
from gym_fork.system.isolation import IsolationConfig
from gym_fork.system.linux import ProcessWatch, raise_fd_limit
from gym_fork.system.scratch import remove_scratch
from gym_fork.transport.channel import Channel
from gym_fork.transport.control import recv_message, send_message

# Sandboxes per spawn message: each takes SandboxEnds.FDS_PER_SANDBOX fds and the kernel
# passes at most 253 per message.
SPAWN_BATCH = 60

_PACKAGE_ROOT = str(Path(gym_fork.__file__).resolve().parent.parent)


@dataclass
class WorkerHandle:
    """A running worker sandbox as the controller sees it."""

    name: str
    indices: list[int]
    channel: Channel
    pid: int
    watch: ProcessWatch
    sock: socket.socket | None = None  # side channel for fds (fork), not the hot path
    origins: list[int] = field(default_factory=list)
    output: OutputCollector | None = None
    awaiting: int = 0  # seq of the reply this worker still owes, 0 if none
    dead: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def output_tail(self, stream: str = "stderr") -> str:
        """The last bytes this sandbox wrote on ``stream``."""
        return self.output.tail(str(self.pid), stream) if self.output is not None else ""

    def alive(self) -> bool:
        if self.dead:
            return False
        if not self.watch.alive():
            self.dead = True
        return not self.dead

    def release(self) -> None:
        """Close the controller's ends of this worker's channel, socket and pidfd.

        The sandbox must be dead or closed: its scratch directory is removed too (when
        it is a host path; inside a namespaced tree the warm parent removes it).
        """
        scratch = self.info.get("scratch")
        if scratch and not scratch.startswith("/proc/"):
            remove_scratch(scratch)
        if self.output is not None:
            self.output.forget(str(self.pid))
        self.watch.close()
        self.channel.close()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@dataclass
class WorkerSpec:
    """What a new worker sandbox hosts: sub-env ``indices`` built from ``origins``."""

    name: str
    indices: list[int]
    origins: list[int]


class SandboxEnds:
    """What the controller makes for a new sandbox before it exists: its channel, side
    socket and output pipes. ``fds()`` are handed over (spawn or fork); then
    ``handed_over()`` closes the controller's copies of the sandbox's ends."""

    FDS_PER_SANDBOX = 4

    def __init__(self, spec: WorkerSpec, ring_capacity: int, output: OutputCollector) -> None:
        self.spec = spec
        self.output = output
        self.channel = Channel.create(spec.name, ring_capacity)
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        (self.out_r, self.out_w), (self.err_r, self.err_w) = output.new_pipes()

    def fds(self) -> list[int]:
        return [self.channel.region.fd, self.theirs.fileno(), self.out_w, self.err_w]

    def handed_over(self) -> None:
        self.theirs.close()
        os.close(self.out_w)
        os.close(self.err_w)
        self.channel.region.forget_fd()  # mapped already; the sandbox holds its own fd

    def abort(self) -> None:
        """The sandbox was never made: close everything."""
        self.channel.close()
        self.ours.close()
        for fd in (self.out_r, self.err_r):
            os.close(fd)

    def handle(self, pid: int) -> WorkerHandle:
        self.output.watch(str(pid), self.out_r, self.err_r)
        return WorkerHandle(
            self.spec.name,
            list(self.spec.indices),
            self.channel,
            pid,
            ProcessWatch(pid),
            self.ours,
            list(self.spec.origins),
            output=self.output,
        )


def hand_over(ends: list[SandboxEnds], exchange: Callable[[], Any]) -> Any:
    """Run ``exchange`` (send the ends' fds, wait for the answer), then close the
    controller's copies of the sandboxes' ends; if it fails, close everything."""
    try:
        result = exchange()
    except BaseException:
        for end in ends:
            end.handed_over()
            end.abort()
        raise
    for end in ends:
        end.handed_over()
    return result


def raise_prepare_failure(reply: dict, what: str) -> None:
    """Raise what the warm parent (``what``) raised while preparing the env_fns: the
    original exception with its traceback as a note, or a SandboxStartError."""
    exc = None
    if reply.get("exception") is not None:
        try:
            exc = cloudpickle.loads(reply["exception"])
        except Exception:
            exc = None
    if isinstance(exc, BaseException):
        exc.add_note(
            f"[gym_fork] raised while preparing {what}; its traceback:\n"
            + reply.get("traceback", "")
        )
        raise exc
    raise SandboxStartError(
        f"{what} could not prepare the env_fns: {reply.get('error')}\n{reply.get('traceback', '')}"
    )


class ProcessHost:
    """Starts a warm parent from a clean interpreter and asks it to fork workers.

    ``env_fns`` travel once, with cloudpickle, together with the controller's
    ``sys.path``, working directory and Gymnasium registry (so that envs registered at
    run time resolve in the sandbox as they do in the caller).
    """

    kind = "process"

    def __init__(
        self,
        env_fns,
        *,
        prepare: tuple | None = None,
        prepare_in_sandbox: bool = False,
        isolation: IsolationConfig | None = None,
        start_timeout: float | None = None,
        echo_output: bool = True,
    ) -> None:
        self.isolation_config = isolation or IsolationConfig()
        self.output = OutputCollector(echo=echo_output)
        raise_fd_limit()
        self._lock = threading.Lock()
        self._users = 1
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
                "prepare": None if prepare is None else cloudpickle.dumps(prepare),
                "prepare_in_sandbox": prepare_in_sandbox,
                "isolation": cloudpickle.dumps(self.isolation_config),
            },
        )
        try:
            reply = self._request_reply(start_timeout, what="warm parent start")
        except SandboxStartError:
            self.close()
            raise
        if reply["op"] != "ready":
            self.close()
            raise_prepare_failure(reply, "the warm parent")
        self.pid = reply["pid"]
        self.prepare_seconds = reply.get("prepare_seconds", 0.0)
        self.tree_isolation = reply.get("isolation", {})

    def _request_reply(self, timeout: float | None, what: str) -> dict:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            raise SandboxStartError(f"{what}: no answer within {timeout} s")
        try:
            message, _ = recv_message(self.sock)
        except (EOFError, ConnectionError) as exc:
            code = self.process.poll()
            raise SandboxStartError(f"{what}: the warm parent died (exit code {code})") from exc
        return message

    def spawn(
        self,
        specs: list[WorkerSpec],
        slab_fd: int,
        ring_capacity: int,
        attach: bytes | None = None,
    ) -> list[WorkerHandle]:
        """Fork one worker per spec from the warm parent (batched, one message per 100).

        ``attach`` (the pickled attach argument) makes the workers attach to the slab
        at once, for replacements whose spaces the controller already knows.
        """
        handles: list[WorkerHandle] = []
        for start in range(0, len(specs), 100):
            handles += self._spawn_batch(specs[start : start + 100], slab_fd, ring_capacity, attach)
        return handles

    def _spawn_batch(
        self, specs: list[WorkerSpec], slab_fd: int, ring_capacity: int, attach: bytes | None
    ) -> list[WorkerHandle]:
        ends = [SandboxEnds(spec, ring_capacity, self.output) for spec in specs]
        fds = [slab_fd]
        for end in ends:
            fds += end.fds()
        message = {
            "op": "spawn",
            "attach": attach,
            "workers": [
                {
                    "name": spec.name,
                    "indices": spec.indices,
                    "origins": spec.origins,
                    "ring_capacity": ring_capacity,
                }
                for spec in specs
            ],
        }

        def exchange() -> dict:
            with self._lock:
                send_message(self.sock, message, fds=tuple(fds))
                return self._request_reply(60.0, what=f"spawn {specs[0].name}")

        reply = hand_over(ends, exchange)
        if reply["op"] != "spawned":
            for end in ends:
                end.abort()
            raise SandboxStartError(f"spawn {specs[0].name}: {reply.get('error')}")
        return [end.handle(pid) for end, pid in zip(ends, reply["pids"], strict=True)]

    def alive(self) -> bool:
        """Health check of the warm parent (its sandboxes die with it)."""
        return self.sock is not None and self.process.poll() is None

    def acquire(self) -> ProcessHost:
        """One more vector env (a root or a branch) uses this warm parent."""
        self._users += 1
        return self

    def release(self) -> None:
        """A user is done; the last one closes the warm parent and its sandboxes."""
        self._users -= 1
        if self._users <= 0:
            self.close()

    def exit_code(self, pid: int) -> int | None:
        """Exit code of a worker (negative: signal), None if unknown or running."""
        with self._lock:
            try:
                send_message(self.sock, {"op": "status", "pid": pid})
                return self._request_reply(2.0, what="status").get("code")
            except (OSError, SandboxStartError, EOFError):
                return None

    def isolation(self, sandbox: dict[str, Any] | None = None) -> dict[str, Any]:
        """What separates sandboxes on this host, as achieved (not as hoped).

        ``sandbox`` is the report of one sandbox (its HELLO); without it, the tree's.
        """
        report = sandbox or {"tree": {}, "sandbox": {}, "limits": {}, "missing": {}}
        tree = report.get("tree") or self.tree_isolation.get("tree", {})
        missing = dict(self.tree_isolation.get("missing", {}))
        missing.update(report.get("missing", {}))
        return {
            "host": self.kind,
            "process": True,
            "address_space": "copy-on-write fork",
            "network": "off" if tree.get("net") else "host",
            "namespaces": {
                "mount": bool(report.get("sandbox", {}).get("mount")),
                "ipc": bool(report.get("sandbox", {}).get("ipc")),
                "uts": bool(tree.get("uts")),
                "net": bool(tree.get("net")),
                "pid": False,
            },
            "private_tmp": bool(report.get("sandbox", {}).get("private_tmp")),
            "no_new_privs": bool(report.get("sandbox", {}).get("no_new_privs")),
            "limits": report.get("limits", {}),
            "missing": missing,
        }

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
            self.watch = None
        output = getattr(self, "output", None)
        if output is not None:
            output.close()
            self.output = None

"""Controller side of the process host: one warm parent, many forked worker sandboxes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

import gym_fork
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.base import (
    AskWorker,
    CloneOrder,
    HostConfig,
    IsolationReport,
    SharedByBranches,
    WorkerHandle,
    WorkerSpec,
    init_message,
    raise_prepare_failure,
)
from gym_fork.hosts.output import OutputCollector
from gym_fork.hosts.process.sandbox import FDS_PER_SANDBOX
from gym_fork.system.linux import ProcessWatch, raise_fd_limit, wait_readable
from gym_fork.transport.channel import Channel
from gym_fork.transport.control import recv_message, send_message
from gym_fork.worker import protocol as P

# Sandboxes per spawn or fork message: each takes FDS_PER_SANDBOX fds, plus the slab's,
# and the kernel passes at most 253 fds in one message (SCM_MAX_FD).
SPAWN_BATCH = 60
assert 1 + SPAWN_BATCH * FDS_PER_SANDBOX <= 253

_PACKAGE_ROOT = str(Path(gym_fork.__file__).resolve().parent.parent)


class SandboxEnds:
    """What the controller makes for a new sandbox before it exists: its channel, side
    socket and output pipes. ``fds()`` are handed over (spawn or fork); then
    ``handed_over()`` closes the controller's copies of the sandbox's ends."""

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
            list(self.spec.origins),
            output=self.output,
            host_data=self.ours,  # the side socket: fds for FORK travel on it
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


class ProcessHost(SharedByBranches):
    """Starts a warm parent from a clean interpreter and asks it to fork workers.

    ``env_fns`` travel once, with cloudpickle, in the init message
    (:func:`gym_fork.hosts.base.init_message`).
    """

    kind = "process"
    slab_min_bytes = 0

    def __init__(self, config: HostConfig, *, echo_output: bool = True) -> None:
        self.config = config
        self.output: OutputCollector | None = OutputCollector(echo=echo_output)
        raise_fd_limit()
        self._lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.watch: ProcessWatch | None = None
        self.process: subprocess.Popen | None = None
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
        try:
            message = init_message(config)
            message["controller_pid"] = os.getpid()
            message["die_with_controller"] = threading.current_thread() is threading.main_thread()
            message["isolation"] = cloudpickle.dumps(config.isolation)
            send_message(self.sock, message)
            reply = self._request_reply(config.start_timeout, what="warm parent start")
            if reply["op"] != "ready":
                raise_prepare_failure(reply, "the warm parent", trusted=config.trusted)
        except BaseException:
            self.close()
            raise
        self.pid = int(reply["pid"])
        self.gpu_pid: int | None = self.pid
        self.tree_isolation = reply.get("isolation", {})

    def _request_reply(self, timeout: float | None, what: str) -> dict:
        if not wait_readable(self.sock.fileno(), timeout):
            raise SandboxStartError(f"{what}: no answer within {timeout} s")
        try:
            message, _ = recv_message(self.sock)
        except (EOFError, ConnectionError) as exc:
            code = self.process.poll()
            raise SandboxStartError(f"{what}: the warm parent died (exit code {code})") from exc
        return message

    def spawn(
        self,
        specs: Sequence[WorkerSpec],
        slab_fd: int,
        ring_capacity: int,
        attach: bytes | None = None,
    ) -> list[WorkerHandle]:
        """Fork one worker per spec from the warm parent (SPAWN_BATCH per message).

        ``attach`` (the pickled attach argument) makes the workers attach to the slab
        at once, for replacements whose spaces the controller already knows.
        """
        handles: list[WorkerHandle] = []
        try:
            for start in range(0, len(specs), SPAWN_BATCH):
                batch = list(specs[start : start + SPAWN_BATCH])
                handles += self._spawn_batch(batch, slab_fd, ring_capacity, attach)
        except BaseException:
            for handle in handles:
                handle.kill()
                handle.release()
            raise
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

    def fork(
        self,
        source: WorkerHandle,
        orders: Sequence[CloneOrder],
        num_envs: int,
        slab_fd: int,
        ring_capacity: int,
        ask: AskWorker,
    ) -> list[WorkerHandle]:
        """Ask the worker ``source`` to fork its sub-envs (SPAWN_BATCH per request): the
        clones' channels, sockets and output pipes travel on its side socket."""
        handles: list[WorkerHandle] = []
        try:
            for start in range(0, len(orders), SPAWN_BATCH):
                batch = list(orders[start : start + SPAWN_BATCH])
                handles += self._fork_batch(source, batch, num_envs, slab_fd, ring_capacity, ask)
        except BaseException:
            for handle in handles:
                handle.kill()
                handle.release()
            raise
        return handles

    def _fork_batch(self, source, orders, num_envs, slab_fd, ring_capacity, ask):
        ends = [SandboxEnds(order.spec, ring_capacity, self.output) for order in orders]
        fds = [slab_fd]
        for end in ends:
            fds += end.fds()
        clones = [[o.source_index, o.branch_index, o.seed, o.spec.name] for o in orders]

        def exchange() -> list[int]:
            send_message(source.host_data, {"op": "fork"}, fds=tuple(fds))
            arg = {"clones": clones, "num_envs": num_envs, "ring_capacity": ring_capacity}
            return ask(P.FORK, arg)

        pids = hand_over(ends, exchange)
        return [end.handle(pid) for end, pid in zip(ends, pids, strict=True)]

    def alive(self) -> bool:
        """Health check of the warm parent (its sandboxes die with it)."""
        return self.sock is not None and self.process.poll() is None

    def exit_code(self, worker: WorkerHandle) -> int | None:
        """Exit code of a worker (negative: signal), None if unknown or running."""
        if self.sock is None:
            return None
        with self._lock:
            try:
                send_message(self.sock, {"op": "status", "pid": worker.pid})
                code = self._request_reply(2.0, what="status").get("code")
            except (OSError, SandboxStartError, EOFError):
                return None
        return code if isinstance(code, int) else None

    def check_slab(self, nbytes: int) -> None:
        """Any slab fits: it is a memfd of the size the vector env asks for."""

    def isolation(self, sandbox: dict[str, Any] | None = None) -> IsolationReport:
        """What separates sandboxes on this host, as achieved (not as hoped).

        ``sandbox`` is the report of one sandbox (its HELLO); without it, the tree's.
        """
        report = sandbox or {"tree": {}, "sandbox": {}, "limits": {}, "missing": {}}
        tree = report.get("tree") or self.tree_isolation.get("tree", {})
        own = report.get("sandbox", {})
        missing = dict(self.tree_isolation.get("missing", {}))
        missing.update(report.get("missing", {}))
        return IsolationReport(
            host=self.kind,
            network="off" if tree.get("net") else "host",
            namespaces={
                "mount": bool(own.get("mount")),
                "ipc": bool(own.get("ipc")),
                "uts": bool(tree.get("uts")),
                "net": bool(tree.get("net")),
                "pid": False,
            },
            private_tmp=bool(own.get("private_tmp")),
            no_new_privs=bool(own.get("no_new_privs")),
            limits=report.get("limits", {}),
            missing=missing,
            details={"process": True, "address_space": "copy-on-write fork"},
        )

    def close(self, timeout: float = 2.0) -> None:
        """Tell the warm parent to exit (it kills its workers) and reap it."""
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                send_message(sock, {"op": "exit"})
            sock.close()
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.output is not None:
            self.output.close()
            self.output = None
